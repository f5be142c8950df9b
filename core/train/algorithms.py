"""Advantage estimators, policy losses, KL estimators and loss aggregation.

Pure tensor functions behind the core registries (``ADVANTAGES``, ``POLICY_LOSSES``,
``KL_ESTIMATORS``), so a recipe picks its algorithm by name and a plugin can add one
without touching the trainer. Losses, KL estimators, aggregation and REINFORCE++ are verl's
(``verl.trainer.ppo.core_algos``): we wrap its reference implementations instead of keeping
a second copy that could drift. The group estimators (grpo, drgrpo, rloo, grpo_passk, the
REINFORCE++ baseline) take their group statistics from
:func:`polyrl.core.train.credit.group_advantages` instead (float64, a group of one row or of equal
rewards gets exactly 0; verl's run in float32, so 12 rewards of 0.7 get +0.1 each) and
are tested against verl's on well-conditioned groups. verl is an implementation detail
imported lazily on first use, because importing it costs seconds.

Shapes: ``B`` rows (samples), ``R`` response tokens. ``mask [B,R]`` is 1 on the tokens this
row's policy generated (the loss tokens) and 0 elsewhere (padding, tool output, other agents).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from polyrl.core.config import (
    AT_LEAST_1,
    NONNEGATIVE,
    POSITIVE,
    SHARE,
    Bound,
    ConfigError,
    doc,
    doc_factory,
)
from polyrl.core.dependencies import require
from polyrl.core.options import Options
from polyrl.core.registry import ADVANTAGES, CREDIT, KL_ESTIMATORS, POLICY_LOSSES, nearest
from polyrl.core.train.correction import RolloutCorrection
from polyrl.core.train.credit import group_advantages, group_stats

# Losses that are advantage times a function of the ratio: a zero-advantage row adds nothing.
ADVANTAGE_LINEAR_LOSSES = ("ppo_clip", "gspo", "cispo")
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass
class SapoOptions(Options):
    """SAPO's gate temperatures."""

    tau_pos: float = doc(1.0, "gate temperature for positive advantages", bound=POSITIVE)
    tau_neg: float = doc(1.05, "gate temperature for non-positive advantages", bound=POSITIVE)


@dataclass
class ClipCovOptions(Options):
    """Which tokens Clip-Cov cuts from the gradient."""

    clip_cov_ratio: float = doc(0.0002, "fraction of tokens whose gradient is cut", bound=SHARE)
    clip_cov_lb: float = doc(1.0, "lower covariance bound of cut candidates")
    clip_cov_ub: float = doc(5.0, "upper covariance bound of cut candidates")


@dataclass
class KlCovOptions(Options):
    """Which tokens KL-Cov penalises, and how much."""

    kl_cov_ratio: float = doc(
        0.0002, "fraction of highest-covariance tokens penalised", bound=SHARE
    )
    ppo_kl_coef: float = doc(
        0.1, "weight of the |log-ratio| penalty on those tokens", bound=NONNEGATIVE
    )


# What verl's ActorConfig needs beyond the clip ratios: each loss's own options' defaults.
_LOSS_DEFAULTS = {
    f.name: f.default
    for options in (SapoOptions, ClipCovOptions, KlCovOptions)
    for f in dataclasses.fields(options)
}


