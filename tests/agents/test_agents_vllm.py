"""The multi-turn workflow on the vLLM engine: every active episode goes into one engine call
per round, and the spliced record reproduces the engine's log-probs token by token (so the
ids, their order and their context are what vLLM sampled from)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.record import strings  # noqa: E402
from polyrl.core.rollout.engine import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

GRIDS = [["S.H", "...", "H.G"], ["S..", ".H.", "..G"], ["G..", ".H.", "..S"], [".S.", "H..", "G.."]]


def test_multi_turn_on_vllm_batches_rounds_and_keeps_exact_ids(grid_model_dir, items):
    from polyrl.agents.gridworld import render
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.rollout.vllm_engine import VLLMEngine
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policy = CausalLMPolicy(
        "main", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    engine = VLLMEngine(policy, seed=0, max_model_len=512, kv_cache_gb=0.0625)
    try:
        wf = MultiTurn(
            Context(None, {"main": policy}, {"main": engine}),
            env="gridworld",
            env_args={"invalid": "slip"},
            mode="concat",
            max_turns=4,
            max_turn_tokens=4,
        )
        rows = [{"prompt": render(g, (0, 0)), "grid": g, "answer": "0"} for g in GRIDS]
        calls_before = engine.calls
        rec = wf.rollout(items(rows), SamplingParams(n=4, temperature=1.0, max_new_tokens=4))
        metas = strings(rec, "meta")
        assert rec.batch_size[0] == 16
        # one engine call per round, each carrying every episode still running
        rounds = max(m["turns"] for m in metas)
        assert engine.calls - calls_before == wf.generate_calls == rounds
        assert sum(m["turns"] for m in metas) > rounds  # episodes really shared the calls
        # the trainer's log-probs over the record equal vLLM's for every sampled token
        with torch.no_grad():
            lp, _ = policy.logprobs(rec, 1.0)
        mask = rec["loss_mask"].bool()
        assert int(mask.sum()) == sum(e - s for m in metas for _, s, e in m["spans"])
        diff = (lp[mask] - rec["rollout_logprobs"][mask]).abs()
        print(
            f"|vLLM - trainer| over {diff.numel()} sampled tokens: mean {diff.mean():.2e}, "
            f"max {diff.max():.2e}"
        )
        assert diff.mean() <= 1e-3 and diff.max() <= 1e-2
        assert bool((rec["rollout_logprobs"][~mask] == 0).all())
    finally:
        engine.close()
