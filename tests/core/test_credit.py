"""Credit assignment: group statistics and the default group scheme on a record by hand.

test_options.py checks group_stats on one small hand-worked case; here it is checked
against a per-group loop on random values, and group_credit on a record worked by hand.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.algorithms import AlgorithmConfig
from polyrl.core.config import ConfigError
from polyrl.core.credit import assign, group_credit, group_stats
from polyrl.core.record import mark_invalid, text_record

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


def test_group_stats_of_nothing_is_empty():
    mean, std, count = group_stats(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert mean.shape == std.shape == count.shape == (0,)


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
    # prompt 0, agent 1: one row; verl's convention (mean 0, std 1) leaves its raw reward
    # prompt 1: rewards {0, 1, 5}: mean 2, std sqrt((4 + 1 + 9) / 2) = sqrt(7)
    s2, s7 = math.sqrt(2) + eps, math.sqrt(7) + eps
    scalars = [-1 / s2, 1 / s2, 0.0, 2 / (1 + eps), -2 / s7, -1 / s7, 3 / s7]
    torch.testing.assert_close(record["advantages"], expected_advantages(scalars))
    valid = [a for i, a in enumerate(scalars) if i != 2]
    assert metrics["advantage/mean_abs"] == pytest.approx(sum(map(abs, valid)) / 6, rel=1e-5)
    assert metrics["advantage/zero_frac"] == 0.0


def test_group_credit_by_hand_without_std():
    record = scored_record()
    group_credit(record, AlgorithmConfig(advantage="drgrpo"))
    scalars = [-1.0, 1.0, 0.0, 2.0, -2.0, -1.0, 3.0]  # a lone row: r - 0
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