@dataclass
class AlgorithmConfig:
    """How rewards become advantages and advantages become a policy-gradient loss."""

    advantage: str = doc("grpo", "advantage estimator (registered name or 'pkg.mod:fn')")
    credit: str = doc("group", "credit-assignment scheme that applies the advantage estimator")
    credit_args: Any = doc(
        {}, "options of the credit scheme", options=CREDIT, chooser="algorithm.credit"
    )
    policy_loss: str = doc(
        "ppo_clip",
        "policy loss (registered name or 'pkg.mod:fn'): ppo_clip, gspo (the log of its "
        "sequence ratio is clamped at 10: beyond, the loss is capped and the gradient 0), "
        "cispo, sapo, clip_cov, kl_cov",
    )
    clip_ratio_low: float = doc(0.2, "ratio may fall to 1 - clip_ratio_low before clipping")
    clip_ratio_high: float = doc(0.2, "ratio may rise to 1 + clip_ratio_high (DAPO clip-higher)")
    clip_ratio_c: float = doc(
        3.0,
        "dual clip (ppo_clip): a negative advantage's loss is at most -A * clip_ratio_c, "
        "whatever the ratio (> 1; .inf: no dual clip, as Flow-GRPO)",
        bound=Bound(above=1, finite=False),
    )
    loss_agg: str = doc("token-mean", f"loss aggregation: {', '.join(LOSS_AGG_MODES)}")
    loss_scale_factor: int | None = doc(
        None, "divisor for seq-mean-token-sum-norm; None = the padded response length"
    )
    kl_coef: float = doc(
        0.0, "weight of the KL-to-reference loss term (0 = no reference model)", bound=NONNEGATIVE
    )
    kl_estimator: str = doc(
        "low_var_kl",
        "per-token KL estimator for the KL loss term: k1, k2, k3 (= low_var_kl: exp(-x) + "
        "x - 1, x = log pi - log ref, clamped like verl's to at most 10 per token, so a "
        "token past it is under-counted and gets no KL gradient), abs; a '+' suffix keeps "
        "the value and takes the k2 gradient",
    )
    entropy_coef: float = doc(
        0.0, "weight of the entropy bonus (subtracted from the loss)", bound=NONNEGATIVE
    )
    log_entropy: bool = doc(
        True,
        "report the policy's mean entropy per trained token (metric <policy>/entropy) "
        "even when entropy_coef is 0: one softmax over the vocabulary per response token, "
        "no gradient through it",
    )
    gamma: float = doc(
        1.0, "discount factor (reinforce_plus_plus returns, turn returns)", bound=SHARE
    )
    norm_adv_by_std: bool = doc(True, "grpo/grpo_passk: divide by the group std (off = Dr.GRPO)")
    epsilon: float = doc(
        1e-6, "added to the std before dividing, against zero-variance groups", bound=NONNEGATIVE
    )
    ppo_epochs: int = doc(1, "passes over each rollout batch", bound=AT_LEAST_1)
    minibatches: int = doc(1, "optimizer steps per rollout batch per epoch", bound=AT_LEAST_1)
    loss_args: Any = doc(
        {}, "options of the policy loss", options=POLICY_LOSSES, chooser="algorithm.policy_loss"
    )
    rollout_correction: RolloutCorrection = doc_factory(
        RolloutCorrection,
        "importance correction of the gap between the engine that sampled and the "
        "trainer (TIS/MIS, token or sequence level; see polyrl.core.train.correction). The "
        "weights multiply each token's loss term: at level token every token has its own "
        "weight (under gspo too, whose clipped ratio is one per sequence); sequence and "
        "geometric give one weight per row, on all its tokens",
    )
    skip_zero_advantage: bool | None = doc(
        None,
        "forward/backward only the rows with a nonzero advantage on a trained token; "
        "the loss totals still count every row, so the gradient is the same (to float "
        "summation order) for less compute. Exact with an advantage-linear loss (ppo_clip, "
        "gspo, cispo), kl_coef 0 and entropy_coef 0. null (default): on wherever exact; "
        "true: on, and a config where it is not exact is refused; false: off",
    )

    def validate(self) -> None:
        """Fail at config time, naming the closest valid choice, rather than mid-training."""
        import polyrl.core.train.credit  # noqa: F401  (registers the built-in credit schemes)

        ADVANTAGES.check(self.advantage)
        CREDIT.check(self.credit)
        self.credit_args = CREDIT.bind(self.credit, self.credit_args, "algorithm.credit_args")
        POLICY_LOSSES.check(self.policy_loss)
        self.loss_args = POLICY_LOSSES.bind(self.policy_loss, self.loss_args, "algorithm.loss_args")
        KL_ESTIMATORS.check(self.kl_estimator)
        if self.loss_agg not in LOSS_AGG_MODES:
            hint = nearest(self.loss_agg, LOSS_AGG_MODES)
            msg = f"algorithm.loss_agg={self.loss_agg!r} is not a loss aggregation mode"
            msg += f"; did you mean {hint!r}?" if hint else "."
            raise ConfigError(msg + f" Valid: {', '.join(LOSS_AGG_MODES)}.")
        if not self.clip_ratio_c > 1.0:
            raise ConfigError(f"algorithm.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ConfigError("algorithm.clip_ratio_low and clip_ratio_high must be >= 0")
        if self.ppo_epochs < 1 or self.minibatches < 1:
            raise ConfigError("algorithm.ppo_epochs and minibatches must be >= 1")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.epsilon < 0:
            raise ConfigError("algorithm.kl_coef, entropy_coef and epsilon must be >= 0")
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ConfigError("algorithm.loss_scale_factor must be positive (or null)")
        self.rollout_correction.check()
        if self.skip_zero_advantage and (why := self._skip_zero_advantage_inexact()):
            raise ConfigError(
                f"algorithm.skip_zero_advantage=true {why} (null turns it on "
                "only where it is exact; false turns it off)"
            )

    def skips_zero_advantage(self) -> bool:
        """Whether the update leaves out rows with no advantage on a trained token."""
        if self.skip_zero_advantage is None:
            return self._skip_zero_advantage_inexact() is None
        return self.skip_zero_advantage

    def _skip_zero_advantage_inexact(self) -> str | None:
        """Why skipping would change the update, or None. Rows with zero advantage must add
        nothing to the loss, and the loss's divisor must not depend on which rows run."""
        if self.kl_coef > 0 or self.entropy_coef > 0:
            return (
                f"needs kl_coef=0 and entropy_coef=0 (got {self.kl_coef} and "
                f"{self.entropy_coef}): those terms give zero-advantage rows a gradient, "
                "so skipping them would change the update"
            )
        if self.policy_loss not in ADVANTAGE_LINEAR_LOSSES:
            return (
                f"works with the losses {', '.join(ADVANTAGE_LINEAR_LOSSES)} (zero "
                f"advantage, zero loss); policy_loss={self.policy_loss!r} is not one of them"
            )
        if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            return (
                "with loss_agg=seq-mean-token-sum-norm needs loss_scale_factor set: its "
                "default divisor is the padded length of the rows that run"
            )
        return None


@dataclass(frozen=True)
class AggInfo:
    """How to turn a micro-batch loss matrix into a scalar that sums correctly.

    With gradient accumulation each micro-batch loss is divided by mini-batch totals, not
    micro-batch ones, so summing the micro-batch losses gives exactly the mini-batch loss
    (and gradient). ``None`` falls back to the micro-batch's own totals. Under data
    parallelism the totals are over all ranks and ``dp_size`` undoes the gradient averaging.
    """

    mode: str = "token-mean"
    batch_num_tokens: int | None = None  # loss tokens in the whole mini-batch
    global_batch_size: int | None = None  # sequences with > 0 loss tokens in the mini-batch
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm divisor; None = R
    dp_size: int = 1

    @classmethod
    def for_minibatch(
        cls, mode: str, mask: Tensor, loss_scale_factor: int | None = None
    ) -> AggInfo:
        """Totals taken from the whole (single-rank) mini-batch mask, before splitting it."""
        nonzero = mask.reshape(mask.shape[0], -1).sum(-1) > 0
        return cls(
            mode=mode,
            batch_num_tokens=int((mask != 0).sum().item()),
            global_batch_size=int(nonzero.sum().item()),
            loss_scale_factor=loss_scale_factor,
        )


# --------------------------------------------------------------------------- verl access


@functools.cache
def _verl() -> ModuleType:
    """verl's core_algos, imported once on first use (the import takes seconds)."""
    return require("verl.trainer.ppo.core_algos", "polyrl.core.train.algorithms", "verl")


@functools.lru_cache(maxsize=32)
def _algo_config(gamma: float, lam: float, norm_adv_by_std: bool) -> Any:
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std)


