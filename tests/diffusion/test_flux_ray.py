"""FLUX under the Ray backend: the tiny FLUX recipe's first update equals local mode's.

The same recipe opens one session per backend. The Ray engine actor holds its own copy of
the tiny FLUX with the local engine's seed, so it samples the local trajectories; the
policy trains on a 2-rank FSDP2 group. The first update (two mini-batches, LoRA, the
Gaussian-mean KL, FLUX's guidance embedding as an input) must give local mode's loss
within 1e-4, and the engine actor must sample with the trained weights after the sync.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.ray

FLUX = (
    "policies.main.engine.args={height: 16, width: 16, steps: 4, guidance_scale: 3.5, "
    "train_steps: {mode: window, window_start: 0, window_size: 2}}",
    "policies.main.args={max_sequence_length: 8}",
    "policies.main.lora.r=4",
    "policies.main.optim.lr=5.0e-3",
    "algorithm.kl_coef=0.1",
    "algorithm.kl_estimator=gaussian_mean",
    "algorithm.minibatches=2",
    # clipped advantages no longer sum to zero per prompt: the loss is not ~0
    "algorithm.credit_args={adv_clip: 1.0}",
)
RAY = (
    "distributed.backend=ray",
    "distributed.args={workers_per_policy: 2, collective_timeout_s: 120}",
)


def _rollout(s):
    from polyrl.core.credit import assign
    from polyrl.core.record import select_policy, valid_rows

    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    s.score(record)
    assign(record, s.cfg.algorithm)
    return record, select_policy(valid_rows(record), "main")


def test_flux_first_update_under_ray_matches_local(
    ray_cluster, diffusion_config, tiny_flux_dir, tmp_path
):
    from polyrl.core.session import Session

    common = (*FLUX, f"policies.main.model={tiny_flux_dir}")
    local = Session.open(diffusion_config(*common, f"run.dir={tmp_path}/local"), record=False)
    remote = Session.open(diffusion_config(*common, *RAY, f"run.dir={tmp_path}/ray"), record=False)
    try:
        rec_l, rows_l = _rollout(local)
        rec_r, rows_r = _rollout(remote)
        assert rec_l["negative_prompt_embeds"].shape[1] == 0  # FLUX: no unconditional branch
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

        # after the sync the engine actor samples with the trained weights: the local
        # policy, trained the same way, recomputes its log-probs
        remote.engines["main"].sync()
        rec2, _ = _rollout(remote)
        mask = rec2["loss_mask"].bool()
        with torch.no_grad():
            now = local.policies["main"].logprobs(rec2)[0]
        before = local.policies["main"].ref_logprobs(rec2)
        gap_now = float((now - rec2["rollout_logprobs"])[mask].abs().max())
        gap_before = float((before - rec2["rollout_logprobs"])[mask].abs().max())
        print("gap to the trained weights", gap_now, "to the initial ones", gap_before)
        assert gap_now < 1e-4 < gap_before
    finally:
        remote.backend.shutdown()
