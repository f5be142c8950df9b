"""A marl team's agent rows of a mixture-of-experts policy carry the experts the engine
routed their tokens to, so routing replay works on them (issue 32). The checks are
tests/helpers/moe.py's, against whole-row forwards with hand-computed or told routing."""

from __future__ import annotations

from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.record import strings
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.marl.signaling import make_row
from tests.helpers.moe import check_replayed_rows

E = 4


def test_marl_agent_rows_carry_and_replay_the_engines_experts(
    marl_config, make_items, tmp_path, one_thread
):
    from polyrl.core.registry import POLICIES, WORKFLOWS
    from polyrl.core.rollout.workflow import Context

    moe = tiny_qwen3_moe(tmp_path / "moe", corpus="signaling", num_experts=E, num_layers=2)
    names = ("speaker", "listener")
    cfg = marl_config(
        *(f"policies.{n}.{k}" for n in names for k in (f"model={moe}", "moe.replay=rollout")),
        "rollout.workflow=parallel",
        "rollout.args={agents: [{name: a, policy: speaker}, {name: b, policy: listener}]}",
    )
    pols = {
        n: POLICIES.get(p.kind)(n, p, total_steps=1, need_reference=False)
        for n, p in cfg.policies.items()
    }
    engines = {n: HFEngine(p, seed=i) for i, (n, p) in enumerate(pols.items())}
    wf = WORKFLOWS.get(cfg.rollout.workflow)(Context(cfg, pols, engines), **cfg.rollout.args)
    rows = [make_row("apple", ["cat", "apple"], "QXZJ"), make_row("dog", ["dog"], "QXZJ")]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, stop_token_ids=[])
    rec = wf.rollout(make_items(rows), params)
    policy = strings(rec, "policy")
    for n in names:
        idx = [i for i, p in enumerate(policy) if p == n]
        assert len(idx) == 4
        check_replayed_rows(pols[n], rec[idx], E)
