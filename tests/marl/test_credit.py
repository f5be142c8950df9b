"""MAGRPO credit math against hand computations (no models)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from polyrl.core.record import strings
from polyrl.marl.credit import magrpo_credit, tree_returns


@dataclass
class J:
    """A joint action for :func:`joint_record`: reward, group keys and tree links."""

    id: int
    reward: float
    uid: int = 0
    turn: int = 0
    parent: int = 0
    scored: bool = True
    episode: int = 0
    tree: bool = False


@dataclass
class A:
    """An agent row: which agent, which joint actions it is in, how many tokens."""

    agent: int
    joints: tuple
    uid: int = 0
    turn: int = 0
    node: int = 0
    tokens: int = 2
    policy: str = "p"
    episode: int = 0


def row_adv(rec) -> dict[tuple, float]:
    """(agent, first joint) -> the row's advantage (constant over its loss tokens)."""
    out = {}
    metas = strings(rec, "meta")
    for i in range(rec.batch_size[0]):
        if int(rec["joint_id"][i]) >= 0:
            continue
        mask = rec["loss_mask"][i].bool()
        values = rec["advantages"][i][mask]
        assert torch.allclose(values, values[0].expand_as(values)), "advantage varies in a row"
        out[(int(rec["agent_id"][i]), tuple(metas[i]["joints"]))] = float(values[0])
    return out


def aligned(rewards_by_uid: dict[int, list[float]], n_agents: int = 2):
    joints, agents, k = [], [], 1
    for uid, rewards in rewards_by_uid.items():
        for r in rewards:
            joints.append(J(k, r, uid=uid, episode=uid))
            agents += [A(a, (k,), uid=uid, episode=uid) for a in range(n_agents)]
            k += 1
    return joints, agents


def test_aligned_mean_baseline_per_prompt_and_agent(joint_record, algo):
    joints, agents = aligned({0: [1, 0, 0, 1], 1: [1, 1, 1, 0]})
    rec = joint_record(joints, agents)
    metrics = magrpo_credit(rec, algo())
    adv = row_adv(rec)
    expect = {1: 0.5, 2: -0.5, 3: -0.5, 4: 0.5, 5: 0.25, 6: 0.25, 7: 0.25, 8: -0.75}
    for (agent, (j,)), a in adv.items():
        assert a == pytest.approx(expect[j]), (agent, j)
    # every agent row became valid and carries its value as reward; joint rows keep theirs
    assert bool(rec["valid"].all())
    assert metrics["marl/return_mean"] == pytest.approx(5 / 8)


def test_node_advantages_sum_to_zero_per_group(joint_record, algo):
    joints, agents = aligned({0: [1, 0, 0, 1], 1: [0.3, 1, 0.2, 0], 2: [0, 0, 0, 0]}, n_agents=3)
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo())
    sums: dict = {}
    for i in range(rec.batch_size[0]):
        if int(rec["joint_id"][i]) < 0:
            key = tuple(int(rec[k][i]) for k in ("uid", "agent_id", "turn", "node"))
            sums[key] = sums.get(key, 0.0) + float(rec["advantages"][i, 0])
    assert len(sums) == 9
    assert all(abs(s) < 1e-6 for s in sums.values()), sums


def test_grouping_ignores_row_order(joint_record, algo):
    """Groups come from the key columns, never from positions in a flattened list."""
    joints, agents = aligned({0: [1, 0, 0, 1], 1: [1, 1, 1, 0], 2: [0, 1, 0, 0]})
    base = joint_record(joints, agents)
    magrpo_credit(base, algo())
    for seed in range(3):
        rec = joint_record(joints, agents, shuffle=seed)
        magrpo_credit(rec, algo())
        assert row_adv(rec) == pytest.approx(row_adv(base))


def cross(matrix: list[list[float]], uid: int = 0):
    """Agent 0 has len(matrix) samples, agent 1 len(matrix[0]); joint (i, j) = matrix[i][j]."""
    joints, rows0, rows1 = [], {}, {}
    k = 1
    for i, line in enumerate(matrix):
        for j, r in enumerate(line):
            joints.append(J(k, r, uid=uid))
            rows0.setdefault(i, []).append(k)
            rows1.setdefault(j, []).append(k)
            k += 1
    agents = [A(0, tuple(v), uid=uid) for v in rows0.values()]
    agents += [A(1, tuple(v), uid=uid) for v in rows1.values()]
    return joints, agents


