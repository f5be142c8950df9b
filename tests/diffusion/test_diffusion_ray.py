"""Text-to-image GRPO under the Ray backend: the same recipe as in local mode, a 2-rank FSDP2
group, the engine and the colour reward on their own actors.

One session per backend runs the same steps by hand (rollout, reward, credit, update, sync),
so every check reads the objects themselves. The engine actor holds its own copy of the
tiny SD3 with the local engine's seed, so before the first update it samples exactly the
local trajectories; the update runs two mini-batches (the second one sees a moved policy:
its ratio is not 1 and its KL to the reference is not 0), and its loss, KL and grad norm
must equal local mode's. After the sync, the engine's next rollout must carry the log-probs
of the trained weights (not those of the initial ones), and the Ray run's checkpoint and
export must load in local mode and in diffusers.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.ray

RAY = (
    "distributed.backend=ray",
    "distributed.args={workers_per_policy: 2, collective_timeout_s: 120}",
)
COMMON = (
    "algorithm.kl_coef=0.1",
    "algorithm.kl_estimator=gaussian_mean",
    "algorithm.minibatches=2",
    "policies.main.optim.lr=5.0e-3",
    # clipped advantages no longer sum to zero per prompt: the loss is not ~0
    "algorithm.credit_args={adv_clip: 1.0}",
    # the colour term on its own Ray actor (in local mode the key is ignored)
    "reward.terms=[{name: colour, actor: {num_cpus: 0.5}}, {name: colour_accuracy, weight: 0.0}]",
)


def _rollout(s):
    """One training rollout, scored and credited: (record, the policy's valid rows)."""
    from polyrl.core.record import select_policy, valid_rows
    from polyrl.core.train.credit import assign

    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    s.score(record)
    assign(record, s.cfg.algorithm)
    return record, select_policy(valid_rows(record), "main")


def _gaps(policy, record) -> tuple[torch.Tensor, torch.Tensor]:
    """|log-prob - rollout log-prob| on the trained steps, under the policy's weights and
    under its reference (the initial weights: what an engine never synced would give)."""
    mask = record["loss_mask"].bool()
    with torch.no_grad():
        now = policy.logprobs(record)[0]
    ref = policy.ref_logprobs(record)
    rollout = record["rollout_logprobs"]
    return (now - rollout)[mask].abs(), (ref - rollout)[mask].abs()


def _steps_apart(rows):
    """4 rows where rank 0's two train steps 0 and 1, and rank 1's two step 2 only: each
    rank must call the sharded model at steps where it has no row (a zero-weighted
    stand-in), or the ranks' calls (collectives) would not pair up."""
    part = rows[:4].clone()
    mask = torch.zeros_like(part["loss_mask"])
    mask[:2, :2] = 1
    mask[2:, 2] = 1
    part["loss_mask"] = mask
    part["advantages"] = mask * torch.tensor([1.0, 0.5, -0.25, 0.75])[:, None]
    return part


def _check_export(lora: int, out, resumed, weights, model_dir: str) -> None:
    """The Ray export loads with diffusers and holds the Ray-trained weights."""
    from diffusers import StableDiffusion3Pipeline

    kw = {"text_encoder_3": None, "tokenizer_3": None}
    if lora:
        pipe = StableDiffusion3Pipeline.from_pretrained(model_dir, **kw)
        pipe.load_lora_weights(str(out))
        x, t = torch.randn(2, 12, 8, 8), torch.full((2,), 700.0)
        emb, pooled = resumed.encode(["a red blob", "green"])
        with torch.no_grad():
            want = resumed.family.velocity(resumed.model, x, t, emb, pooled)
            got = resumed.family.velocity(pipe.transformer, x, t, emb, pooled)
            with resumed.model.disable_adapter():
                base = resumed.family.velocity(resumed.model, x, t, emb, pooled)
        assert float((want - base).abs().max()) > 1e-3  # the adapter trained: it matters
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        return
    pipe = StableDiffusion3Pipeline.from_pretrained(out, **kw)
    exported = pipe.transformer.state_dict()
    assert exported.keys() == weights.keys()
    for k, v in weights.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
def test_ray_update_sync_checkpoint_and_export_match_local(
    lora, ray_cluster, diffusion_config, tiny_sd3_dir, tmp_path
):
    from polyrl.core.runner.session import Session
    from polyrl.core.train import trainer
    from polyrl.core.train.algorithms import AlgorithmConfig

    common = (*COMMON, f"policies.main.lora.r={lora}")
    local = Session.open(diffusion_config(*common, f"run.dir={tmp_path}/local"), record=False)
    remote = Session.open(diffusion_config(*common, *RAY, f"run.dir={tmp_path}/ray"))
    try:
        # the engine actor samples what the local engine samples; the colour term scores
        # them on its reward actor as the driver does in local mode
        rec_l, rows_l = _rollout(local)
        rec_r, rows_r = _rollout(remote)
        assert torch.equal(rec_r["latents"], rec_l["latents"])
        assert torch.equal(rec_r["rollout_logprobs"], rec_l["rollout_logprobs"])
        assert list(remote.reward_runners) == ["colour"]  # scored on its reward actor
        assert torch.equal(rec_r["reward"], rec_l["reward"])
        assert rec_l["reward"].std() > 0  # the groups have a spread: a real update

        out_l = local.update("main", rows_l.clone())
        out_r = remote.update("main", rows_r.clone())
        print("local", out_l, "\nray  ", out_r)
        assert out_l["kl"] > 0 and abs(out_l["loss"]) > 1e-3
        for key in ("loss", "kl", "grad_norm"):
            assert out_r[key] == pytest.approx(out_l[key], rel=1e-4), key

        # after the sync the engine actor samples with the trained weights: its log-probs are
        # the trainer's (its gathered weights, recomputed here), not the initial weights'
        remote.engines["main"].sync()
        state = remote.policies["main"].state_dict()
        rec2, _ = _rollout(remote)
        # a copy: the optimizer would keep (and later step) the moments' tensors themselves
        local.policies["main"].load_state_dict(copy.deepcopy(state))
        now, before = _gaps(local.policies["main"], rec2)
        print(
            "gap to the trained weights",
            float(now.max()),
            "to the initial ones",
            float(before.max()),
        )
        assert float(now.max()) < 1e-5 and float(before.max()) > 1e-4

        # a Ray checkpoint resumes in local mode (weights, optimizer, engine RNG and count)
        remote.save(1)
        engine_state = remote.engines["main"].state_dict()
        out = remote.policies["main"].export(tmp_path / "export")

        # ranks whose rows train different steps stay in step and give the local update
        part, algo = _steps_apart(rec2), AlgorithmConfig(kl_coef=0.1, kl_estimator="gaussian_mean")
        apart_l = trainer.update(
            local.policies["main"], part.clone(), algo, generator=torch.Generator().manual_seed(0)
        )
        apart_r = remote.backend.update(
            remote.policies["main"],
            part.clone(),
            algo,
            temperature=1.0,
            generator=torch.Generator(),
        )
        print("steps apart: local", apart_l, "\nray  ", apart_r)
        assert apart_l["kl"] > 0 and abs(apart_l["loss"]) > 1e-3
        for key in ("loss", "kl", "grad_norm"):
            assert apart_r[key] == pytest.approx(apart_l[key], rel=1e-4), key
    finally:
        remote.backend.shutdown()
    resumed = Session.open(
        diffusion_config(*common, f"run.dir={tmp_path}/ray", "run.resume=true"), record=False
    )
    restored = resumed.policies["main"].state_dict()
    assert resumed.step == 1 and restored["weights"].keys() == state["weights"].keys()
    for k, v in state["weights"].items():
        assert torch.equal(restored["weights"][k], v), k
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert len(moments) == len(restored["optimizer"]["state"]) > 0
    for i, m in enumerate(moments):
        assert torch.equal(restored["optimizer"]["state"][i]["exp_avg"], m)
    assert resumed.engines["main"].rollouts == engine_state["rollouts"] == 2
    assert torch.equal(resumed.engines["main"].state_dict()["rng"], engine_state["rng"])
    _check_export(lora, out, resumed.policies["main"], state["weights"], tiny_sd3_dir)
