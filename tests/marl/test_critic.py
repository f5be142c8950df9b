"""The centralized critic: it reads the joint state (CTDE), fits returns, sets the
baseline of the credit, and is checkpointed with the workflow."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from polyrl.marl import JOINT_POLICY
from polyrl.marl.config import CriticOptions
from polyrl.marl.critic import CentralCritic
from polyrl.marl.signaling import make_row
from tests.helpers.runs import assert_weights_moved, load_part

ROWS = [
    make_row("apple", ["cat", "apple", "dog"], "QXZJ"),
    make_row("dog", ["dog", "ball", "cat"], "QXZJ"),
]


def critic_args(model: str, extra: str = "") -> str:
    return (
        "rollout.args={agents: [{name: speaker, policy: speaker}, {name: listener, "
        f"policy: listener}}], tree: true, critic: {{model: {model}, lr: 1.0e-3}}{extra}}}"
    )


def test_critic_fits_returns_of_distinct_states(signaling_model_dir):
    critic = CentralCritic(
        CriticOptions(model=signaling_model_dir, lr=3e-3, epochs=4, micro_batch_size=8)
    )
    texts = [f"Task: Target:\napple\n[t1 listener] acts {s}" for s in "QXZJ"] * 2
    returns = torch.tensor([1.0, 0.0, 0.5, 0.0] * 2)
    assert torch.equal(critic.values(texts), torch.zeros(8))  # zero head: baseline 0 at first
    gen = torch.Generator().manual_seed(0)
    before = float(((critic.values(texts) - returns) ** 2).mean())
    first = critic.fit(texts, returns, baseline=critic.values(texts), generator=gen)
    assert first["critic/mse_before"] == pytest.approx(before)
    for _ in range(10):
        critic.fit(texts, returns, generator=gen)
    after = float(((critic.values(texts) - returns) ** 2).mean())
    assert after < 0.1 * before, (before, after)


def test_critic_states_are_joint_while_agents_see_only_their_own(
    marl_config, build_workflow, make_items, signaling_model_dir
):
    wf, _ = build_workflow(marl_config(critic_args(signaling_model_dir)))
    rec = wf.rollout(make_items(ROWS[:1]), SamplingParams(n=3, max_new_tokens=2))
    metas, prompts = strings(rec, "meta"), strings(rec, "prompt_text")
    policy, texts = strings(rec, "policy"), strings(rec, "response_text")
    baseline = rec["baseline"]
    agents = [i for i in range(rec.batch_size[0]) if policy[i] != JOINT_POLICY]
    assert all(torch.isnan(baseline[i]) for i in range(len(policy)) if policy[i] == JOINT_POLICY)
    assert all(torch.isfinite(baseline[i]) for i in agents)
    for i in agents:
        state = metas[i]["critic_state"]
        assert "apple" in state  # the critic always sees the target ...
        if int(rec["agent_id"][i]) == 1:  # ... the listener's own context never does
            assert "Target" not in prompts[i]
            assert "[t0 speaker]" in state and state.endswith("[t1 listener] acts")
            speaker_row = next(
                k
                for k in agents
                if int(rec["agent_id"][k]) == 0
                and metas[k]["joints"][0]
                in [
                    metas[j]["parent"]
                    for j in range(len(policy))
                    if metas[i]["joints"][0] == metas[j].get("joint")
                ]
            )
            assert f"-> {texts[speaker_row].strip()}" in state
        else:
            assert "[t0 speaker] acts" in state and "listener" not in state


def test_credit_with_critic_is_return_minus_baseline(
    marl_config, build_workflow, make_items, signaling_model_dir
):
    from polyrl.core.rollout import rewards
    from polyrl.core.train.credit import assign

    cfg = marl_config(critic_args(signaling_model_dir), "algorithm.gamma=1.0")
    wf, _ = build_workflow(cfg)
    rec = wf.rollout(make_items(ROWS), SamplingParams(n=3, max_new_tokens=2))
    rec["baseline"] = torch.where(
        torch.isnan(rec["baseline"]), rec["baseline"], torch.linspace(-0.5, 0.5, rec.batch_size[0])
    )
    rewards.score(rec, cfg.reward)
    assign(rec, cfg.algorithm)
    valid = rec["valid"]
    policy = strings(rec, "policy")
    agents = [i for i in range(rec.batch_size[0]) if policy[i] != JOINT_POLICY and valid[i]]
    assert agents
    for i in agents:
        mask = rec["loss_mask"][i].bool()
        want = float(rec["returns"][i] - rec["baseline"][i])
        assert torch.allclose(rec["advantages"][i][mask], torch.tensor(want)), i
        assert float(rec["returns"][i]) == float(rec["reward"][i])  # the row's return
    metrics = wf.learn(rec)
    assert metrics["critic/states"] == len(agents)


def test_critic_rejects_what_it_does_not_combine_with(marl_config, signaling_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="does not combine"):
        marl_config(critic_args(signaling_model_dir), "algorithm.credit_args={shaping_alpha: 0.5}")
    with pytest.raises(ConfigError, match="critic.model=.*does not exist"):  # before any load
        marl_config(critic_args(str(tmp_path / "no-such-critic")))


@pytest.mark.slow
def test_critic_run_resumes_exactly(marl_config, signaling_model_dir, tmp_path):
    """4 steps straight vs 2 steps, then a resume for 2 more: same critic, same metrics.
    The untrained pair never wins (exact_match is 0 throughout: a zero head that never
    moves); a reward that varies between samples gives the critic something to fit."""
    from polyrl.core.loop import train

    common = [
        critic_args(signaling_model_dir),
        "train.steps=4",
        "run.save_every=2",
        "eval.every=0",
        "reward.terms=[{name: regex_format, args: {pattern: '[A-Z]', mode: search}}]",
    ]
    straight = train(marl_config(*common, f"run.dir={tmp_path}/a"))
    half = train(marl_config(*common, f"run.dir={tmp_path}/b", "train.steps=2"))
    resumed = train(marl_config(*common, f"run.dir={half.path}", "run.resume=true"))

    def last(run):
        rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "critic/fit_mse" in r][-1]

    a, b = last(straight), last(resumed)
    assert a["step"] == b["step"] == 4
    assert a["critic/fit_mse"] == b["critic/fit_mse"] and a["reward/mean"] == b["reward/mean"]
    (step_a, sa), (step_b, sb) = straight.load_latest(), resumed.load_latest()
    assert step_a == step_b == 4
    # the straight run's critic moved after the resume point (step 2): measured 3.7e-3
    # (backbone) and 2.8e-3 (head)
    at_resume = load_part(straight.path / "checkpoints" / "step_000002", "workflow")["critic"]
    for part in ("backbone", "head"):
        assert_weights_moved(at_resume[part], sa["workflow"]["critic"][part], 2e-4, part)
    for part in ("backbone", "head"):
        for k, v in sa["workflow"]["critic"][part].items():
            assert torch.equal(v, sb["workflow"]["critic"][part][k]), (part, k)
