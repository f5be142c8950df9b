"""Guards against over-optimisation: GRPO-Guard's ratio normalisation and step weights, and
the diversity of each group's images.

**Ratio normalisation** (GRPO-Guard, Wang et al. 2025, arXiv 2510.22319). A noisy step is
Gaussian, ``x' = μ_old + s·ε`` with the step's std ``s``. With ``Δ = μθ - μ_old`` the
per-step log-ratio of the ``gaussian`` log-prob (a mean over the latent's elements) is

    log r = mean(ε·Δ)/s - mean(Δ²)/(2s²),

whose mean over the noise is ``-b`` with ``b = mean(Δ²)/(2s²)`` (left of 0: a ratio below 1)
and whose spread ``~ |Δ|/s`` changes with the step's ``s``. GRPO-Guard centres and
rescales it, ``log r̃ = s·(log r + b) = mean(ε·Δ)``, so one clip range means the same at
every step. Flow-GRPO's CPS log-prob (``neg_mse``, ``-mean((x' - μ)²)``) is ``2s²`` times
the exponent, so there ``log r̃ = (log r + mean(Δ²))/(2s)``: the same ``mean(ε·Δ)``.
:func:`normalised_log_ratio` is the formula; :func:`ratio_scale` the factor the policy
applies (``policies.<name>.args.ratio_norm``).

**Step weights**: with the normalised ratio, a step's gradient carries the ``|dt|`` of its
mean's dependence on the velocity, so GRPO-Guard weighs each step's loss by ``1/|dt|``
(:func:`inverse_dt_weights`, ``algorithm.credit_args.step_weight: inv_dt``); here the
weights are divided by their mean over the row's trained steps, so the learning rate keeps
its meaning.

**Diversity** (:func:`group_diversity`): the mean over pairs of a group's images (same
prompt) of the RMS distance between their pixels in [0, 1]. 0: all alike; two uniformly
random images are about 0.41 apart.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ratio_scale(std: Tensor, form: str) -> Tensor:
    """The factor ``c`` with ``log r̃ = c·(log r + b)`` for a step of std ``std`` under the
    log-prob convention ``form``: ``s`` (gaussian) or ``1/(2s)`` (neg_mse); 0 where s = 0."""
    std = std.float()
    safe = torch.where(std > 0, std, torch.ones_like(std))
    if form == "gaussian":
        c = safe
    elif form == "neg_mse":
        c = 1 / (2 * safe)
    else:
        raise ValueError(f"log-prob form {form!r} is not gaussian or neg_mse")
    return torch.where(std > 0, c, torch.zeros_like(c))


def ratio_bias(mean: Tensor, old_mean: Tensor, std: Tensor, form: str) -> Tensor:
    """``b`` [B]: minus the noise-mean of the log-ratio, from means [B,*L] and std [B]."""
    sq = ((mean.float() - old_mean.float()) ** 2).flatten(1).mean(1)
    if form == "neg_mse":
        return sq
    var = std.float() ** 2
    return torch.where(var > 0, sq / (2 * var.clamp(min=1e-30)), torch.zeros_like(sq))


def normalised_log_ratio(
    logp: Tensor, old_logp: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor, form: str
) -> Tensor:
    """GRPO-Guard's ``log r̃ = c·(logp - old_logp + b)`` per row [B] (see the module doc)."""
    b = ratio_bias(mean, old_mean, std, form)
    return ratio_scale(std, form) * (logp - old_logp + b)


def inverse_dt_weights(sigmas: Tensor, mask: Tensor) -> Tensor:
    """[B,N] weights ``1/|dt|`` on each row's trained steps (``mask`` [B,N]), divided by their
    mean over those steps; 0 elsewhere. ``sigmas`` [B,N+1], ``dt = σ_{t+1} - σ_t``."""
    dt = (sigmas[:, :-1] - sigmas[:, 1:]).double().abs()
    on = mask.bool() & (dt > 0)
    w = torch.where(on, 1 / dt.clamp(min=1e-30), torch.zeros_like(dt))
    count = on.sum(1, keepdim=True).clamp(min=1)
    mean = w.sum(1, keepdim=True) / count
    return torch.where(on, w / mean.clamp(min=1e-30), torch.zeros_like(w)).float()


def pairwise_distances(images: Tensor) -> Tensor:
    """[K,K] RMS distances between K images [K,*] (float64, from the Gram matrix: no
    [K,K,pixels] intermediate for large images)."""
    flat = images.double().flatten(1)
    norms = (flat * flat).sum(1)
    sq = (norms[:, None] + norms[None, :] - 2 * flat @ flat.T) / flat.shape[1]
    sq.fill_diagonal_(0.0)
    return sq.clamp(min=0).sqrt()


def group_diversity(images: Tensor) -> tuple[float, Tensor]:
    """(mean pairwise RMS distance of the group's K images, each image's mean distance to the
    others [K]); (0, zeros) for fewer than two images."""
    k = images.shape[0]
    if k < 2:
        return 0.0, torch.zeros(k, dtype=torch.float64)
    d = pairwise_distances(images)
    per_image = d.sum(1) / (k - 1)
    return float(d.sum() / (k * (k - 1))), per_image


__all__ = [
    "group_diversity",
    "inverse_dt_weights",
    "normalised_log_ratio",
    "pairwise_distances",
    "ratio_bias",
    "ratio_scale",
]
