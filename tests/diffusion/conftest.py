"""Fixtures for the diffusion plugin: offline tiny SD3 / FLUX and policies built from them."""

from __future__ import annotations

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
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two spin-waiting threads are slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_policy(tiny_sd3_dir, one_thread):
    """make_policy(engine_args..., lora=0, need_reference=False, model=tiny SD3,
    max_sequence_length=1, policy_args=None) -> (policy, engine built with those engine
    options); ``policy_args`` adds to the policy kind's options."""
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.policy import PolicyConfig
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
