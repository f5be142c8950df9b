"""Routing replay on the Ray backend (issue 32): an FSDP2 group of two workers updating the
tiny Qwen3-MoE with ``moe.replay: rollout`` matches the single-process update: loss,
gradient norm, the routing mismatch metric and the weights after it.

The record comes from an engine that routes differently from the trainer
(tests/helpers/perturbed_engine.py, ``route_noise``), so replay changes the update: the local
update without replay is checked to differ, so the match is not that of two free routings.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.record import Row, build_rows
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import group_credit
from tests.helpers.distributed import ray_config
from tests.helpers.trainer import chat_ids

ENGINE = f"{Path(__file__).parents[1] / 'helpers' / 'perturbed_engine.py'}:PerturbedEngine"


def _record(policy, seed: int):
    """A GRPO-ready record of routing-perturbed samples with their recorded experts."""
    ids = chat_ids(policy.tokenizer)
    engine = ENGINES.get(ENGINE)(policy, seed=seed, route_noise=0.5)
    outs = engine.generate(ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=6))
    rows = [Row(o.prompt, o.tokens, "main", o.prompt_index) for o in outs]
    rec = build_rows(rows, policy.tokenizer.pad_token_id)
    rec["reward"] = torch.randint(
        0, 2, (len(outs),), generator=torch.Generator().manual_seed(seed)
    ).float()
    group_credit(rec, AlgorithmConfig())
    return rec


@pytest.mark.ray
def test_replayed_moe_update_matches_local(ray_cluster, tmp_path):
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.train import trainer

    model = str(tiny_qwen3_moe(tmp_path / "moe", pretrain_steps=30))
    # no load-balancing term: it is computed per micro-batch on each rank, and E * sum f * P
    # over half a micro-batch's tokens is not half of it over all, so it rightly differs
    cfg = ray_config(model, "policies.main.moe.replay=rollout")
    free = ray_config(model)  # the same policy without replay
    backend = RayBackend(cfg)
    try:
        remote = backend.make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        local = LocalBackend(cfg).make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        unreplayed = LocalBackend(free).make_policy(
            "main", free.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        batch = _record(local, seed=0)
        algo = AlgorithmConfig(ppo_epochs=2, minibatches=2)
        g_local, g_ray, g_free = (torch.Generator().manual_seed(3) for _ in range(3))
        out_l = trainer.update(local, batch.clone(), algo, generator=g_local)
        out_r = backend.update(remote, batch.clone(), algo, temperature=1.0, generator=g_ray)
        out_f = trainer.update(unreplayed, batch.clone(), algo, generator=g_free)
        assert out_r["loss"] == pytest.approx(out_l["loss"], rel=1e-4, abs=1e-7)
        assert out_r["grad_norm"] == pytest.approx(out_l["grad_norm"], rel=1e-4)
        mismatch = "moe/route_mismatch"
        # a mean of per-micro-batch shares, and each rank holds half of each micro-batch
        assert out_l[mismatch] > 0 and out_r[mismatch] == pytest.approx(out_l[mismatch], abs=0.05)
        assert out_f["grad_norm"] != pytest.approx(out_l["grad_norm"], rel=1e-3)
        # The arithmetic is equal up to the order of sums (loss and gradient norm above agree
        # to rounding); Adam is what turns that rounding into weights. Where a gradient
        # element is near zero a 1e-7 difference can flip its update, and one Adam step
        # moves an element by at most lr * max(1, (1 - b1) / sqrt(1 - b2)) (Kingma & Ba,
        # section 2.1), so equal runs may differ there by twice that per optimizer step.
        # Every other element agrees to rounding; the loose ones must stay a small share.
        optim = cfg.policies["main"].optim
        b1, b2 = optim.betas
        steps = algo.ppo_epochs * algo.minibatches
        bound = 2 * steps * optim.lr * max(1.0, (1 - b1) / math.sqrt(1 - b2))
        remote_state, local_state = remote.state_dict(), local.state_dict()
        loose = total = 0
        for k, v in local_state["weights"].items():
            r = remote_state["weights"][k]
            assert float((r - v).abs().max()) <= bound, (k, float((r - v).abs().max()), bound)
            loose += int((~torch.isclose(r, v, rtol=1e-4, atol=1e-6)).sum())
            total += v.numel()
        assert loose <= 0.01 * total, (loose, total)
    finally:
        backend.shutdown()