def _verl_algo_config(cfg: AlgorithmConfig) -> Any:
    return _algo_config(float(cfg.gamma), 1.0, bool(cfg.norm_adv_by_std))


_ACTOR_FIELDS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tau_pos",
    "tau_neg",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
)


@functools.lru_cache(maxsize=64)
def _actor_config(loss_mode: str, *values: float) -> Any:
    """A verl ActorConfig carrying our loss settings; built once per distinct setting."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    v = dict(zip(_ACTOR_FIELDS, values, strict=True))
    return ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=v["clip_ratio_low"],
        clip_ratio_low=v["clip_ratio_low"],
        clip_ratio_high=v["clip_ratio_high"],
        clip_ratio_c=v["clip_ratio_c"],
        tau_pos=v["tau_pos"],
        tau_neg=v["tau_neg"],
        policy_loss=PolicyLossConfig(
            loss_mode=loss_mode,
            clip_cov_ratio=v["clip_cov_ratio"],
            clip_cov_lb=v["clip_cov_lb"],
            clip_cov_ub=v["clip_cov_ub"],
            kl_cov_ratio=v["kl_cov_ratio"],
            ppo_kl_coef=v["ppo_kl_coef"],
        ),
    )


def _verl_actor_config(loss_mode: str, cfg: AlgorithmConfig, agg: AggInfo) -> Any:
    """verl's losses read the batch totals from ``global_batch_info``: each call gets its
    own copy of the cached config with its own dict, so the cached one is never changed."""
    own = _LOSS_DEFAULTS | dict(POLICY_LOSSES.bind(cfg.policy_loss, cfg.loss_args, "loss_args"))
    clips = {f: getattr(cfg, f) for f in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")}
    cached = _actor_config(loss_mode, *(float((clips | own)[f]) for f in _ACTOR_FIELDS))
    return dataclasses.replace(cached, global_batch_info=_agg_kwargs(agg))


def _agg_kwargs(agg: AggInfo) -> dict[str, Any]:
    return {
        "dp_size": agg.dp_size,
        "batch_num_tokens": agg.batch_num_tokens,
        "global_batch_size": agg.global_batch_size,
        "loss_scale_factor": agg.loss_scale_factor,
    }


# ------------------------------------------------------------------ advantage estimators


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Scalar rewards placed on each row's last loss token, as verl's estimators expect.

    A row with no loss token keeps its reward in the last column, so it still counts in its
    group's statistics (its own advantage is zeroed by the mask).
    """
    b, r = mask.shape
    out = torch.zeros((b, r), dtype=torch.float32, device=mask.device)
    if r == 0:
        return out
    positions = torch.arange(r, device=mask.device).expand(b, r)
    last = torch.where(mask != 0, positions, -1).amax(dim=-1)
    last = torch.where(last < 0, r - 1, last)
    out[torch.arange(b, device=mask.device), last] = rewards.to(out)
    return out