def test_cross_values_are_means_over_joint_actions(joint_record, algo):
    m = [[1, 0], [1, 1], [0, 0]]
    joints, agents = cross(m)
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(), cross_value="mean")
    v0 = [sum(line) / 2 for line in m]  # 0.5, 1, 0
    v1 = [sum(line[j] for line in m) / 3 for j in range(2)]  # 2/3, 1/3
    expect = {(0, tuple(a.joints)): v0[i] - sum(v0) / 3 for i, a in enumerate(agents[:3])}
    expect |= {(1, tuple(a.joints)): v1[j] - sum(v1) / 2 for j, a in enumerate(agents[3:])}
    assert row_adv(rec) == pytest.approx(expect)


def test_cross_sum_mode_never_mixes_agents(joint_record, algo):
    """With sums, agent 0's values average 1 and agent 1's 1.5: a mixed group would not."""
    m = [[1, 1], [1, 0], [0, 0]]
    joints, agents = cross(m)
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(), cross_value="sum")
    adv = row_adv(rec)
    assert [adv[(0, tuple(a.joints))] for a in agents[:3]] == pytest.approx([1, 0, -1])
    assert [adv[(1, tuple(a.joints))] for a in agents[3:]] == pytest.approx([0.5, -0.5])


def test_tree_returns_with_gamma(joint_record, algo):
    # turn 0: joints 1, 2 (root); turn 1: 3, 4 under 1 and 5, 6 under 2; groups = siblings
    joints = [
        J(1, 1.0),
        J(2, 0.0),
        J(3, 1.0, turn=1, parent=1, tree=True),
        J(4, 0.0, turn=1, parent=1, tree=True),
        J(5, 1.0, turn=1, parent=2, tree=True),
        J(6, 1.0, turn=1, parent=2, tree=True),
    ]
    agents = [A(a, (j,)) for a in (0, 1) for j in (1, 2)]
    agents += [
        A(a, (j,), turn=1, node=p) for a in (0, 1) for j, p in ((3, 1), (4, 1), (5, 2), (6, 2))
    ]
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(gamma=0.5))
    adv = row_adv(rec)
    r1, r2 = 1 + 0.5 * 0.5, 0 + 0.5 * 1.0  # R = r + gamma * mean(child returns)
    for a in (0, 1):
        assert adv[(a, (1,))] == pytest.approx(r1 - (r1 + r2) / 2)
        assert adv[(a, (2,))] == pytest.approx(r2 - (r1 + r2) / 2)
        assert adv[(a, (3,))] == pytest.approx(0.5)
        assert adv[(a, (4,))] == pytest.approx(-0.5)
        assert adv[(a, (5,))] == pytest.approx(0.0)
        assert adv[(a, (6,))] == pytest.approx(0.0)
    # the same numbers from the helper directly
    info = {
        j.id: {"parent": j.parent, "turn": j.turn, "reward": j.reward, "error": ""} for j in joints
    }
    assert tree_returns(info, 0.5)[1] == pytest.approx(r1)


def test_multi_turn_chain_groups_per_turn_and_unscored_turns(joint_record, algo):
    """tree=false: lines continue one to one; turn-0 joints unscored (reward 0)."""
    joints = [
        J(1, 0, scored=False),
        J(2, 0, scored=False),
        J(3, 1.0, turn=1, parent=1),
        J(4, 0.0, turn=1, parent=2),
    ]
    agents = [A(0, (1,)), A(0, (2,)), A(1, (3,), turn=1), A(1, (4,), turn=1)]
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(gamma=0.9))
    adv = row_adv(rec)
    assert adv[(0, (1,))] == pytest.approx(0.45) and adv[(0, (2,))] == pytest.approx(-0.45)
    assert adv[(1, (3,))] == pytest.approx(0.5) and adv[(1, (4,))] == pytest.approx(-0.5)
    assert bool(rec["valid"].all())


def test_counterfactual_is_zero_for_an_agent_that_does_not_matter(joint_record, algo):
    m = [[1, 1], [0, 0]]  # the reward depends on agent 0 only
    joints, agents = cross(m)
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(), counterfactual=True)
    adv = row_adv(rec)
    assert [adv[(1, tuple(a.joints))] for a in agents[2:]] == pytest.approx([0.0, 0.0])
    assert [adv[(0, tuple(a.joints))] for a in agents[:2]] == pytest.approx([1.0, -1.0])


