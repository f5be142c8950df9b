"""The agent API on tiny real policies: batching per policy, the record, CTDE, errors."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import strings
from polyrl.core.rollout import rewards
from polyrl.core.rollout.engine import SamplingParams, as_requests
from polyrl.core.train.credit import assign
from polyrl.marl import JOINT_POLICY, workflow
from polyrl.marl.signaling import (
    LISTENER_ROLE,
    SPEAKER_ROLE,
    listener_prompt,
    make_row,
    speaker_prompt,
)

ROWS = [
    make_row("apple", ["cat", "apple", "dog"], "QXZJ"),
    make_row("dog", ["dog", "ball", "cat"], "QXZJ"),
    make_row("cat", ["apple", "ball", "cat"], "QXZJ"),
]


def params(n=4, max_new_tokens=2, temperature=1.0):
    return SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens)


class Recorder:
    """An engine wrapper that keeps what the engine returned, to compare with the record."""

    def __init__(self, inner):
        self.inner, self.out = inner, []

    def generate(self, prompts, p):
        res = self.inner.generate(prompts, p)
        requests = as_requests(prompts)
        self.out += [
            (requests[c.prompt_index].prompt, list(c.token_ids), list(c.logprobs)) for c in res
        ]
        return res

    def __getattr__(self, name):
        return getattr(self.inner, name)


def agent_rows(rec):
    return [i for i in range(rec.batch_size[0]) if strings(rec, "policy")[i] != JOINT_POLICY]


def test_one_generate_per_policy_per_round(marl_config, build_workflow, make_items):
    wf, calls = build_workflow(marl_config())
    rec = wf.rollout(make_items(ROWS), params(n=4))
    # round 1: every speaker request (3 prompts x n=4) in one call; round 2: 12 listener acts
    assert calls == [("speaker", 3, 4), ("listener", 12, 1)]
    assert wf.rollout_metrics()["marl/generate_rounds"] == 2
    assert wf.rollout_metrics()["marl/generate_calls/speaker"] == 1
    pol = strings(rec, "policy")
    assert pol.count(JOINT_POLICY) == 12 and pol.count("speaker") == 12
    assert pol.count("listener") == 12


def test_shared_policy_two_roles_share_the_call(marl_config, build_workflow, make_items):
    cfg = marl_config(
        "rollout.args={agents: [{name: speaker, policy: speaker}, "
        "{name: listener, policy: speaker}]}"
    )
    wf, calls = build_workflow(cfg)
    rec = wf.rollout(make_items(ROWS), params(n=2))
    assert calls == [("speaker", 3, 2), ("speaker", 6, 1)]
    rows = agent_rows(rec)
    assert {strings(rec, "policy")[i] for i in rows} == {"speaker"}
    assert {int(rec["agent_id"][i]) for i in rows} == {0, 1}
    # role prompts tell the two agents apart
    prompts = [strings(rec, "prompt_text")[i] for i in rows]
    assert sum(SPEAKER_ROLE in p for p in prompts) == 6
    assert sum(LISTENER_ROLE in p for p in prompts) == 6


def test_parallel_agents_on_one_policy_share_one_call(marl_config, build_workflow, make_items):
    cfg = marl_config(
        "rollout.workflow=parallel",
        "rollout.args={agents: [{name: a, policy: speaker}, {name: b, policy: "
        "speaker}, {name: c, policy: listener}]}",
    )
    wf, calls = build_workflow(cfg)
    wf.rollout(make_items(ROWS), params(n=3))
    assert sorted(calls) == [("listener", 3, 3), ("speaker", 6, 3)]


def test_record_holds_the_exact_sampled_ids(marl_config, build_workflow, make_items):
    wf, _ = build_workflow(marl_config())
    rec_engines = {n: Recorder(e) for n, e in wf.ctx.engines.items()}
    wf.ctx.engines.update(rec_engines)
    rec = wf.rollout(make_items(ROWS), params(n=2, max_new_tokens=3))
    sampled = [x for e in rec_engines.values() for x in e.out]
    seen = []
    for i in agent_rows(rec):
        pm, rm = rec["prompt_mask"][i].bool(), rec["response_mask"][i].bool()
        p_ids = rec["prompt_ids"][i][pm].tolist()
        r_ids = rec["response_ids"][i][rm].tolist()
        lps = rec["rollout_logprobs"][i][rm].tolist()
        assert torch.equal(rec["loss_mask"][i], rec["response_mask"][i])
        seen.append((p_ids, r_ids, lps))
    assert len(seen) == len(sampled)
    for s in seen:
        match = [x for x in sampled if x[0] == s[0] and x[1] == s[1]]
        assert match, "a record row's ids were not what the engine sampled"
        assert match[0][2] == pytest.approx(s[2])
    # group keys: prompt uid, agent id; rows enter pending until the credit runs
    assert not bool(rec["valid"][agent_rows(rec)].any())
    assert set(strings(rec, "error")) == {""}


def test_ctde_listener_sees_the_message_not_the_target(marl_config, build_workflow, make_items):
    wf, _ = build_workflow(marl_config())
    rec = wf.rollout(make_items(ROWS[:1]), params(n=4))
    texts, prompts = strings(rec, "response_text"), strings(rec, "prompt_text")
    speaker = [i for i in agent_rows(rec) if int(rec["agent_id"][i]) == 0]
    listener = [i for i in agent_rows(rec) if int(rec["agent_id"][i]) == 1]
    for i in listener:
        p = prompts[i]
        assert "Target" not in p and SPEAKER_ROLE not in p
        joint = strings(rec, "meta")[i]["joints"][0]
        msg = next(texts[s] for s in speaker if strings(rec, "meta")[s]["joints"] == [joint])
        assert listener_prompt(msg.strip(), ["cat", "apple", "dog"]) in p
    for i in speaker:
        assert speaker_prompt("apple") in prompts[i]
        assert "Candidates" not in prompts[i] and LISTENER_ROLE not in prompts[i]


def test_greedy_eval_is_one_joint_per_episode(marl_config, build_workflow, make_items):
    wf, calls = build_workflow(marl_config())
    rec = wf.rollout(make_items(ROWS), params(n=1, temperature=0.0))
    assert strings(rec, "policy").count(JOINT_POLICY) == 3
    assert calls == [("speaker", 3, 1), ("listener", 3, 1)]


@workflow("test_flaky", agents=("speaker", "listener"))
async def flaky(ep, team):
    """Signaling, except that the episode about the dog raises."""
    msgs = await team["speaker"].act(ep.task, n=ep.G)
    if ep.row["target"] == "dog":
        raise RuntimeError("the environment broke")
    ans = await ep.gather(team["listener"].act(m.text) for m in msgs)
    for m, a in zip(msgs, ans, strict=True):
        ep.joint([m, a], final=a.text)


@workflow("test_forgetful", agents=("speaker", "listener"))
async def forgetful(ep, team):
    """Acts once more without putting that message in a joint action."""
    m = await team["speaker"].act(ep.task)
    a = await team["listener"].act(m.text)
    await team["listener"].act("unused")
    ep.joint([m, a], final=a.text)


def test_an_episode_that_raises_is_recorded_dropped_and_counted(
    marl_config, build_workflow, make_items
):
    cfg = marl_config(
        "rollout.workflow=test_flaky", "rollout.args={agents: [{name: speaker}, {name: listener}]}"
    )
    wf, _ = build_workflow(cfg)
    rec = wf.rollout(make_items(ROWS), params(n=2))
    metrics = rewards.score(rec, cfg.reward)
    metrics |= assign(rec, cfg.algorithm)
    errors, metas = strings(rec, "error"), strings(rec, "meta")
    bad = [i for i in range(rec.batch_size[0]) if errors[i]]
    assert bad and all("the environment broke" in errors[i] for i in bad)
    assert all(not bool(rec["valid"][i]) for i in bad)
    assert wf.rollout_metrics()["marl/episode_errors"] == 1
    assert metrics["reward/errors"] == 0  # not a reward failure, and never scored 0
    good = [i for i in range(rec.batch_size[0]) if not errors[i]]
    assert all(bool(rec["valid"][i]) for i in good)
    assert {metas[i].get("episode") for i in bad} == {1}


def test_a_message_outside_any_joint_is_an_error(marl_config, build_workflow, make_items):
    cfg = marl_config(
        "rollout.workflow=test_forgetful",
        "rollout.args={agents: [{name: speaker}, {name: listener}]}",
    )
    wf, _ = build_workflow(cfg)
    rec = wf.rollout(make_items(ROWS[:1]), params(n=1))
    errors = [e for e in strings(rec, "error") if e]
    assert len(errors) == 1 and "in no joint action" in errors[0]


def test_cross_mode_parallel_forms_every_combination(marl_config, build_workflow, make_items):
    cfg = marl_config(
        "rollout.workflow=parallel",
        "rollout.args={agents: [{name: a, policy: speaker}, {name: b, policy: "
        "listener}], joint: cross}",
    )
    wf, _ = build_workflow(cfg)
    rec = wf.rollout(make_items(ROWS[:2]), params(n=3))
    metas = strings(rec, "meta")
    pol = strings(rec, "policy")
    assert pol.count(JOINT_POLICY) == 2 * 9
    for i in agent_rows(rec):
        assert len(metas[i]["joints"]) == 3  # each sample is in G joint actions