def _prepare(rewards: Tensor, mask: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Any]:
    m = mask.to(dtype=torch.float32)
    index = group.detach().reshape(-1).cpu().numpy()
    return outcome_token_rewards(rewards.detach(), m), m, index


def _finish(adv: Tensor, mask: Tensor) -> Tensor:
    return (adv.to(torch.float32) * (mask != 0)).contiguous()


def _per_row(scalars: Tensor, mask: Tensor) -> Tensor:
    """Row scalars [B] spread over each row's loss tokens, float32 [B, R]."""
    return (scalars.to(torch.float32)[:, None] * (mask != 0)).contiguous()


def _grouped(
    rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig, **how: bool
) -> Tensor:
    with torch.no_grad():
        scalars = group_advantages(
            rewards.detach(), group.detach().reshape(-1), epsilon=float(cfg.epsilon), **how
        )
    return _per_row(scalars, mask)


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps), unbiased std; std division per
    ``cfg.norm_adv_by_std``. A group of one row or of equal rewards gets exactly 0."""
    return _grouped(rewards, mask, group, cfg, norm_by_std=bool(cfg.norm_adv_by_std))


@ADVANTAGES.register("drgrpo")
def drgrpo_advantage(rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """Dr.GRPO: r - group mean, never divided by the std (removes the difficulty bias)."""
    return _grouped(rewards, mask, group, cfg, norm_by_std=False)


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """RLOO: r minus the mean reward of the other samples in its group (0 for a lone row)."""
    return _grouped(rewards, mask, group, cfg, norm_by_std=False, leave_one_out=True)


@ADVANTAGES.register("grpo_passk")
def grpo_passk_advantage(
    rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig
) -> Tensor:
    """Pass@k: only each group's strictly best sample gets (best - second best) [/ std];
    a group of one row, or whose best is tied, gets 0."""
    r = rewards.detach().to(torch.float64)
    if r.numel() == 0:
        return _per_row(r, mask)
    _, g = torch.unique(group.detach().reshape(-1).to(r.device), return_inverse=True)
    lowest = torch.full((int(g.max()) + 1,), -torch.inf, dtype=torch.float64, device=r.device)
    best = lowest.scatter_reduce(0, g, r, "amax")
    top = r == best[g]
    ties = torch.zeros_like(best).index_add(0, g, top.to(best.dtype))
    second = lowest.scatter_reduce(0, g, torch.where(top, -torch.inf, r), "amax")
    _, std, count = group_stats(r, g)
    gap = best[g] - second[g]
    if cfg.norm_adv_by_std:
        gap = gap / torch.where(std > 0, std + float(cfg.epsilon), 1.0)
    wins = top & (ties[g] == 1) & (count > 1)
    return _per_row(torch.where(wins, gap, 0.0), mask)


def _too_few_tokens(mask: Tensor) -> bool:
    # verl whitens over all loss tokens with an unbiased variance: it needs >= 2 of them.
    return int((mask != 0).sum().item()) < 2


@ADVANTAGES.register("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig
) -> Tensor:
    """REINFORCE++: discounted return-to-go (``cfg.gamma``), whitened over the batch's tokens."""
    if _too_few_tokens(mask):
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    token_rewards, m, _ = _prepare(rewards, mask, group)
    with torch.no_grad():
        adv, _ = _verl().compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, m, config=_verl_algo_config(cfg)
        )
    return _finish(adv, mask)


