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
from polyrl.core.options import Options
from polyrl.core.record import strings
from polyrl.core.registry import CREDIT, KL_ESTIMATORS
from polyrl.core.train.credit import group_stats

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


STEP_WEIGHTS = ("uniform", "inv_dt")


@dataclass
class PerPromptOptions(Options):
    """Options of the ``per_prompt`` credit (``algorithm.credit_args``)."""

    adv_clip: float = doc(
        5.0, "clip advantages to [-adv_clip, adv_clip] (0: no clipping; Flow-GRPO: 5)"
    )
    global_std: bool = doc(
        False, "divide by the std of the whole batch's rewards instead of the prompt's"
    )
    terms: dict[str, float] = doc(
        {},
        "per-term advantages: {reward term key: weight}; each term's raw value "
        "(reward_terms/<key>) is normalised within its prompt group, then weighted and "
        "summed (empty: one advantage from the combined reward)",
    )
    step_weight: str = doc(
        "uniform",
        "weight of each trained step's advantage: uniform, or inv_dt (GRPO-Guard: 1/|dt|, "
        "divided by its mean over the row's trained steps)",
    )
    diversity_floor: float = doc(
        0.0,
        "diversity guard: a prompt group whose images' mean pairwise RMS pixel distance is "
        "below this gets diversity_weight x its rows' normalised distance to the others "
        "added to their advantages (0: off; the diversity metrics are logged either way)",
    )
    diversity_weight: float = doc(
        1.0, "weight of the diversity term in a group the guard fires on (>= 0)"
    )

    def check(self, where: str, source: str = "<config>") -> None:
        if self.adv_clip < 0:
            raise ConfigError(
                f"{where}.adv_clip={self.adv_clip} in {source}: must be >= 0 (0: no clipping)"
            )
        if self.step_weight not in STEP_WEIGHTS:
            raise ConfigError(
                f"{where}.step_weight={self.step_weight!r} in {source}: use one of "
                f"{', '.join(STEP_WEIGHTS)}"
            )
        if self.diversity_floor < 0 or self.diversity_weight < 0:
            raise ConfigError(
                f"{where}.diversity_floor and diversity_weight in {source} must be >= 0"
            )
        for key, w in self.terms.items():
            if not isinstance(w, (int, float)) or isinstance(w, bool):
                raise ConfigError(
                    f"{where}.terms.{key}={w!r} in {source}: a term's weight is a number"
                )


def per_term_advantages(
    terms: dict[str, Tensor],
    weights: dict[str, float],
    groups: Tensor,
    *,
    norm_by_std: bool = True,
    global_std: bool = False,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(sum of ``weights[k]`` x each term's per-prompt advantage [B], those advantages by
    key); each term [B] is normalised within its group as :func:`per_prompt_advantages`."""
    each = {
        k: per_prompt_advantages(
            terms[k], groups, norm_by_std=norm_by_std, global_std=global_std, eps=eps
        )
        for k in weights
    }
    total = sum((float(weights[k]) * each[k] for k in weights), torch.zeros(groups.shape[0]))
    return total.float(), each


def _group_ids(record: TensorDict, valid: Tensor) -> Tensor:
    texts = strings(record, "prompt_text")
    agents = record["agent_id"].tolist()
    keys: dict[tuple, int] = {}
    ids = [
        keys.setdefault((texts[i], agents[i]), len(keys))
        for i in range(len(texts))
        if bool(valid[i])
    ]
    return torch.tensor(ids, dtype=torch.long)


def _term_values(record: TensorDict, valid: Tensor, keys) -> dict[str, Tensor]:
    out = {}
    for k in keys:
        col = f"reward_terms/{k}"
        names = list(record.keys())  # TensorDict: `in` needs keys()
        if col not in names:
            have = sorted(n.split("/", 1)[1] for n in names if n.startswith("reward_terms/"))
            raise ConfigError(
                f"algorithm.credit_args.terms names {k!r}, which is not a reward term of this "
                f"record (reward.terms keys: {have}); name terms by their label or name"
            )
        out[k] = record[col][valid].float()
    return out


def _images(record: TensorDict, valid: Tensor) -> list | None:
    """The first image of each valid row (None when some row has none)."""
    if "meta" not in record.keys():  # noqa: SIM118 (TensorDict)
        return None
    metas = [m for m, ok in zip(strings(record, "meta"), valid.tolist(), strict=True) if ok]
    images = [m.get("images") if isinstance(m, dict) else None for m in metas]
    if not images or any(not im for im in images):
        return None
    return [im[0] for im in images]


def diversity_guard(
    images: list, groups: Tensor, floor: float, weight: float, norm_eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """(advantage term [B] of the diversity guard, diversity metrics) for images [B] in
    groups [B]. In a group whose diversity (:func:`group_diversity`) is below ``floor``, each
    row gets ``weight`` x its distance to the others, normalised within the group (centred,
    divided by the std + eps); elsewhere 0."""
    from polyrl.diffusion.guards import group_diversity
    from polyrl.diffusion.rewards import image_tensor

    pix = torch.stack([image_tensor(im) for im in images])
    term = torch.zeros(groups.shape[0], dtype=torch.float64)
    values, fired = [], 0
    for g in groups.unique().tolist():
        rows = (groups == g).nonzero().flatten()
        div, per = group_diversity(pix[rows])
        if rows.numel() < 2:
            continue
        values.append(div)
        if floor > 0 and div < floor:
            fired += 1
            centred = per - per.mean()
            term[rows] = weight * centred / (centred.pow(2).mean().sqrt() + norm_eps)
    metrics = {}
    if values:
        metrics = {
            "diversity/mean": sum(values) / len(values),
            "diversity/min": min(values),
            "guard/fired_frac": fired / len(values),
        }
    return term.float(), metrics


def per_prompt_credit(
    record: TensorDict,
    algo,
    *,
    adv_clip: float,
    global_std: bool,
    terms: dict[str, float] | None = None,
    step_weight: str = "uniform",
    diversity_floor: float = 0.0,
    diversity_weight: float = 1.0,
) -> dict[str, float]:
    """Per-prompt (text) mean/std advantages (of the combined reward, or per term), the
    diversity guard's term, clipped, on every trained step of a row (optionally weighted)."""
    mask = record["loss_mask"].float()
    valid = record["valid"]
    adv_row = torch.zeros(record.batch_size[0])
    metrics: dict[str, float] = {}
    if bool(valid.any()):
        ids = _group_ids(record, valid)
        norm = {"norm_by_std": bool(algo.norm_adv_by_std), "global_std": global_std}
        eps = float(algo.epsilon)
        if terms:
            adv, each = per_term_advantages(
                _term_values(record, valid, terms), terms, ids, eps=eps, **norm
            )
            metrics |= {f"advantage/{k}/mean_abs": float(a.abs().mean()) for k, a in each.items()}
        else:
            adv = per_prompt_advantages(record["reward"][valid], ids, eps=eps, **norm)
        images = _images(record, valid)
        if images is not None:
            guard, div = diversity_guard(images, ids, diversity_floor, diversity_weight)
            adv = adv + guard
            metrics |= div
        if adv_clip > 0:
            adv = adv.clamp(-adv_clip, adv_clip)
        adv_row[valid] = adv
    steps = mask
    if step_weight == "inv_dt":
        from polyrl.diffusion.guards import inverse_dt_weights

        steps = inverse_dt_weights(record["sigmas"], mask)
    record["advantages"] = adv_row[:, None] * steps
    rows = adv_row[valid]
    return metrics | {
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
