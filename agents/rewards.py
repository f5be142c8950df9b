"""Rewards that read what the environment reported (rows from the multi-turn workflow).

- ``env_return``: the episode's undiscounted sum of environment rewards.
- ``env_success``: 1.0 if the episode succeeded (the env's ``info["success"]``, else
  return > 0), per row.
- ``success_rate``: the same success, weighted so that the *row mean* is the success rate
  over episodes even in ``step`` mode, where long episodes have more rows. Use it with
  weight 0 as a metric (``eval.accuracy_term: success_rate``), not as a training reward.
"""

from __future__ import annotations

from polyrl.core.rewards import Sample, register_reward


def _meta(sample: Sample, key: str, reward: str):
    if key not in sample.meta:
        raise ValueError(f"{reward} needs meta[{key!r}] from the multi_turn workflow; this row "
                         f"has meta keys {sorted(sample.meta)}")
    return sample.meta[key]


@register_reward("env_return")
def env_return(sample: Sample, scale: float = 1.0) -> float:
    """The episode's summed environment reward, times ``scale``."""
    return scale * float(_meta(sample, "return", "env_return"))


@register_reward("env_success")
def env_success(sample: Sample) -> float:
    """1.0 when the episode succeeded, else 0.0."""
    return float(bool(_meta(sample, "success", "env_success")))


@register_reward("success_rate")
def success_rate(sample: Sample) -> float:
    """Success weighted per row so that the mean over rows is the per-episode success rate."""
    weight = float(sample.meta.get("episode_weight", 1.0))
    return weight * float(bool(_meta(sample, "success", "success_rate")))