@pytest.mark.parametrize(
    "name,expect",
    [
        ("drgrpo", [0.5, -0.5, -0.5, 0.5]),
        ("rloo", [2 / 3, -2 / 3, -2 / 3, 2 / 3]),
        ("max_baseline", [0.0, -1.0, -1.0, 0.0]),
        (
            "grpo",
            [
                0.5 / math.sqrt(1 / 3),
                -0.5 / math.sqrt(1 / 3),
                -0.5 / math.sqrt(1 / 3),
                0.5 / math.sqrt(1 / 3),
            ],
        ),
    ],
)
def test_baselines(joint_record, algo, name, expect):
    joints, agents = aligned({0: [1, 0, 0, 1]})
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(advantage=name))
    adv = row_adv(rec)
    for a in (0, 1):
        assert [adv[(a, (j,))] for j in (1, 2, 3, 4)] == pytest.approx(expect, rel=1e-4)


def test_per_agent_normalisation(joint_record, algo):
    joints, agents = aligned({0: [1, 0, 0, 1], 1: [3, 1, 1, 1]})
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(), per_agent_norm=True)
    adv = row_adv(rec)
    for a in (0, 1):
        x = torch.tensor([v for (agent, _), v in adv.items() if agent == a])
        assert float(x.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(x.std()) == pytest.approx(1.0, rel=1e-4)


def test_maporl_shaping_scales_own_influence(joint_record, algo):
    joints, agents = aligned({0: [1, 0, 0, 1]})
    rec = joint_record(joints, agents)
    magrpo_credit(rec, algo(), shaping_alpha=0.5)
    # V + 0.5 (V - Q), Q = group mean 0.5, then minus the group mean
    assert row_adv(rec)[(0, (1,))] == pytest.approx(0.75)


def test_failed_joint_drops_its_rows_with_the_error(joint_record, algo):
    from polyrl.core.record import mark_invalid

    joints, agents = aligned({0: [1, 0, 0, 1]})
    rec = joint_record(joints, agents)
    jrow = [i for i in range(rec.batch_size[0]) if int(rec["joint_id"][i]) == 2][0]
    mark_invalid(rec, [jrow], ["reward 'x' raised ValueError: boom"])
    metrics = magrpo_credit(rec, algo())
    errors = strings(rec, "error")
    metas = strings(rec, "meta")
    dropped = [
        i
        for i in range(rec.batch_size[0])
        if int(rec["joint_id"][i]) < 0 and metas[i]["joints"] == [2]
    ]
    assert len(dropped) == 2
    for i in dropped:
        assert not bool(rec["valid"][i]) and "boom" in errors[i]
        assert float(rec["advantages"][i].abs().sum()) == 0
    adv = row_adv(rec)
    mean = (1 + 0 + 1) / 3
    assert adv[(0, (1,))] == pytest.approx(1 - mean)
    assert adv[(0, (3,))] == pytest.approx(0 - mean)
    assert metrics["marl/joint_errors"] == 1
    assert metrics["marl/agent_rows_invalid"] == 2


def test_credit_refuses_a_single_agent_record(algo):
    from polyrl.core.record import text_record

    rec = text_record(
        prompt_ids=[[1]],
        response_ids=[[2]],
        rollout_logprobs=[[0.0]],
        policy=["p"],
        uid=[0],
        pad_id=0,
    )
    with pytest.raises(ValueError, match="multi-agent workflow"):
        magrpo_credit(rec, algo())


def test_a_step_where_every_episode_failed_is_counted_not_a_crash(algo):
    """Every episode raised before any agent acted: joint rows only (as the runtime writes
    them), each with its error, and no token columns at all (the issue's IndexError)."""
    from polyrl.core.record import mark_invalid, text_record
    from polyrl.marl.record import JOINT_POLICY

    n = 3
    rec = text_record(
        prompt_ids=[[]] * n,
        response_ids=[[]] * n,
        rollout_logprobs=[[]] * n,
        policy=[JOINT_POLICY] * n,
        uid=list(range(n)),
        pad_id=0,
        agent_id=[-1] * n,
        turn=[0] * n,
        node=[0] * n,
        meta=[
            {"joint": j, "parent": 0, "turn": 0, "scored": False, "episode": j} for j in range(n)
        ],
    )
    rec["joint_id"] = torch.arange(n)
    assert rec["loss_mask"].shape == (n, 0)
    mark_invalid(rec, list(range(n)), ["episode raised RuntimeError: the environment broke"] * n)
    metrics = magrpo_credit(rec, algo())
    assert metrics["marl/joint_errors"] == n and metrics["marl/joint_actions"] == n
    assert metrics["marl/agent_rows_invalid"] == 0
    assert metrics["advantage/mean_abs"] == 0.0 and math.isnan(metrics["marl/return_mean"])
    assert not bool(rec["valid"].any()) and rec["advantages"].shape == (n, 0)
    assert all("the environment broke" in e for e in strings(rec, "error"))
