"""Credit assignment: from a scored record to per-token advantages.

The default scheme groups rows by their group keys (prompt, agent, turn, node) and
applies the recipe's advantage estimator within each group. Plugins register schemes
that need the record's joint structure (MAGRPO trees, GiGPO step groups).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from polyrl.core.record import GROUP_KEYS, group_ids
from polyrl.core.registry import ADVANTAGES, CREDIT


def group_stats(
    values: torch.Tensor, groups: torch.Tensor, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's group mean, std and size, for values [B] and any integer group ids [B].

    The one group-statistics helper of the core and every plugin (agents' step groups,
    diffusion's per-prompt groups, marl's joint groups). ``unbiased`` divides the variance
    by n - 1 (torch's and verl's GRPO convention) and gives a one-row group std 0;
    otherwise by n (the population std Flow-GRPO uses). Computed in float64.
    """
    v = values.to(torch.float64)
    if v.numel() == 0:
        return v, v, v
    _, dense = torch.unique(groups, return_inverse=True)
    n_groups = int(dense.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, dense, torch.ones_like(v))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, dense, v) / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, dense, (v - mean[dense]) ** 2)
    denom = (count - 1).clamp(min=1) if unbiased else count
    std = (sq / denom).sqrt()
    return mean[dense], std[dense], count[dense]


def group_credit(record: TensorDict, algo) -> dict[str, float]:
    """Advantages for valid rows from the registered estimator; invalid rows get 0."""
    mask = record["loss_mask"].float()
    adv = torch.zeros_like(mask)
    valid = record["valid"]
    if bool(valid.any()):
        sub = record[valid]
        groups = group_ids(sub, GROUP_KEYS)
        estimator = ADVANTAGES.get(algo.advantage)
        adv[valid] = estimator(sub["reward"].float(), sub["loss_mask"].float(), groups, algo)
    record["advantages"] = adv
    rows = (
        adv[valid].sum(-1) / mask[valid].sum(-1).clamp(min=1) if bool(valid.any()) else adv[:0, 0]
    )
    return {
        "advantage/mean_abs": float(rows.abs().mean()) if rows.numel() else 0.0,
        "advantage/zero_frac": float((rows == 0).float().mean()) if rows.numel() else 0.0,
    }


def assign(record: TensorDict, algo) -> dict[str, float]:
    """Advantages by the recipe's credit scheme, called with its typed options."""
    options = CREDIT.bind(algo.credit, algo.credit_args, "algorithm.credit_args")
    return CREDIT.get(algo.credit)(record, algo, **options)


CREDIT.register("group", group_credit)
