"""Credit assignment: group statistics and the default group scheme on a record by hand.

test_options.py checks group_stats on one small hand-worked case; here it is checked
against a per-group loop on random values, every group estimator is scanned over groups
of equal rewards and lone rows (all must give exactly 0), checked on a group worked by
hand with fractions, and group_credit on a record worked by hand.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.config import ConfigError
from polyrl.core.record import mark_invalid, text_record
from polyrl.core.registry import ADVANTAGES
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import STD_FLOOR, assign, group_advantages, group_credit, group_stats

# every estimator that compares a row with its group (the REINFORCE++ baseline centres by
# group, then whitens over the batch)
GROUP_ESTIMATORS = ["grpo", "drgrpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline"]
# rewards whose float32 sums and means round (verl's float32 statistics gave 12 x 0.7 a
# +0.106 advantage each), tiny and large ones, and zero
EQUAL_VALUES = [0.7, 3.7, 100.3, -1e3, 1e-8, 0.1, 1 / 3, -2.5, 12345.678, 0.0]

# ------------------------------------------------------------------------------ group_stats


@pytest.mark.parametrize("unbiased", [True, False])
def test_group_stats_match_a_loop_over_groups(unbiased):
    g = torch.Generator().manual_seed(3)
    values = torch.randn(40, generator=g, dtype=torch.float32)
    groups = torch.randint(-3, 9, (40,), generator=g)  # interleaved, negative ids, singletons
    groups[0] = 100  # a group of one row
    mean, std, count = group_stats(values, groups, unbiased=unbiased)
    assert mean.dtype == std.dtype == count.dtype == torch.float64
    for gid in groups.unique():
        rows = groups == gid
        v = values[rows].double()
        assert torch.allclose(mean[rows], v.mean().expand(len(v)))
        assert count[rows].tolist() == [float(len(v))] * len(v)
        expected = 0.0 if len(v) == 1 else float(v.std(correction=1 if unbiased else 0))
        assert std[rows].tolist() == pytest.approx([expected] * len(v), rel=1e-12, abs=1e-15)


def test_group_stats_of_equal_values_are_exact():
    # float64 values (python floats) whose float64 sum rounds: 0.1 * 3 != 0.1 + 0.1 + 0.1
    for size in (2, 3, 7, 10, 33):
        values = torch.tensor([0.1] * size, dtype=torch.float64)
        mean, std, _ = group_stats(values, torch.zeros(size, dtype=torch.long))
        assert mean.tolist() == [0.1] * size and std.tolist() == [0.0] * size
        assert sum([0.1] * size) / size != 0.1 or size == 2  # the naive mean is not exact


def test_group_stats_std_floor_is_relative_to_the_values():
    groups = torch.tensor([0, 0, 1, 1])
    # spreads well below and well above STD_FLOOR times 1e3
    values = torch.tensor([1e3, 1e3 + 1e-10, 1e3, 1e3 + 1e-4], dtype=torch.float64)
    _, std, _ = group_stats(values, groups)
    assert std[:2].tolist() == [0.0, 0.0]
    assert std[2:].tolist() == pytest.approx([1e-4 / math.sqrt(2)] * 2, rel=1e-6)
    assert 1e-10 / math.sqrt(2) < STD_FLOOR * 1e3 < 1e-4 / math.sqrt(2)


def test_group_stats_of_nothing_is_empty():
    mean, std, count = group_stats(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert mean.shape == std.shape == count.shape == (0,)


# ----------------------------------------------------------------- group estimators: zeros


def scan_batch(value: float, sizes=range(1, 65)):
    """One batch holding a group of every size (1..64) of the same reward, interleaved."""
    g = torch.Generator().manual_seed(int(abs(value) * 1000) % 997)
    group = torch.cat([torch.full((n,), 100 + 7 * n) for n in sizes])
    group = group[torch.randperm(len(group), generator=g)]
    return torch.full((len(group),), value), torch.ones(len(group), 3), group


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("norm", [True, False])
def test_equal_rewards_and_lone_rows_get_exactly_zero(name, norm):
    algo = AlgorithmConfig(norm_adv_by_std=norm)
    wrong = []
    for value in EQUAL_VALUES:
        rewards, mask, group = scan_batch(value)
        adv = ADVANTAGES.get(name)(rewards, mask, group, algo)
        wrong += [(value, int((group == gid).sum())) for gid in group[adv[:, 0] != 0].unique()]
    assert wrong == [], f"{name}: (value, group size) pairs with a nonzero advantage"


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "grpo_passk"])
def test_equal_groups_and_lone_rows_stay_zero_beside_other_groups(name):
    # group 0 equal, group 1 a lone row, group 2 spread: only group 2 moves
    rewards = torch.tensor([0.7, 2.0, 0.7, 0.0, 0.7, 1.0, 0.7, 5.0])
    group = torch.tensor([0, 2, 0, 2, 0, 1, 0, 2])
    for epsilon in (1e-6, 0.0):
        adv = ADVANTAGES.get(name)(
            rewards, torch.ones(8, 2), group, AlgorithmConfig(epsilon=epsilon)
        )[:, 0]
        assert adv[group != 2].tolist() == [0.0] * 5
        assert adv[group == 2].abs().sum() > 0 and bool(torch.isfinite(adv).all())


def test_group_estimators_on_a_group_worked_by_hand():
    # one group {1, 2, 4}: mean 7/3, unbiased variance (16 + 1 + 25) / 9 / 2 = 7/3
    rewards, group = torch.tensor([2.0, 4.0, 1.0]), torch.zeros(3, dtype=torch.long)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    eps = 1e-3
    std = math.sqrt(7 / 3)
    centred = [2 - 7 / 3, 4 - 7 / 3, 1 - 7 / 3]
    hand = {
        "grpo": [c / (std + eps) for c in centred],
        "drgrpo": centred,
        "rloo": [2 - 2.5, 4 - 1.5, 1 - 3.0],  # minus the mean of the other two
        "grpo_passk": [0.0, (4 - 2) / (std + eps), 0.0],  # only the best, best - second
    }
    for name, scalars in hand.items():
        adv = ADVANTAGES.get(name)(rewards, mask, group, AlgorithmConfig(epsilon=eps))
        torch.testing.assert_close(adv, torch.tensor(scalars)[:, None] * mask)
    unnormed = ADVANTAGES.get("grpo_passk")(
        rewards, mask, group, AlgorithmConfig(norm_adv_by_std=False)
    )
    torch.testing.assert_close(unnormed, torch.tensor([0.0, 2.0, 0.0])[:, None] * mask)


def test_group_advantages_match_a_loop_over_groups():
    g = torch.Generator().manual_seed(5)
    values = torch.randn(50, generator=g, dtype=torch.float64) * 3 + 1
    groups = torch.randint(0, 9, (50,), generator=g)
    for unbiased in (True, False):
        for loo in (True, False):
            out = group_advantages(
                values, groups, epsilon=0.01, unbiased=unbiased, leave_one_out=loo
            )
            for gid in groups.unique():
                rows = groups == gid
                v = values[rows]
                n = len(v)
                if n == 1:
                    assert out[rows].tolist() == [0.0]
                    continue
                c = v - v.mean()
                if loo:
                    c = torch.stack([v[i] - v[torch.arange(n) != i].mean() for i in range(n)])
                expected = c / (v.std(correction=1 if unbiased else 0) + 0.01)
                torch.testing.assert_close(out[rows], expected)


def test_pass_at_k_ties_and_lone_rows_get_zero():
    rewards = torch.tensor([3.0, 1.0, 3.0, 9.0])  # group 0 ties at the top; group 1 alone
    adv = ADVANTAGES.get("grpo_passk")(
        rewards, torch.ones(4, 1), torch.tensor([0, 0, 0, 1]), AlgorithmConfig()
    )
    assert adv[:, 0].tolist() == [0.0] * 4


# ------------------------------------------------------------------------------ group_credit

# (uid, agent_id, reward, loss_mask); row 2 fails scoring, row 3 is alone in its group,
# and row 4's first response token is not its policy's own (an environment token)
ROWS = [
    (0, 0, 1.0, [1, 1, 0]),
    (0, 0, 3.0, [1, 1, 1]),
    (0, 0, 5.0, [1, 0, 0]),
    (0, 1, 2.0, [1, 1, 0]),
    (1, 0, 0.0, [0, 1, 1]),
    (1, 0, 1.0, [1, 1, 1]),
    (1, 0, 5.0, [1, 1, 0]),
]


def scored_record():
    td = text_record(
        prompt_ids=[[1]] * len(ROWS),
        response_ids=[[2, 3, 4] if sum(m) else [2] for *_, m in ROWS],
        rollout_logprobs=[[0.0] * 3] * len(ROWS),
        policy=["main"] * len(ROWS),
        uid=[r[0] for r in ROWS],
        agent_id=[r[1] for r in ROWS],
        loss_mask=[r[3] for r in ROWS],
        pad_id=0,
    )
    td["reward"] = torch.tensor([r[2] for r in ROWS])
    mark_invalid(td, [2], ["reward failed"])
    td["reward"][2] = float("nan")
    return td


def expected_advantages(scalars):
    return torch.tensor(
        [[a * m for m in mask] for a, (*_, mask) in zip(scalars, ROWS, strict=True)]
    )


def test_group_credit_by_hand_grpo():
    record = scored_record()
    metrics = group_credit(record, AlgorithmConfig(advantage="grpo"))
    eps = AlgorithmConfig().epsilon
    # prompt 0, agent 0: rewards {1, 3} (5 failed): mean 2, std sqrt(2)
    # prompt 0, agent 1: one row, no baseline: 0 (verl's convention would leave its reward)
    # prompt 1: rewards {0, 1, 5}: mean 2, std sqrt((4 + 1 + 9) / 2) = sqrt(7)
    s2, s7 = math.sqrt(2) + eps, math.sqrt(7) + eps
    scalars = [-1 / s2, 1 / s2, 0.0, 0.0, -2 / s7, -1 / s7, 3 / s7]
    torch.testing.assert_close(record["advantages"], expected_advantages(scalars))
    valid = [a for i, a in enumerate(scalars) if i != 2]
    assert metrics["advantage/mean_abs"] == pytest.approx(sum(map(abs, valid)) / 6, rel=1e-5)
    assert metrics["advantage/zero_frac"] == pytest.approx(1 / 6)


def test_group_credit_by_hand_without_std():
    record = scored_record()
    group_credit(record, AlgorithmConfig(advantage="drgrpo"))
    scalars = [-1.0, 1.0, 0.0, 0.0, -2.0, -1.0, 3.0]  # a lone row: 0
    torch.testing.assert_close(record["advantages"], expected_advantages(scalars))


def test_group_credit_with_no_valid_rows_gives_zeros():
    record = scored_record()
    mark_invalid(record, list(range(len(ROWS))), ["failed"] * len(ROWS))
    metrics = group_credit(record, AlgorithmConfig())
    assert torch.equal(record["advantages"], torch.zeros(len(ROWS), 3))
    assert metrics == {"advantage/mean_abs": 0.0, "advantage/zero_frac": 0.0}


def test_assign_uses_the_recipe_scheme_and_checks_its_options():
    record = scored_record()
    algo = AlgorithmConfig(advantage="drgrpo")
    assign(record, algo)
    assert record["advantages"][1].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="algorithm.credit_args.scale"):
        assign(record, dataclasses.replace(algo, credit_args={"scale": 2.0}))
