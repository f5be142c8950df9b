"""Fixtures for the diffusion plugin: offline tiny SD3 / FLUX and policies built from them."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory) -> str:
    """An untrained tiny SD3 (diffusers layout, PatchVAE, tiny CLIP encoders), built once."""
    from polyrl.diffusion.tiny import tiny_sd3

    path = tmp_path_factory.mktemp("models") / "tiny-sd3"
    tiny_sd3(path, image_size=16, vae_patch=2, layers=1, heads=2, head_dim=16, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> str:
    """An untrained tiny FLUX (FluxPipeline layout, guidance embedding, CLIP + T5), built once."""
    from polyrl.diffusion.tiny import tiny_flux

    path = tmp_path_factory.mktemp("models") / "tiny-flux"
    tiny_flux(
        path, image_size=16, vae_patch=2, layers=1, single_layers=1, heads=2, head_dim=16, seed=0
    )
    return str(path)


@pytest.fixture
def make_policy(tiny_sd3_dir, one_thread):
    """make_policy(engine_args..., lora=0, need_reference=False, model=tiny SD3,
    max_sequence_length=1, policy_args=None) -> (policy, engine built with those engine
    options); ``policy_args`` adds to the policy kind's options."""
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.diffusion.engine import DiffusionEngine, sampling_options
    from polyrl.diffusion.policy import DiffusionPolicy

    def make(
        lora: int = 0,
        need_reference: bool = False,
        lr: float = 1e-3,
        seed: int = 0,
        model: str = tiny_sd3_dir,
        max_sequence_length: int = 1,
        policy_args: dict | None = None,
        **engine_args,
    ):
        args = {"height": 16, "width": 16, "steps": 6, "guidance_scale": 3.0, "batch_size": 64}
        args.update(engine_args)
        cfg = from_dict(
            PolicyConfig,
            {
                "kind": "diffusion",
                "model": model,
                "lora": {"r": lora, "alpha": 2 * lora},
                "args": {"max_sequence_length": max_sequence_length, **(policy_args or {})},
                "optim": {"lr": lr},
                "micro_batch_size": 64,
                "engine": {"name": "diffusion", "args": args},
            },
        )
        policy = DiffusionPolicy(
            "main", cfg, total_steps=10, need_reference=need_reference, device="cpu"
        )
        return policy, DiffusionEngine(policy, seed=seed, **sampling_options(cfg))

    return make


PROMPTS = ["a red blob", "a blue circle", "green", "a yellow blob"]


@pytest.fixture
def prompts() -> list[str]:
    return list(PROMPTS)


@pytest.fixture
def record_of():
    """record_of(policy, engine, prompts=..., n=4) -> (trajectories, rollout record)."""
    from polyrl.diffusion.workflow import diffusion_record

    def make(policy, engine, prompts=PROMPTS, n=4, **kw):
        traj = engine.sample(prompts, n=n, **kw)
        rows = [prompts[i] for i in traj.prompt_index]
        return traj, diffusion_record(
            traj,
            policy="main",
            uid=traj.prompt_index.tolist(),
            prompt_text=rows,
            meta=[{} for _ in rows],
        )

    return make


@pytest.fixture
def diffusion_config(tiny_sd3_dir, tmp_path, one_thread):
    """diffusion_config(*overrides) -> a small text-to-image Config (colour task, tiny SD3)."""

    def make(*overrides: str):
        import polyrl.core  # noqa: F401
        import polyrl.diffusion  # noqa: F401
        from polyrl.core.config import load
        from polyrl.core.recipe import Config

        base = [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "task.name=colour",
            f"task.dir={tmp_path}/data",
            "task.args={n_train: 32, per_colour_eval: 1}",
            "policies.main.kind=diffusion",
            f"policies.main.model={tiny_sd3_dir}",
            "policies.main.engine.name=diffusion",
            "policies.main.lora.r=4",
            "policies.main.engine.args={height: 16, width: 16, steps: 4, guidance_scale: 2.0, "
            "train_steps: {mode: fraction, fraction: 0.5}}",
            "policies.main.args={max_sequence_length: 1}",
            "rollout.workflow=text_to_image",
            "rollout.n=4",
            "rollout.prompts_per_step=3",
            "eval.n=2",
            "eval.accuracy_term=colour_accuracy",
            "reward.terms=[{name: colour}, {name: colour_accuracy, weight: 0.0}]",
            "algorithm.credit=per_prompt",
            "train.steps=2",
        ]
        return load(Config, None, base + list(overrides))

    return make


