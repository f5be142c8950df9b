"""Per-prompt advantages and the Gaussian-mean KL, for diffusion rows.

``per_prompt`` (CREDIT): Flow-GRPO's per-prompt statistics (arXiv 2505.05470). Rows are
grouped by prompt *text* (and agent), so repeated prompts in a batch share one group
whatever their dataset row; ``A = (r - mean_prompt) / (std + eps)`` with the population
std of the prompt's rewards, or of the whole batch (``global_std``), or no division when
``algorithm.norm_adv_by_std`` is false; then clipped to ``[-adv_clip, adv_clip]``. The
advantage is spread over the row's trained steps (``loss_mask``). Its options are its
keyword parameters, set in ``algorithm.credit_args``.

``gaussian_mean``: the KL between the policy's and the reference's Gaussian step (both have
the step's std), ``mean((μθ - μref)²) / (2·c²)`` per step, with ``c`` the step's std (exact)
or Flow-GRPO's ``std_dev_t`` (``policies.<name>.args.kl_form``). It needs the
steps' means, which only the policy has, so the diffusion policy computes it itself
(:class:`polyrl.core.interfaces.OwnsKL`, with :func:`gaussian_mean_kl`); the name is
registered in ``KL_ESTIMATORS`` so recipes naming it validate, and calling it as a
log-prob estimator (for a policy that does not own it) fails saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor

from polyrl.core.config import ConfigError, doc
from polyrl.core.credit import group_stats
from polyrl.core.options import Options
from polyrl.core.record import strings
from polyrl.core.registry import CREDIT, KL_ESTIMATORS

GAUSSIAN_MEAN = "gaussian_mean"


def per_prompt_advantages(
    rewards: Tensor,
    groups: Tensor,
    *,
    norm_by_std: bool = True,
    global_std: bool = False,
    eps: float = 1e-6,
    clip: float | None = None,
) -> Tensor:
    """[B] float32 advantages from rewards [B] and integer group ids [B] (population std)."""
    mean, std, _ = group_stats(rewards, groups, unbiased=False)
    centred = rewards.to(mean) - mean
    if norm_by_std:
        if global_std:
            _, std, _ = group_stats(rewards, torch.zeros_like(groups), unbiased=False)
        centred = centred / (std + eps)
    if clip is not None and clip > 0:
        centred = centred.clamp(-clip, clip)
    return centred.float()


@dataclass
class PerPromptOptions(Options):
    """Options of the ``per_prompt`` credit (``algorithm.credit_args``)."""

    adv_clip: float = doc(
        5.0, "clip advantages to [-adv_clip, adv_clip] (0: no clipping; Flow-GRPO: 5)"
    )
    global_std: bool = doc(
        False, "divide by the std of the whole batch's rewards instead of the prompt's"
    )

    def check(self, where: str, source: str = "<config>") -> None:
        if self.adv_clip < 0:
            raise ConfigError(
                f"{where}.adv_clip={self.adv_clip} in {source}: must be >= 0 (0: no clipping)"
            )


def per_prompt_credit(
    record: TensorDict, algo, *, adv_clip: float, global_std: bool
) -> dict[str, float]:
    """Per-prompt (text) mean/std advantages, clipped, on every trained step of a row."""
    mask = record["loss_mask"].float()
    valid = record["valid"]
    adv_row = torch.zeros(record.batch_size[0])
    if bool(valid.any()):
        texts = strings(record, "prompt_text")
        agents = record["agent_id"].tolist()
        keys: dict[tuple, int] = {}
        ids = [
            keys.setdefault((texts[i], agents[i]), len(keys))
            for i in range(len(texts))
            if bool(valid[i])
        ]
        adv_row[valid] = per_prompt_advantages(
            record["reward"][valid],
            torch.tensor(ids),
            norm_by_std=bool(algo.norm_adv_by_std),
            global_std=global_std,
            eps=float(algo.epsilon),
            clip=adv_clip,
        )
    record["advantages"] = adv_row[:, None] * mask
    rows = adv_row[valid]
    return {
        "advantage/mean_abs": float(rows.abs().mean()) if rows.numel() else 0.0,
        "advantage/zero_frac": float((rows == 0).float().mean()) if rows.numel() else 0.0,
    }


def gaussian_mean_kl(means: Tensor, ref_means: Tensor, std: Tensor) -> Tensor:
    """Per-step KL(πθ || πref) [B,T] of two Gaussian steps sharing the std [B,T]: the mean
    over latent elements of (μθ - μref)² / (2·std²), from means [B,T,*L]; 0 where std is 0.
    Flow-GRPO's form passes its ``std_dev_t`` as ``std`` (see ``Sampler.noise_coefficient``)."""
    sq = ((means - ref_means.to(means)) ** 2).flatten(2).mean(-1)
    var = std.to(sq) ** 2
    return torch.where(var > 0, sq / (2 * var.clamp(min=1e-30)), torch.zeros_like(sq))


def _gaussian_mean_needs_its_policy(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Reached only for a policy that does not compute this KL itself."""
    raise ConfigError(
        f"algorithm.kl_estimator={GAUSSIAN_MEAN} is the KL between two Gaussian denoising "
        "steps, computed from their means by a policy that owns it (policy kind 'diffusion'); "
        "this policy gives only log-probs: use a log-prob estimator (k1, k3, low_var_kl)"
    )


CREDIT.register("per_prompt", per_prompt_credit, options=PerPromptOptions)
KL_ESTIMATORS.register(GAUSSIAN_MEAN, _gaussian_mean_needs_its_policy)
