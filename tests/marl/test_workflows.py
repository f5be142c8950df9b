"""The built-in workflows on tiny policies: structure, batching rounds, and credit on top."""

from __future__ import annotations

import pytest

from polyrl.core.record import strings
from polyrl.core.rollout import rewards
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.train.credit import assign
from polyrl.marl import JOINT_POLICY

ROWS = [{"prompt": "Target: apple", "answer": "apple"}, {"prompt": "Target: dog", "answer": "dog"}]
THREE = (
    "rollout.args={agents: [{name: a, policy: speaker}, {name: b, policy: speaker}, "
    "{name: c, policy: listener}]"
)


def run(marl_config, build_workflow, make_items, workflow, extra="", n=2):
    cfg = marl_config(f"rollout.workflow={workflow}", THREE + extra + "}")
    wf, calls = build_workflow(cfg)
    rec = wf.rollout(make_items(ROWS), SamplingParams(n=n, temperature=1.0, max_new_tokens=2))
    metrics = rewards.score(rec, cfg.reward)
    metrics |= assign(rec, cfg.algorithm)
    return rec, calls, metrics, wf


def joints_of(rec):
    metas, pol = strings(rec, "meta"), strings(rec, "policy")
    return [metas[i] for i in range(rec.batch_size[0]) if pol[i] == JOINT_POLICY]


def check_trainable(rec):
    """After credit every agent row is valid, and advantages sit only under loss tokens."""
    pol = strings(rec, "policy")
    for i in range(rec.batch_size[0]):
        if pol[i] != JOINT_POLICY:
            assert bool(rec["valid"][i]), strings(rec, "error")[i]
            assert float((rec["advantages"][i] * (1 - rec["loss_mask"][i])).abs().sum()) == 0


def test_parallel(marl_config, build_workflow, make_items):
    rec, calls, _, _ = run(marl_config, build_workflow, make_items, "parallel", ", final: vote")
    assert sorted(calls) == [("listener", 2, 2), ("speaker", 4, 2)]  # one round
    assert len(joints_of(rec)) == 2 * 2
    check_trainable(rec)


def test_chain_each_agent_sees_the_previous_output(marl_config, build_workflow, make_items):
    rec, calls, _, _ = run(marl_config, build_workflow, make_items, "chain")
    assert calls == [("speaker", 2, 2), ("speaker", 4, 1), ("listener", 4, 1)]
    texts, prompts = strings(rec, "response_text"), strings(rec, "prompt_text")
    metas, ids = strings(rec, "meta"), rec["agent_id"].tolist()
    for j in joints_of(rec):
        rows = {
            ids[i]: i for i in range(rec.batch_size[0]) if metas[i].get("joints") == [j["joint"]]
        }
        assert texts[rows[0]] in prompts[rows[1]] and texts[rows[1]] in prompts[rows[2]]
        assert j["final"] == texts[rows[2]]
    check_trainable(rec)


@pytest.mark.parametrize("tree", [False, True])
def test_debate_rounds_and_per_turn_joints(marl_config, build_workflow, make_items, tree):
    extra = ", rounds: 2" + (", tree: true" if tree else "")
    rec, calls, metrics, _ = run(marl_config, build_workflow, make_items, "debate", extra)
    # one generate per policy per round, whatever the number of lines
    assert [c[0] for c in calls] == ["speaker", "listener", "speaker", "listener"]
    joints = joints_of(rec)
    turn1 = [j for j in joints if j["turn"] == 1]
    assert len([j for j in joints if j["turn"] == 0]) == 2 * 2
    assert len(turn1) == 2 * (4 if tree else 2)
    assert all(j["parent"] > 0 for j in turn1)
    # groups: siblings under one parent (tree) or all lines of a turn (no tree)
    nodes = {int(rec["node"][i]) for i in range(rec.batch_size[0]) if int(rec["turn"][i]) == 1}
    assert (nodes != {0}) if tree else (nodes == {0})
    check_trainable(rec)
    assert metrics["marl/joint_actions"] == len(joints)


def test_aggregator(marl_config, build_workflow, make_items):
    rec, calls, _, _ = run(marl_config, build_workflow, make_items, "aggregator")
    assert calls == [("speaker", 4, 2), ("listener", 4, 1)]
    pol, prompts = strings(rec, "policy"), strings(rec, "prompt_text")
    agg = [i for i in range(rec.batch_size[0]) if pol[i] == "listener"]
    assert len(agg) == 4 and all("Proposals:" in prompts[i] for i in agg)
    check_trainable(rec)


def test_workflow_arguments_reach_the_function(marl_config, build_workflow, make_items):
    rec, _, _, _ = run(
        marl_config,
        build_workflow,
        make_items,
        "aggregator",
        ", aggregator: a, template: 'Q {task} {proposals}'",
    )
    pol, prompts = strings(rec, "policy"), strings(rec, "prompt_text")
    ids = rec["agent_id"].tolist()
    agg_rows = [
        i
        for i in range(rec.batch_size[0])
        if pol[i] != JOINT_POLICY and ids[i] == 0 and "Q Target" in prompts[i]
    ]
    assert len(agg_rows) == 4
