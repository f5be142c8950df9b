"""Credit assignment: from a scored record to per-token advantages.

The default scheme groups rows by their group keys (prompt, agent, turn, node) and
applies the recipe's advantage estimator within each group. Plugins register schemes
that need the record's joint structure (MAGRPO trees, GiGPO step groups).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from tensordict import TensorDict

from polyrl.core.record import GROUP_KEYS, group_ids, take
from polyrl.core.registry import ADVANTAGES, CREDIT

# A group's std below this fraction of its largest |value| is rounding, not spread: float64
# sums of equal values leave ~1e-16 relative, while two float32 rewards one ulp apart in a
# group of a thousand still spread by ~2e-9. Such a std is reported as 0.
STD_FLOOR = 1e-9


def _dense(groups: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, dense = torch.unique(groups, return_inverse=True)
    return dense, int(dense.max()) + 1


def group_stats(
    values: torch.Tensor, groups: torch.Tensor, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's group mean, std and size, for values [B] and any integer group ids [B].

    The one group-statistics helper of the core and every plugin (agents' step groups,
    diffusion's per-prompt groups, marl's joint groups). ``unbiased`` divides the variance
    by n - 1 (torch's and verl's GRPO convention) and gives a one-row group std 0;
    otherwise by n (the population std Flow-GRPO uses). Computed in float64, and shifted
    by the group's minimum first, so a group of equal values has exactly their value as
    mean and exactly 0 as std; a std below ``STD_FLOOR`` times the group's largest |value|
    is rounding and reported as 0.
    """
    v = values.to(torch.float64)
    if v.numel() == 0:
        return v, v, v
    dense, n_groups = _dense(groups.to(v.device))
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=v.device)
    low = torch.full_like(zeros, torch.inf)
    low = low.scatter_reduce(0, dense, v, reduce="amin")
    scale = zeros.scatter_reduce(0, dense, v.abs(), reduce="amax")
    shifted = v - low[dense]  # exactly 0 throughout a group of equal values
    count = zeros.index_add(0, dense, torch.ones_like(v))
    shift_mean = zeros.index_add(0, dense, shifted) / count
    sq = zeros.index_add(0, dense, (shifted - shift_mean[dense]) ** 2)
    denom = (count - 1).clamp(min=1) if unbiased else count
    std = (sq / denom).sqrt()
    std = torch.where(std <= STD_FLOOR * scale, 0.0, std)
    return (low + shift_mean)[dense], std[dense], count[dense]


def group_advantages(
    values: torch.Tensor,
    groups: torch.Tensor,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    unbiased: bool = True,
    leave_one_out: bool = False,
) -> torch.Tensor:
    """[B] float64 advantages of values [B] within their groups: ``v - mean``, times
    n / (n - 1) with ``leave_one_out`` (RLOO: minus the mean of the others), divided by
    ``std + epsilon`` with ``norm_by_std``.

    A group with no spread (one row, or equal values: std 0 from :func:`group_stats`) has no
    baseline to compare against, so all its advantages are exactly 0 -- never the raw
    reward, never rounding noise divided by a tiny std. Zero-advantage rows are what the
    update's ``skip_zero_advantage`` leaves out.
    """
    v = values.to(torch.float64)
    if v.numel() == 0:
        return v
    mean, std, count = group_stats(v, groups, unbiased=unbiased)
    flat = (count < 2) | (std == 0)
    centred = v - mean
    if leave_one_out:
        centred = centred * count / (count - 1).clamp(min=1)
    if norm_by_std:
        centred = centred / torch.where(flat, 1.0, std + epsilon)
    return torch.where(flat, 0.0, centred)


class CreditSettings(Protocol):
    """What credit reads of the recipe's ``algorithm`` section (``AlgorithmConfig``, which
    imports this module, so it is named here by shape)."""

    advantage: str
    credit: str
    credit_args: Any


def group_credit(record: TensorDict, algo: CreditSettings) -> dict[str, float]:
    """Advantages for valid rows from the registered estimator; invalid rows get 0."""
    mask = record["loss_mask"].float()
    adv = torch.zeros_like(mask)
    valid = record["valid"]
    if bool(valid.any()):
        sub = take(record, valid)
        groups = group_ids(sub, GROUP_KEYS)
        estimator = ADVANTAGES.get(algo.advantage)
        adv[valid] = estimator(sub["reward"].float(), sub["loss_mask"].float(), groups, algo)
    record["advantages"] = adv
    rows = (
        adv[valid].sum(-1) / mask[valid].sum(-1).clamp(min=1)
        if bool(valid.any())
        else adv.new_zeros(0)
    )
    return {
        "advantage/mean_abs": float(rows.abs().mean()) if rows.numel() else 0.0,
        "advantage/zero_frac": float((rows == 0).float().mean()) if rows.numel() else 0.0,
    }


def assign(record: TensorDict, algo: CreditSettings) -> dict[str, float]:
    """Advantages by the recipe's credit scheme, called with its typed options."""
    options = CREDIT.bind(algo.credit, algo.credit_args, "algorithm.credit_args")
    return CREDIT.get(algo.credit)(record, algo, **options)


CREDIT.register("group", group_credit)
