"""Per-prompt advantages and the Gaussian-mean KL, for diffusion rows.

``per_prompt`` (CREDIT): Flow-GRPO's per-prompt statistics. Rows are grouped by prompt
*text* (and agent), so repeated prompts in a batch share one group whatever their dataset
row; ``A = (r - mean_prompt) / (std + eps)`` with the population std of the prompt's
rewards, or of the whole batch (``global_std``), or no division when
``algorithm.norm_adv_by_std`` is false; then clipped to ``[-adv_clip, adv_clip]``. The
advantage is spread over the row's trained steps (``loss_mask``). The options travel on
the record (``credit_args``, set by the text-to-image workflow from its ``adv_clip`` and
``global_std`` arguments), because credit assignment reads only the record.

``gaussian_mean`` (KL_ESTIMATORS): the exact KL between the policy's and the reference's
Gaussian step, ``mean((μθ - μref)²) / (2·std²)`` per step, from the means a diffusion
policy attaches to its log-prob tensor and the reference means its ``ref_logprobs``
returns (see :mod:`.policy`).
"""

from __future__ import annotations

import torch
from tensordict import NonTensorData, TensorDict
from torch import Tensor

from polyrl.core.record import strings
from polyrl.core.registry import CREDIT, KL_ESTIMATORS
from polyrl.diffusion.policy import MEANS_ATTR, STD_ATTR

DEFAULT_CREDIT_ARGS = {"adv_clip": 5.0, "global_std": False}


def credit_args(record: TensorDict) -> dict:
    args = dict(DEFAULT_CREDIT_ARGS)
    if "credit_args" in record.keys():  # noqa: SIM118 (TensorDict)
        value = record.get("credit_args")
        data = value.data if isinstance(value, NonTensorData) else strings(record, "credit_args")[0]
        args.update(data or {})
    return args


def per_prompt_advantages(
    rewards: Tensor,
    groups: Tensor,
    *,
    norm_by_std: bool = True,
    global_std: bool = False,
    eps: float = 1e-6,
    clip: float | None = None,
) -> Tensor:
    """[B] advantages from rewards [B] and dense group ids [B] (population std)."""
    rewards = rewards.float()
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, groups, torch.ones_like(rewards))
    mean = torch.zeros(n_groups).index_add_(0, groups, rewards) / count
    centred = rewards - mean[groups]
    if norm_by_std:
        if global_std:
            std = rewards.std(unbiased=False) if rewards.numel() else torch.tensor(0.0)
        else:
            var = torch.zeros(n_groups).index_add_(0, groups, centred**2) / count
            std = var.sqrt()[groups]
        centred = centred / (std + eps)
    if clip is not None and clip > 0:
        centred = centred.clamp(-clip, clip)
    return centred


@CREDIT.register("per_prompt")
def per_prompt_credit(record: TensorDict, algo) -> dict[str, float]:
    """Per-prompt (text) mean/std advantages, clipped, on every trained step of a row."""
    args = credit_args(record)
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
            global_std=bool(args["global_std"]),
            eps=float(algo.epsilon),
            clip=args["adv_clip"],
        )
    record["advantages"] = adv_row[:, None] * mask
    rows = adv_row[valid]
    return {
        "advantage/mean_abs": float(rows.abs().mean()) if rows.numel() else 0.0,
        "advantage/zero_frac": float((rows == 0).float().mean()) if rows.numel() else 0.0,
    }


def gaussian_mean_kl(logprobs: Tensor, ref: Tensor) -> Tensor:
    """Per-step KL(πθ || πref) = mean over latent elements of (μθ - μref)² / (2·std²)."""
    means = getattr(logprobs, MEANS_ATTR, None)
    std = getattr(logprobs, STD_ATTR, None)
    if means is None or std is None or ref.dim() < 3:
        raise ValueError(
            "kl_estimator=gaussian_mean needs a diffusion policy's step means "
            "(policy kind 'diffusion' with the text_to_image workflow); use k1/k3 "
            "estimators for other policies"
        )
    sq = ((means - ref.to(means)) ** 2).flatten(2).mean(-1)
    var = std.to(sq) ** 2
    return torch.where(var > 0, sq / (2 * var.clamp(min=1e-30)), torch.zeros_like(sq))


KL_ESTIMATORS.register("gaussian_mean", gaussian_mean_kl)
