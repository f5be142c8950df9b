"""Tinker's built-in losses as pure tensor functions over one datum's target log-probs.

Each takes the datum's per-token log-probs of its ``target_tokens`` (``[N]``, with grad),
its ``loss_fn_inputs`` as tensors and the request's ``loss_fn_config``, and returns the
per-token loss (``[N]``); the request's loss is the SUM over tokens and datums, as Tinker
defines it (no mean: callers scale ``weights`` / ``advantages`` themselves)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


def cross_entropy(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config) -> torch.Tensor:
    """``-w * log p(target)``; ``weights`` default to ones."""
    w = inputs.get("weights")
    return -logp * (torch.ones_like(logp) if w is None else w)


def importance_sampling(logp: torch.Tensor, inputs, config) -> torch.Tensor:
    """REINFORCE with importance weights: ``-(p / q) * A``, ``q`` the sampler's log-probs."""
    ratio = torch.exp(logp - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(logp: torch.Tensor, inputs, config) -> torch.Tensor:
    """Clipped surrogate: ``-min(r * A, clip(r, low, high) * A)`` per token."""
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    ratio = torch.exp(logp - inputs["logprobs"])
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


# name -> (function, the loss_fn_inputs it needs besides target_tokens, config keys it reads)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, (), ()),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), ()),
    "ppo": (ppo, ("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
}
