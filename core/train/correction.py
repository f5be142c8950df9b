"""Rollout correction: importance weights for the gap between the engine and the trainer.

The engine that sampled a response (the *behaviour* policy mu: vLLM in bf16, a stale
copy of the weights, a quantized rollout) is not exactly the policy the trainer computes
(the *proximal* policy pi_old: the trainer's own log-probs of the same tokens before the
update). The PPO ratio pi_theta / pi_old keeps its clip; the gap pi_old / mu is corrected by
a per-token weight w that multiplies each token's policy-gradient loss (decoupled PPO):

    log rho_t = log pi_old(y_t) - log mu(y_t)                      (token)
    log rho   = sum_t log rho_t                                    (sequence)
    log rho   = (1 / |y|) sum_t log rho_t                          (geometric)

    truncate (TIS):  w = min(rho, max)
    mask     (MIS):  w = rho if min <= rho <= max else 0           (a sequence level masks
                                                                    the whole response)
    reject band:     w = 0 for each token whose own rho_t leaves [lo, hi]
                     (icepop-style token masking; combines with either mode)

The weights carry no gradient. When the engine computes exactly what the trainer computes
(rho = 1 on every token) every weight is exactly 1 and the loss is unchanged. A masked
token keeps its place in the loss's denominator: it contributes zero, as a token whose
advantage is zero does.

Whatever the correction, :class:`Mismatch` measures the gap every step: mean and maximum
|log pi_old - log mu|, KL(mu || pi_old) (k3, unbiased and non-negative under mu's samples),
quantiles of rho and the fraction of tokens the correction truncated or masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from polyrl.core.config import ConfigError, doc
from polyrl.core.options import Options

Level = Literal["auto", "off", "token", "sequence", "geometric"]


@dataclass
class RolloutCorrection(Options):
    """Importance correction of the engine/trainer gap (see polyrl.core.train.correction)."""

    level: Level = doc(
        "auto",
        "where rho = pi_old / mu is taken: token, sequence (product over the response), "
        "geometric (its per-token geometric mean), or off. auto: off when every engine "
        "computes the trainer's own log-probs (hf, no staleness), else token",
    )
    mode: Literal["truncate", "mask"] = doc(
        "truncate",
        "truncate (TIS): w = min(rho, max); mask (MIS): w = rho inside [min, max], else 0",
    )
    max: float = doc(2.0, "upper bound of rho (truncation cap, or mask bound); > 1")
    min: float = doc(0.0, "mask mode: lower bound of rho (0: none); < 1")
    reject_band: list[float] | None = doc(
        None,
        "[lo, hi]: tokens whose own rho_t leaves this band get weight 0 (icepop uses "
        "[0.5, 5]); null: no token rejection",
    )

    def check(self, where: str = "algorithm.rollout_correction", source: str = "<config>") -> None:
        """Bounds that make a weight: max > 1, min in [0, 1), a band around 1."""
        if not (self.max > 1 and math.isfinite(self.max)):
            raise ConfigError(f"{where}.max={self.max} in {source}: must be a finite number > 1")
        if not 0 <= self.min < 1:
            raise ConfigError(f"{where}.min={self.min} in {source}: must be in [0, 1)")
        if self.reject_band is not None:
            band = self.reject_band
            if len(band) != 2 or not (0 <= band[0] < 1 < band[1]):
                raise ConfigError(
                    f"{where}.reject_band={band} in {source}: give [lo, hi] with 0 <= lo < 1 < hi"
                )

    def resolved(self, exact_engines: bool, max_staleness: int = 0) -> str:
        """The level in force: ``auto`` becomes off only where mu equals pi_old."""
        if self.level != "auto":
            return self.level
        return "off" if exact_engines and max_staleness == 0 else "token"

    def active(self, level: str) -> bool:
        return level != "off" or self.reject_band is not None


def log_rho(proximal: Tensor, behaviour: Tensor, mask: Tensor, level: str) -> Tensor:
    """log rho per token [B, T] at ``level`` (0 outside the mask; sequence levels broadcast)."""
    lr = (proximal.detach().float() - behaviour.float()) * mask
    if level in ("token", "off"):
        return lr
    total = lr.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown rollout correction level {level!r}")
    return total.expand_as(lr) * mask


def weights(
    proximal: Tensor, behaviour: Tensor, mask: Tensor, opts: RolloutCorrection, level: str
) -> tuple[Tensor, Tensor]:
    """(w [B, T] float32 without gradient, dropped [B, T] bool: tokens given weight 0)."""
    mask = mask.float()
    live = mask > 0
    w = torch.ones_like(mask)
    dropped = torch.zeros_like(live)
    if level != "off":
        lr = log_rho(proximal, behaviour, mask, level)
        hi = math.log(opts.max)
        if opts.mode == "truncate":
            w = torch.exp(lr.clamp(max=hi))
        else:
            lo = math.log(opts.min) if opts.min > 0 else -math.inf
            keep = (lr <= hi) & (lr >= lo)
            w = torch.where(keep, torch.exp(lr.clamp(max=hi)), torch.zeros_like(lr))
            dropped = ~keep & live
    if opts.reject_band is not None:
        lr_t = log_rho(proximal, behaviour, mask, "token")
        lo, hi = (math.log(b) for b in opts.reject_band)
        out = ((lr_t < lo) | (lr_t > hi)) & live
        w = torch.where(out, torch.zeros_like(w), w)
        dropped = dropped | out
    return (w * mask).detach(), dropped


@dataclass
class Mismatch:
    """Accumulates the engine/trainer gap over one update's micro-batches."""

    abs_sum: float = 0.0
    abs_max: float = 0.0
    k3_sum: float = 0.0
    tokens: float = 0.0
    truncated: float = 0.0
    dropped: float = 0.0
    rho: list[Tensor] = field(default_factory=list)

    def add(
        self,
        proximal: Tensor,
        behaviour: Tensor,
        mask: Tensor,
        opts: RolloutCorrection,
        level: str,
        dropped: Tensor | None,
    ) -> None:
        live = mask > 0
        if not bool(live.any()):
            return
        d = (proximal.detach().float() - behaviour.float())[live]  # log pi_old - log mu
        self.abs_sum += float(d.abs().sum())
        self.abs_max = max(self.abs_max, float(d.abs().max()))
        # KL(mu || pi_old) under mu's samples, k3 with r = pi_old / mu = e^d: r - 1 - log r
        self.k3_sum += float((torch.expm1(d) - d).sum())
        self.tokens += float(live.sum())
        shown = level if level != "off" else "token"
        lr = log_rho(proximal, behaviour, mask.float(), shown)[live]
        self.rho.append(torch.exp(lr))
        if level != "off" and opts.mode == "truncate":
            self.truncated += float((lr > math.log(opts.max)).sum())
        if dropped is not None:
            self.dropped += float(dropped[live].sum())

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        rho = torch.cat(self.rho)
        q = torch.quantile(rho, torch.tensor([0.1, 0.5, 0.9], dtype=rho.dtype))
        return {
            "mismatch/logp_abs_mean": self.abs_sum / self.tokens,
            "mismatch/logp_abs_max": self.abs_max,
            "mismatch/kl_engine_trainer": self.k3_sum / self.tokens,
            "mismatch/rho_p10": float(q[0]),
            "mismatch/rho_p50": float(q[1]),
            "mismatch/rho_p90": float(q[2]),
            "mismatch/rho_max": float(rho.max()),
            "mismatch/truncated_frac": self.truncated / self.tokens,
            "mismatch/masked_frac": self.dropped / self.tokens,
        }