@pytest.fixture
def two_step_run(diffusion_config):
    """two_step_run(model, engine_args, *overrides) -> (run, metrics of its training steps):
    a small ``polyrl train`` in this process on ``model`` (LoRA r=4, 2 prompts x 3 samples,
    KL 0.01 from the step means), ``engine_args`` the engine's options as YAML; later
    overrides win."""
    from polyrl.core.loop import train

    def run(model: str, engine_args: str, *overrides: str):
        cfg = diffusion_config(
            f"policies.main.model={model}",
            f"policies.main.engine.args={engine_args}",
            "task.args={n_train: 16, per_colour_eval: 1}",
            "rollout.n=3",
            "rollout.prompts_per_step=2",
            "eval.n=1",
            "algorithm.kl_coef=0.01",
            "algorithm.kl_estimator=gaussian_mean",
            *overrides,
        )
        out = train(cfg)
        lines = [json.loads(x) for x in (out.path / "metrics.jsonl").read_text().splitlines()]
        return out, [x for x in lines if "main/loss" in x]

    return run


@pytest.fixture
def first_update_under_ray(ray_cluster, diffusion_config, tmp_path):
    """first_update_under_ray(*overrides) -> the local rollout record, once this held: one
    session per backend (Ray: 2 FSDP2 CPU ranks, the engine on its own actor) samples the
    same trajectories, the first update (LoRA r=4, two mini-batches, the Gaussian-mean KL
    0.1, clipped advantages so the loss is not ~0) gives local mode's loss within 1e-4 and
    its KL and grad norm within 1e-4 relative, and after the sync the engine actor samples
    with the trained weights (the local policy, trained alike, recomputes its log-probs)."""
    from polyrl.core.record import select_policy, valid_rows
    from polyrl.core.runner.session import Session
    from polyrl.core.train.credit import assign

    def rollout(s):
        record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
        s.score(record)
        assign(record, s.cfg.algorithm)
        return record, select_policy(valid_rows(record), "main")

    def check(*overrides: str):
        common = (
            "policies.main.lora.r=4",
            "policies.main.optim.lr=5.0e-3",
            "algorithm.kl_coef=0.1",
            "algorithm.kl_estimator=gaussian_mean",
            "algorithm.minibatches=2",
            "algorithm.credit_args={adv_clip: 1.0}",
            *overrides,
        )
        ray = (
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 2, collective_timeout_s: 120}",
        )
        local = Session.open(diffusion_config(*common, f"run.dir={tmp_path}/local"), record=False)
        remote = Session.open(
            diffusion_config(*common, *ray, f"run.dir={tmp_path}/ray"), record=False
        )
        try:
            rec_l, rows_l = rollout(local)
            rec_r, rows_r = rollout(remote)
            assert torch.equal(rec_r["latents"], rec_l["latents"])
            assert torch.equal(rec_r["rollout_logprobs"], rec_l["rollout_logprobs"])
            assert rec_l["reward"].std() > 0  # the groups have a spread: a real update
            out_l = local.update("main", rows_l.clone())
            out_r = remote.update("main", rows_r.clone())
            print("local", out_l, "\nray  ", out_r)
            assert out_l["kl"] > 0 and abs(out_l["loss"]) > 1e-3
            assert abs(out_r["loss"] - out_l["loss"]) <= 1e-4 * max(1.0, abs(out_l["loss"]))
            for key in ("kl", "grad_norm"):
                assert out_r[key] == pytest.approx(out_l[key], rel=1e-4), key
            remote.engines["main"].sync()
            rec2, _ = rollout(remote)
            mask = rec2["loss_mask"].bool()
            with torch.no_grad():
                now = local.policies["main"].logprobs(rec2)[0]
            before = local.policies["main"].ref_logprobs(rec2)
            gap_now = float((now - rec2["rollout_logprobs"])[mask].abs().max())
            gap_before = float((before - rec2["rollout_logprobs"])[mask].abs().max())
            print("gap to the trained weights", gap_now, "to the initial ones", gap_before)
            assert gap_now < 1e-4 < gap_before
            return rec_l
        finally:
            remote.backend.shutdown()

    return check