@ADVANTAGES.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    rewards: Tensor, mask: Tensor, group: Tensor, cfg: AlgorithmConfig
) -> Tensor:
    """REINFORCE++ with a group-mean baseline, then whitened over the batch's tokens (verl's
    ``masked_whiten``). The centring is :func:`group_advantages`'s, so a lone row or a group of
    equal rewards is centred to exactly 0 (verl's own keeps a lone row's raw reward); the
    whitening then subtracts the batch's token mean from every token, as REINFORCE++ does,
    so those rows are exactly 0 only when that mean is."""
    if _too_few_tokens(mask):
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    from verl.utils.torch_functional import masked_whiten

    centred = _grouped(rewards, mask, group, cfg, norm_by_std=False)
    with torch.no_grad():
        m = (mask != 0).to(torch.float32)
        return (masked_whiten(centred, m) * m).contiguous()


# ------------------------------------------------------------------------ policy losses


def _verl_loss(
    name: str, verl_name: str, summary: str, options: type | None = None
) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """Register verl's policy loss ``verl_name`` under our name and signature."""

    def loss(
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        cfg: AlgorithmConfig,
        agg: AggInfo,
        *,
        weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        actor = _verl_actor_config(verl_name, cfg, agg)
        fn = _verl().get_policy_loss_fn(verl_name)
        value, metrics = fn(
            old_log_prob=old_logprobs,
            log_prob=logprobs,
            advantages=advantages,
            response_mask=mask.to(logprobs.dtype),
            loss_agg_mode=agg.mode,
            config=actor,
            rollout_is_weights=None if weights is None else weights.to(logprobs.dtype),
        )
        return value, {k.removeprefix("actor/"): float(v) for k, v in metrics.items()}

    loss.__name__ = f"{name}_loss"
    loss.__doc__ = summary
    POLICY_LOSSES.register(name, loss, options=options)
    return loss


ppo_clip_loss = _verl_loss(
    "ppo_clip",
    "vanilla",
    "PPO clipped surrogate with asymmetric clip (clip-higher) and dual clip (verl vanilla).",
)
gspo_loss = _verl_loss(
    "gspo",
    "gspo",
    "GSPO: clip the length-normalised sequence ratio (use small clip ratios, ~3e-4/4e-4). "
    "verl clamps the log sequence ratio at 10 (ratio e^10): past it the loss of a "
    "negative advantage is capped and its gradient is 0. Rollout-correction weights "
    "multiply each token's loss term, so token-level weights weigh each token's gradient, "
    "not one weight per sequence (level: sequence or geometric gives one per row).",
)
cispo_loss = _verl_loss(
    "cispo",
    "cispo",
    "CISPO: REINFORCE weighted by the clipped, stop-gradient ratio; no token loses its gradient.",
)
sapo_loss = _verl_loss(
    "sapo",
    "sapo",
    "SAPO: a smooth sigmoid gate on the ratio instead of a hard clip (verl always aggregates "
    "it as seq-mean-token-mean, whatever agg.mode says).",
    SapoOptions,
)
clip_cov_loss = _verl_loss(
    "clip_cov",
    "clip_cov",
    "Clip-Cov: PPO clip plus cutting the gradient of a random few high-covariance tokens.",
    ClipCovOptions,
)
kl_cov_loss = _verl_loss(
    "kl_cov",
    "kl_cov",
    "KL-Cov: unclipped ratio loss plus a |log-ratio| penalty on the top-covariance tokens.",
    KlCovOptions,
)


def aggregate(loss_mat: Tensor, mask: Tensor, agg: AggInfo) -> Tensor:
    """Reduce a per-token loss (KL, entropy) to a scalar the same way the policy loss is."""
    return _verl().agg_loss(
        loss_mat=loss_mat,
        loss_mask=mask.to(loss_mat.dtype),
        loss_agg_mode=agg.mode,
        **_agg_kwargs(agg),
    )


# ------------------------------------------------------------------------ KL estimators


def _kl_estimator(name: str, about: str) -> Callable[[Tensor, Tensor], Tensor]:
    def estimator(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        return _verl().kl_penalty(logprobs, ref_logprobs, name)

    estimator.__name__ = estimator.__qualname__ = f"kl_{name.replace('+', '_st')}"
    estimator.__doc__ = f"Per-token KL(policy || reference) estimate: {about}."
    return estimator


for _name, _about in (
    ("k1", "log-ratio; unbiased value, high variance"),
    ("k2", "half squared log-ratio; its gradient is the unbiased KL gradient"),
    (
        "k3",
        "exp(-x) + x - 1 with x = log pi - log ref (Schulman's low-variance, non-negative "
        "estimator, unbiased before clamping); as verl, x is clamped to [-20, 20] and the "
        "value to at most 10, so a token past that (log ref - log pi above ~2.6 or below "
        "~-11) counts 10, biased low, and gets no gradient",
    ),
    ("low_var_kl", "alias of k3, with its clamps"),
    ("abs", "absolute log-ratio"),
    ("k1+", "k1 value with the k2 gradient (straight-through)"),
    ("k3+", "k3 value (clamped as k3) with the k2 gradient (straight-through, not clamped)"),
    ("low_var_kl+", "alias of k3+"),
):
    KL_ESTIMATORS.register(_name, _kl_estimator(_name, _about))
del _name, _about


# ------------------------------------------------------------------------------ entropy


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of softmax(logits) over the last dim, via logsumexp (no log(0))."""
    from verl.utils.torch_functional import entropy_from_logits as verl_entropy

    return verl_entropy(logits)


__all__ = [
    "LOSS_AGG_MODES",
    "AggInfo",
    "AlgorithmConfig",
    "aggregate",
    "cispo_loss",
    "clip_cov_loss",
    "drgrpo_advantage",
    "entropy_from_logits",
    "grpo_advantage",
    "grpo_passk_advantage",
    "gspo_loss",
    "kl_cov_loss",
    "outcome_token_rewards",
    "ppo_clip_loss",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "rloo_advantage",
    "sapo_loss",
]
