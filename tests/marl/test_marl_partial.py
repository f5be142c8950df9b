"""``rollout.partial`` with a marl workflow: each agent row records the weights version of
every token, its log-probs equal an independent reference that switches weights where the
engine did, and the staleness bound holds through the core loop."""

from __future__ import annotations

import torch

from polyrl.core.record import strings
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.marl import JOINT_POLICY
from polyrl.marl.signaling import make_row
from tests.helpers.partial import check_partial_run, mixed_logprobs, moved

ROWS = [
    make_row("apple", ["cat", "apple", "dog"], "QXZJ"),
    make_row("dog", ["dog", "ball", "cat"], "QXZJ"),
]


def test_agent_rows_record_token_versions_equal_to_a_switching_reference(marl_config, make_items):
    from polyrl.core.registry import POLICIES, WORKFLOWS
    from polyrl.core.rollout.rollouts import shadow
    from polyrl.core.rollout.workflow import Context

    cfg = marl_config()
    policies = {
        n: shadow(POLICIES.get(p.kind)(n, p, total_steps=1, need_reference=False, shared={}))
        for n, p in cfg.policies.items()
    }
    listener = policies["listener"].model
    old = {k: v.clone() for k, v in listener.state_dict().items()}
    new = moved(old, 0.05, seed=1)
    calls: list[int] = []

    def switching() -> int:  # the listener's second refresh loads the new weights
        calls.append(1)
        if len(calls) == 2:
            listener.load_state_dict(new)
        return int(len(calls) >= 2)

    engines = {n: HFEngine(p, seed=i) for i, (n, p) in enumerate(policies.items())}
    engines["speaker"].set_refresh(lambda: 0)
    engines["listener"].set_refresh(switching)
    wf = WORKFLOWS.get(cfg.rollout.workflow)(Context(cfg, policies, engines), **cfg.rollout.args)
    rec = wf.rollout(make_items(ROWS), SamplingParams(n=2, max_new_tokens=2))

    ref = shadow(policies["speaker"]).model  # same architecture; weights loaded per version
    states = {"speaker": {0: policies["speaker"].model.state_dict()}, "listener": {0: old, 1: new}}
    seen: dict[str, set] = {"speaker": set(), "listener": set()}
    gaps = []
    policy = strings(rec, "policy")
    for i in range(rec.batch_size[0]):
        n = int(rec["response_mask"][i].sum())
        versions = rec["token_version"][i, :n].tolist()
        if policy[i] == JOINT_POLICY:
            assert n == 0
            continue
        seen[policy[i]].update(versions)
        prompt = rec["prompt_ids"][i][rec["prompt_mask"][i].bool()].tolist()
        tokens = rec["response_ids"][i, :n].tolist()
        mixed = mixed_logprobs(ref, states[policy[i]], prompt, tokens, versions)
        gaps.append(float((mixed - rec["rollout_logprobs"][i, :n]).abs().max()))
    assert seen == {"speaker": {0}, "listener": {0, 1}}  # a listener row spans the switch
    assert max(gaps) < 1e-4


def test_marl_partial_rollouts_keep_the_staleness_bound(marl_config):
    from polyrl.core.loop import train

    engine = "tests.helpers.crawling_engine:CrawlingEngine"
    cfg = marl_config(
        "train.steps=3",
        "rollout.max_staleness=1",
        "rollout.partial=true",
        f"policies.speaker.engine.name={engine}",
        f"policies.listener.engine.name={engine}",
        "run.save_every=0",
        "eval.every=0",
    )
    run = train(cfg)
    steps = check_partial_run(run.path, 3)
    assert torch.isfinite(torch.tensor([steps[3]["speaker/loss"], steps[3]["listener/loss"]])).all()
