"""Credit for multi-turn rows: GiGPO step groups and advantages against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.agents.credit import (
    _steps,
    discounted_returns,
    episode_grpo,
    gigpo,
    step_groups,
    turn_return,
)
from polyrl.core.record import mark_invalid, text_record
from polyrl.core.train.algorithms import AlgorithmConfig

# Two tasks. Task 0 has three episodes, task 1 two. The same anchor text "A" appears in
# both tasks: it must not join their steps, since step groups never cross tasks.
EPISODES = [  # (uid, anchors, per-turn env rewards)
    (0, ["A", "B"], [0.0, 1.0]),
    (0, ["A", "C", "B"], [0.0, 0.0, 1.0]),
    (0, ["A", "C"], [0.0, 0.0]),
    (1, ["A"], [1.0]),
    (1, ["A", "A"], [0.0, 0.0]),
]
GAMMA = 0.5

# By hand, gamma = 0.5. Discounted returns G_t = r_t + 0.5 G_(t+1):
#   ep0 [0.5, 1]   ep1 [0.25, 0.5, 1]   ep2 [0, 0]   ep3 [1]   ep4 [0, 0]
# Step groups (task, anchor) and A_step = (G - mean) / std (unbiased std):
#   (0,A): ep0t0 .5, ep1t0 .25, ep2t0 0 -> mean .25, std .25 -> +1, 0, -1
#   (0,B): ep0t1 1, ep1t2 1 -> std 0 -> 0, 0
#   (0,C): ep1t1 .5, ep2t1 0 -> mean .25, std .353553 -> +.707107, -.707107
#   (1,A): ep3t0 1, ep4t0 0, ep4t1 0 -> mean 1/3, std .577350 -> +1.154701, -.577350, -.577350
# Episode rewards (= success) and A_episode (GRPO per task, unbiased std):
#   task 0: [1, 1, 0] -> mean 2/3, std .577350 -> +.577350, +.577350, -1.154701
#   task 1: [1, 0] -> mean .5, std .707107 -> +.707107, -.707107
S3, S2 = 1 / math.sqrt(3), 1 / math.sqrt(2)
A_EPISODE = [S3, S3, -2 * S3, S2, -S2]
A_STEP = [[1.0, 0.0], [0.0, S2, 0.0], [-1.0, -S2], [2 * S3], [-S3, -S3]]
RETURNS = [[0.5, 1.0], [0.25, 0.5, 1.0], [0.0, 0.0], [1.0], [0.0, 0.0]]


def step_record() -> torch.Tensor:
    """One row per turn, each with a 2-token response (action + end token)."""
    rows = {"prompt": [], "response": [], "uid": [], "turn": [], "meta": []}
    for e, (uid, anchors, rewards) in enumerate(EPISODES):
        for t in range(len(anchors)):
            rows["prompt"].append([5, 6])
            rows["response"].append([7, 8])
            rows["uid"].append(uid)
            rows["turn"].append(t)
            rows["meta"].append(
                {
                    "episode": e,
                    "spans": [[t, 0, 2]],
                    "anchors": anchors,
                    "turn_rewards": rewards,
                    "return": sum(rewards),
                    "success": sum(rewards) > 0,
                    "turns": len(anchors),
                }
            )
    rec = text_record(
        prompt_ids=rows["prompt"],
        response_ids=rows["response"],
        rollout_logprobs=[[0.0, 0.0]] * len(rows["uid"]),
        policy=["main"] * len(rows["uid"]),
        uid=rows["uid"],
        turn=rows["turn"],
        pad_id=0,
        meta=rows["meta"],
    )
    rec["reward"] = torch.tensor([m["return"] for m in rows["meta"]], dtype=torch.float32)
    return rec


def concat_record():
    """One row per episode: each turn is 2 action tokens followed by 3 env tokens."""
    prompts, responses, masks, metas = [], [], [], []
    for e, (_uid, anchors, rewards) in enumerate(EPISODES):
        ids, mask, spans = [], [], []
        for t in range(len(anchors)):
            spans.append([t, len(ids), len(ids) + 2])
            ids += [7, 8]
            mask += [1, 1]
            if t < len(anchors) - 1:
                ids += [9, 9, 9]
                mask += [0, 0, 0]
        prompts.append([5, 6])
        responses.append(ids)
        masks.append(mask)
        metas.append(
            {
                "episode": e,
                "spans": spans,
                "anchors": anchors,
                "turn_rewards": rewards,
                "return": sum(rewards),
                "success": sum(rewards) > 0,
                "turns": len(anchors),
            }
        )
    rec = text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=[u for u, _, _ in EPISODES],
        pad_id=0,
        loss_mask=masks,
        meta=metas,
    )
    rec["reward"] = torch.tensor([m["return"] for m in metas], dtype=torch.float32)
    return rec


def algo(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(advantage="grpo", gamma=GAMMA, **kw)


def test_discounted_returns_by_hand():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([1.0, 2.0], 1.0) == [3.0, 2.0]
    assert discounted_returns([], 0.9) == []


def test_step_groups_join_identical_anchors_of_one_task_only():
    steps, _ = _steps(step_record(), GAMMA)
    groups = {
        key: sorted((steps[k].episode, steps[k].turn) for k in idx)
        for key, idx in step_groups(steps).items()
    }
    assert groups == {
        (0, "A"): [(0, 0), (1, 0), (2, 0)],
        (0, "B"): [(0, 1), (1, 2)],
        (0, "C"): [(1, 1), (2, 1)],
        (1, "A"): [(3, 0), (4, 0), (4, 1)],
    }
    assert [s.ret for s in steps] == [g for ep in RETURNS for g in ep]


@pytest.mark.parametrize("omega", [1.0, 0.5])
def test_gigpo_step_rows_match_hand_computation(omega):
    rec = step_record()
    metrics = gigpo(rec, algo(), omega=omega)
    expected = [
        A_EPISODE[e] + omega * A_STEP[e][t]
        for e, (_, anchors, _) in enumerate(EPISODES)
        for t in range(len(anchors))
    ]
    adv = rec["advantages"]
    for i, value in enumerate(expected):
        assert adv[i].tolist() == pytest.approx([value, value], abs=1e-4), i
    assert metrics["gigpo/step_groups"] == 4
    assert metrics["gigpo/mean_group_size"] == pytest.approx(10 / 4)
    assert metrics["episode/success"] == pytest.approx(3 / 5)


def test_gigpo_concat_rows_give_each_turn_its_own_advantage_and_env_tokens_zero():
    rec = concat_record()
    gigpo(rec, algo())
    for e, (_, anchors, _) in enumerate(EPISODES):
        row = rec["advantages"][e]
        for t in range(len(anchors)):
            start = 5 * t
            value = A_EPISODE[e] + A_STEP[e][t]
            assert row[start : start + 2].tolist() == pytest.approx([value, value], abs=1e-4)
            if t < len(anchors) - 1:
                assert row[start + 2 : start + 5].tolist() == [0.0, 0.0, 0.0]  # env tokens
        n = 5 * len(anchors) - 3
        assert bool((row[n:] == 0).all())  # padding


def test_gigpo_without_std_division_is_mean_centred():
    rec = step_record()
    gigpo(rec, algo(norm_adv_by_std=False))
    # (0,A) group: returns .5, .25, 0 -> centred +.25, 0, -.25; episode part is Dr.GRPO
    # r - mean: task 0 -> +1/3, +1/3, -2/3.
    assert rec["advantages"][0, 0].item() == pytest.approx(1 / 3 + 0.25, abs=1e-5)
    assert rec["advantages"][2, 0].item() == pytest.approx(1 / 3 + 0.0, abs=1e-5)


def test_episode_grpo_is_gigpo_with_zero_omega_and_equals_core_group_on_concat_rows():
    a, b = step_record(), step_record()
    episode_grpo(a, algo())
    gigpo(b, algo(), omega=0.0)
    assert torch.allclose(a["advantages"], b["advantages"])
    from polyrl.core.train.credit import group_credit

    c, d = concat_record(), concat_record()
    episode_grpo(c, algo())
    group_credit(d, algo())
    assert torch.allclose(c["advantages"], d["advantages"], atol=1e-6)


def test_omega_comes_from_the_recipe_credit_args():
    from polyrl.core.config import ConfigError
    from polyrl.core.train.credit import assign

    by_recipe, by_hand = step_record(), step_record()
    assign(by_recipe, algo(credit="gigpo", credit_args={"omega": 0.5}))
    gigpo(by_hand, algo(), omega=0.5)
    assert torch.equal(by_recipe["advantages"], by_hand["advantages"])
    assert not torch.equal(by_hand["advantages"], gigpo_default(step_record()))
    with pytest.raises(ConfigError, match=r"algorithm.credit_args.omga.*did you mean"):
        algo(credit="gigpo", credit_args={"omga": 0.5}).validate()
    with pytest.raises(ConfigError, match="has no option 'omega'.*takes no options"):
        algo(credit="episode_grpo", credit_args={"omega": 0.5}).validate()


def gigpo_default(rec):
    gigpo(rec, algo())
    return rec["advantages"]


def test_turn_return_normalises_discounted_returns_within_the_task():
    rec = step_record()
    turn_return(rec, algo())
    task0 = [g for ep in RETURNS[:3] for g in ep]
    mean = sum(task0) / len(task0)
    std = math.sqrt(sum((g - mean) ** 2 for g in task0) / (len(task0) - 1))
    assert rec["advantages"][0, 0].item() == pytest.approx((0.5 - mean) / std, abs=1e-5)
    assert rec["advantages"][4, 1].item() == pytest.approx((1.0 - mean) / std, abs=1e-5)


def test_invalid_rows_are_left_out_and_get_zero():
    rec = step_record()
    # episode 2 (two rows: 5 and 6) failed in its environment
    mark_invalid(rec, [5, 6], ["env raised", "env raised"])
    gigpo(rec, algo())
    assert rec["advantages"][5:7].abs().sum().item() == 0.0
    # Without episode 2, task 0's (0,A) group is ep0 .5 and ep1 .25: +-0.7071; episodes
    # [1, 1] have no spread, so A_episode is 0.
    assert rec["advantages"][0, 0].item() == pytest.approx(1 / math.sqrt(2), abs=1e-4)
    assert rec["advantages"][2, 0].item() == pytest.approx(-1 / math.sqrt(2), abs=1e-4)


def test_rows_without_multi_turn_meta_fail_clearly():
    rec = text_record(
        prompt_ids=[[1]],
        response_ids=[[2]],
        rollout_logprobs=[[0.0]],
        policy=["main"],
        uid=[0],
        pad_id=0,
    )
    rec["reward"] = torch.ones(1)
    with pytest.raises(ValueError, match="multi_turn workflow"):
        gigpo(rec, algo())
