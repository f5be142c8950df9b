"""The policy update: PPO-style epochs over a rollout, micro-batched with accumulation.

``update`` is the same for every policy kind: it asks the policy for log-probs of the
record's tokens and combines them with the registered loss. With one epoch and one
mini-batch the old log-probs are the detached current ones, so the first ratio is
exactly 1 and no extra forward pass is spent. The KL term uses the registered per-token
estimator on log-probs, unless the policy computes the recipe's estimator itself
(:class:`~polyrl.core.interfaces.OwnsKL`, e.g. from Gaussian means), in the same forward.

Micro-batches hold ``micro_batch_size`` rows, or, for a policy whose passes are packed
(:class:`~polyrl.core.interfaces.PacksRows`), up to a budget of real tokens, rows grouped
by length; rows whose shared prefix the pass computes once stay together and count it
once. Either way each micro-batch loss is divided by mini-batch totals, so the
gradient does not depend on how the rows are split.

Policies whose kind declares :class:`~polyrl.core.interfaces.UpdatesTogether` (LoRA
adapters on one base) may update together (:func:`update_together`, local only): the same
per-policy steps, but micro-batch ``k`` of every policy in one forward/backward.

Data parallelism (the Ray backend's FSDP2 worker groups) uses the same functions with
``dp=(rank, world)``: every rank receives the whole batch, draws the same mini-batches,
takes the loss totals (``AggInfo``) from the whole mini-batch and then computes only its
own share of the rows (under a token budget: shares balanced by tokens). Every rank runs
the same number of forward/backward passes (a rank short of rows runs a zero-weighted
pass), because FSDP's collectives need all ranks.
The returned metrics are this rank's; the single-process values are ``loss`` summed over
ranks and divided by ``world``, and ``kl`` (each optimizer step's mini-batch value) and
``entropy`` (mean per trained token of the rows this rank ran) averaged over ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from tensordict import TensorDict

from polyrl.core.interfaces import (
    KLEstimator,
    OwnsKL,
    PacksRows,
    Policy,
    RoutesExperts,
    UpdatesTogether,
)
from polyrl.core.observe.timeline import span
from polyrl.core.record import take, to_device
from polyrl.core.registry import KL_ESTIMATORS, POLICY_LOSSES
from polyrl.core.train.algorithms import AggInfo, AlgorithmConfig, aggregate
from polyrl.core.train.correction import Mismatch, RolloutCorrection, weights
from polyrl.core.train.passes import pack_rows
from polyrl.core.train.router_terms import RouterTerms


def _agg_info(
    batch: TensorDict, mode: str, scale: int | None = None, dp: tuple[int, int] | None = None
) -> AggInfo:
    agg = AggInfo.for_minibatch(mode, batch["loss_mask"], loss_scale_factor=scale)
    return dataclasses.replace(agg, dp_size=dp[1]) if dp else agg


def _micro_batch_rows(
    n: int, size: int, dp: tuple[int, int] | None, budget: tuple | None
) -> list[torch.Tensor | None]:
    """Row indices of this rank's micro-batches (None: a stand-in, weighted by zero).

    Row counts (``budget`` None): consecutive rows, ``size`` at a time; under ``dp`` each
    rank takes its contiguous share. Token budget (``(tokens per row, budget)``, packed
    passes, optionally ``units``: lists of rows that share a prefix and must run together,
    each row counting the tokens it adds to its unit): units (one per row without them)
    first go to ranks largest first, each to the rank with the fewest tokens so far, then
    each rank packs its units first-fit-decreasing into micro-batches of at most
    ``budget`` tokens. Every rank runs as many micro-batches as the busiest one, so the
    ranks with fewer get stand-ins.
    """
    if budget is None:
        if dp is None:
            return [torch.arange(lo, min(lo + size, n)) for lo in range(0, n, size)]
        rank, world = dp
        sizes = [len(share) for share in torch.tensor_split(torch.arange(n), world)]
        start = sum(sizes[:rank])
        count = math.ceil(sizes[0] / size)  # the first share is the largest
        return [
            torch.arange(start + k * size, start + min((k + 1) * size, sizes[rank]))
            if k * size < sizes[rank]
            else None
            for k in range(count)
        ]
    tokens, limit = budget[0], budget[1]
    units = budget[2] if len(budget) > 2 else [[i] for i in range(n)]
    lengths = [sum(int(tokens[i]) for i in unit) for unit in units]
    rank, world = dp or (0, 1)
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for u in sorted(range(len(units)), key=lambda u: -lengths[u]):
        r = min(range(world), key=load.__getitem__)
        shares[r].append(u)
        load[r] += lengths[u]
    plans = []
    for share in shares:
        unit_bin, _, bins, _ = pack_rows([lengths[u] for u in share], limit)
        members: list[list[int]] = [[] for _ in range(bins)]
        for u, b in zip(share, unit_bin, strict=True):
            members[b].extend(units[u])
        plans.append([torch.tensor(sorted(m)) for m in members])
    count = max(len(plan) for plan in plans)
    return plans[rank] + [None] * (count - len(plans[rank]))


def _rank_micro_batches(
    batch: TensorDict,
    size: int,
    dp: tuple[int, int] | None,
    budget: tuple | None = None,
) -> Iterator[tuple[TensorDict, bool]]:
    """(micro-batch, is_real) pairs of this rank's share of ``batch`` (see
    :func:`_micro_batch_rows`); a stand-in is the batch's first row, ``is_real`` False."""
    for rows in _micro_batch_rows(batch.batch_size[0], size, dp, budget):
        yield (batch[rows], True) if rows is not None else (batch[:1], False)


@torch.no_grad()
def _per_row(
    fn: Callable[[TensorDict], torch.Tensor],
    batch: TensorDict,
    size: int,
    dp: tuple[int, int] | None,
    budget: tuple | None = None,
) -> torch.Tensor:
    """``fn`` over every row of ``batch``, in row order; under ``dp`` each rank computes its
    share and the shares are gathered, so every rank ends with the whole result."""
    parts = []
    for rows in _micro_batch_rows(batch.batch_size[0], size, dp, budget):
        out = fn(batch[rows] if rows is not None else batch[:1])  # stand-ins run too:
        if rows is not None:  # the collectives inside need every rank
            parts.append((rows, out))
    if dp is not None:
        gathered: list = [None] * dp[1]
        torch.distributed.all_gather_object(gathered, parts)
        parts = [part for rank_parts in gathered for part in rank_parts]
    return _in_row_order(parts)


def _in_row_order(parts: list) -> torch.Tensor:
    """``(rows, per-row results)`` pairs covering every row once, as one tensor in row
    order."""
    rows = torch.cat([r for r, _ in parts])
    local = torch.cat([o for _, o in parts])
    if torch.equal(rows, torch.arange(len(rows))):
        return local
    return torch.empty_like(local).index_copy_(0, rows.to(local.device), local)


def _token_budget(policy: Policy) -> Callable[[TensorDict], tuple | None]:
    """``batch -> (tokens per row, budget) or None``: the policy's token budget when its
    passes are packed (:class:`~polyrl.core.interfaces.PacksRows`), else row counts."""
    if isinstance(policy, PacksRows):
        return policy.token_budget
    return lambda batch: None


def _rows_with_signal(batch: TensorDict) -> tuple[TensorDict, int]:
    """The rows with a nonzero advantage on a trained (loss-mask) token, and how many were
    left out. At least one row stays, so the optimizer still steps (on zero gradients) as it
    would on all rows."""
    signal = (batch["advantages"] != 0) & (batch["loss_mask"] != 0)
    keep = signal.reshape(batch.batch_size[0], -1).any(-1)
    if bool(keep.all()):
        return batch, 0
    keep[0] = keep[0] or not bool(keep.any())
    return take(batch, keep), int((~keep).sum())


def _step(policy: Policy, stats: dict) -> None:
    """Clip, guard against non-finite gradients, step. A bad step leaves weights untouched."""
    optimizer = policy.optimizer
    if optimizer is None:
        raise ValueError(f"policy {policy.name!r} is frozen (train: false): nothing to step")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    max_norm = policy.cfg.optim.max_grad_norm
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        stats["skipped_nonfinite"] += 1
        return
    optimizer.step()
    policy.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    stats["grad_norm"].append(float(norm))


@dataclasses.dataclass
class _Run:
    """One policy's update in progress: its prepared rows, what its loss needs and the
    statistics its metrics are made of (shared by :func:`update` and
    :func:`update_together`)."""

    policy: Policy
    batch: TensorDict
    algo: AlgorithmConfig
    temperature: float
    dp: tuple[int, int] | None
    reuse_old: bool
    owns_kl: bool
    kl_fn: KLEstimator | None  # the recipe's estimator; None: no KL term, or the policy's own
    corr: RolloutCorrection
    level: str
    want_entropy: bool
    mismatch: Mismatch = dataclasses.field(default_factory=Mismatch)
    stats: dict = dataclasses.field(
        default_factory=lambda: {
            "skipped_nonfinite": 0,
            "grad_norm": [],
            "loss": [],
            "kl": [],
            "rows_skipped": 0,
            "entropy_sum": 0.0,
            "entropy_tokens": 0.0,
        }
    )
    extra: dict = dataclasses.field(default_factory=dict)
    kl_sum: float = 0.0  # this mini-batch's: micro-batch terms sum to its value

    @property
    def n(self) -> int:
        return self.batch.batch_size[0]

    def micro_batches(self, mini_batch: TensorDict) -> Iterator[tuple[TensorDict, bool]]:
        """(micro-batch, is_real) pairs of a mini-batch, by the policy's own size or budget."""
        size = self.policy.cfg.micro_batch_size
        return _rank_micro_batches(
            mini_batch, size, self.dp, _token_budget(self.policy)(mini_batch)
        )


def _prepare(
    policy: Policy,
    batch: TensorDict,
    algo: AlgorithmConfig,
    temperature: float,
    dp: tuple[int, int] | None,
    correction: str | None,
    terms: dict[str, torch.Tensor] | None = None,
) -> _Run | None:
    """The rows on the policy's device with the old and reference terms the loss needs
    (see :func:`update`); None when there is nothing to update. ``terms``: those terms
    already computed (``old_logprobs``, ``ref_logprobs``: :func:`update_together`'s shared
    passes)."""
    n = batch.batch_size[0]
    if n == 0 or policy.optimizer is None:
        return None
    batch = to_device(batch, policy.device)  # losses mix log-probs with the record's tensors
    mb_size = policy.cfg.micro_batch_size
    reuse_old = algo.ppo_epochs == 1 and algo.minibatches == 1
    tokens = _token_budget(policy)
    terms = terms or {}
    if not reuse_old:
        batch["old_logprobs"] = terms.get("old_logprobs")
        if batch["old_logprobs"] is None:
            with span("old_logprobs", rows=n):
                batch["old_logprobs"] = _per_row(
                    lambda mb: policy.logprobs(mb, temperature)[0],
                    batch,
                    mb_size,
                    dp,
                    tokens(batch),
                )
    # a policy may compute the recipe's KL estimator itself (OwnsKL): the reference terms
    # it needs (e.g. means) are stored where ref_logprobs would be
    kl_policy = (
        policy
        if algo.kl_coef > 0
        and isinstance(policy, OwnsKL)
        and algo.kl_estimator in policy.kl_estimators
        else None
    )
    owns_kl = kl_policy is not None
    if kl_policy is not None:
        batch["ref_logprobs"] = _per_row(
            lambda mb: kl_policy.reference_terms(mb, temperature, algo.kl_estimator),
            batch,
            mb_size,
            dp,
            tokens(batch),
        )
    elif algo.kl_coef > 0 and "ref_logprobs" in terms:
        batch["ref_logprobs"] = terms["ref_logprobs"]
    elif algo.kl_coef > 0:
        with span("ref_logprobs", rows=n):
            batch["ref_logprobs"] = _per_row(
                lambda mb: policy.ref_logprobs(mb, temperature), batch, mb_size, dp, tokens(batch)
            )
    kl_fn = KL_ESTIMATORS.get(algo.kl_estimator) if algo.kl_coef > 0 and not owns_kl else None
    corr = algo.rollout_correction
    level = correction or corr.resolved(exact_engines=True)
    run = _Run(
        policy,
        batch,
        algo,
        temperature,
        dp,
        reuse_old,
        owns_kl,
        kl_fn,
        corr,
        level,
        want_entropy=algo.entropy_coef > 0 or algo.log_entropy,
    )
    if not reuse_old:  # the proximal policy is the pre-update recompute: weigh rows once
        batch["is_weights"], dropped = weights(
            batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"], corr, level
        )
        run.mismatch.add(
            batch["old_logprobs"],
            batch["rollout_logprobs"],
            batch["loss_mask"],
            corr,
            level,
            dropped,
        )
    return run


def _orders(run: _Run, generator: torch.Generator | None) -> list[torch.Tensor]:
    """Each PPO epoch's row order (a shuffle only with several mini-batches)."""
    algo, n = run.algo, run.n
    return [
        torch.randperm(n, generator=generator) if algo.minibatches > 1 else torch.arange(n)
        for _ in range(algo.ppo_epochs)
    ]


def _mini_batch(run: _Run, rows: torch.Tensor) -> tuple[TensorDict, AggInfo]:
    """A mini-batch's rows and its loss totals (taken before rows without signal go)."""
    mini_batch = run.batch[rows]
    agg = _agg_info(mini_batch, run.algo.loss_agg, run.algo.loss_scale_factor, run.dp)
    if run.algo.skips_zero_advantage():  # after the totals: they still count every row
        mini_batch, skipped = _rows_with_signal(mini_batch)
        run.stats["rows_skipped"] += skipped
    run.kl_sum = 0.0
    return mini_batch, agg


def _forward(
    run: _Run, mb: TensorDict
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, RouterTerms | None]:
    """(log-probs, entropy, KL terms or None, the pass's routing or None) of a micro-batch
    through the policy alone."""
    policy, algo = run.policy, run.algo
    if run.owns_kl:
        assert isinstance(policy, OwnsKL)  # run.owns_kl says so
        return (
            *policy.logprobs_and_kl(
                mb,
                run.temperature,
                with_entropy=run.want_entropy,
                estimator=algo.kl_estimator,
                reference=mb["ref_logprobs"],
            ),
            None,
        )
    if isinstance(policy, RoutesExperts):  # MoE: the pass hands back its routing
        out = policy.routed_logprobs(mb, run.temperature, with_entropy=run.want_entropy)
        return out.logprobs, out.entropy, None, out.router
    logp, ent = policy.logprobs(mb, run.temperature, with_entropy=run.want_entropy)
    return logp, ent, None, None


def _micro_loss(
    run: _Run,
    mb: TensorDict,
    real: bool,
    agg: AggInfo,
    logp: torch.Tensor,
    ent: torch.Tensor | None,
    kl_tokens: torch.Tensor | None,
    router: RouterTerms | None = None,
) -> torch.Tensor:
    """A micro-batch's loss from its log-probs, divided by the mini-batch totals ``agg``;
    a real micro-batch's metrics are recorded (a stand-in's are not). ``router``: the
    routing of the pass that gave ``logp`` (MoE), for the load-balancing loss."""
    algo, corr, level, stats = run.algo, run.corr, run.level, run.stats
    mask = mb["loss_mask"].float()
    if ent is not None and algo.entropy_coef == 0:
        ent = ent.detach()  # metric only: free its softmax before the backward
    old = logp.detach() if run.reuse_old else mb["old_logprobs"]
    if run.reuse_old:
        w, dropped = weights(old, mb["rollout_logprobs"], mask, corr, level)
        if real:
            run.mismatch.add(old, mb["rollout_logprobs"], mask, corr, level, dropped)
    else:
        w = mb["is_weights"]
    extra_args = {"weights": w} if corr.active(level) else {}
    loss_fn = POLICY_LOSSES.get(algo.policy_loss)
    loss, metrics = loss_fn(logp, old, mb["advantages"], mask, algo, agg, **extra_args)
    if run.kl_fn is not None:
        kl_tokens = run.kl_fn(logp, mb["ref_logprobs"])
    if kl_tokens is not None:
        kl = aggregate(kl_tokens, mask, agg)
        loss = loss + algo.kl_coef * kl
        run.kl_sum += float(kl.detach()) if real else 0.0
    if ent is not None and algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate(ent, mask, agg)
    if router is not None and isinstance(run.policy, RoutesExperts):  # MoE: load balancing
        loss = loss + run.policy.router_loss(router, mb, agg, run.extra if real else {})
    if ent is not None and real:  # a metric: the mean over trained tokens
        stats["entropy_sum"] += float((ent.detach() * mask).sum())
        stats["entropy_tokens"] += float(mask.sum())
    if real:
        stats["loss"].append(float(loss.detach()))
        for k, v in metrics.items():
            run.extra.setdefault(k, []).append(float(v))
    return loss


def _end_mini_batch(run: _Run) -> None:
    if run.algo.kl_coef > 0:
        run.stats["kl"].append(run.kl_sum)
    _step(run.policy, run.stats)


def _metrics(run: _Run) -> dict[str, float]:
    stats, algo = run.stats, run.algo
    out = {
        "loss": sum(stats["loss"]),
        "skipped_nonfinite": float(stats["skipped_nonfinite"]),
        "lr": run.policy.scheduler.get_last_lr()[0],
    }
    if algo.skips_zero_advantage():
        out["zero_adv_skipped_frac"] = stats["rows_skipped"] / (run.n * algo.ppo_epochs)
    for key in ("grad_norm", "kl"):
        if stats[key]:
            out[key] = sum(stats[key]) / len(stats[key])
    if stats["entropy_tokens"] > 0:
        out["entropy"] = stats["entropy_sum"] / stats["entropy_tokens"]
    out.update({k: sum(v) / len(v) for k, v in run.extra.items()})
    return out | run.mismatch.metrics()


def update(
    policy: Policy,
    batch: TensorDict,
    algo: AlgorithmConfig,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    dp: tuple[int, int] | None = None,
    correction: str | None = None,
) -> dict[str, float]:
    """RL update of one policy from its own rows (which carry ``advantages``).

    ``dp=(rank, world)``: this process is one rank of a data-parallel (FSDP) group and
    ``batch`` is the whole batch, the same on every rank (see the module docstring).
    ``correction``: the rollout-correction level in force (``algorithm.rollout_correction``
    resolved for the run's engines; None: ``auto`` read as exact engines, no staleness).
    The engine/trainer mismatch metrics are reported whatever the level.
    """
    run = _prepare(policy, batch, algo, temperature, dp, correction)
    if run is None:
        return {}
    policy.model.train(True)
    for order in _orders(run, generator):
        for mini in torch.tensor_split(order, algo.minibatches):
            mini_batch, agg = _mini_batch(run, mini)
            for mb, real in run.micro_batches(mini_batch):
                with span("micro_batch", rows=mb.batch_size[0], real=real):
                    loss = _micro_loss(run, mb, real, agg, *_forward(run, mb))
                    # a stand-in pass keeps FSDP's collectives in step; no gradient
                    (loss if real else loss * 0.0).backward()
            with span("optimizer_step"):
                _end_mini_batch(run)
    policy.model.train(False)
    return _metrics(run)


def update_together(
    policies: Sequence[Policy],
    batches: list[TensorDict],
    algo: AlgorithmConfig,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    correction: str | None = None,
) -> list[dict[str, float]]:
    """:func:`update` of several policies that share one forward/backward per micro-batch
    (:class:`~polyrl.core.interfaces.UpdatesTogether`, equal ``update_group()``; local).

    Each policy keeps what its own update does: its rows' old and reference terms, its
    mini-batch partition (the shuffles drawn from ``generator`` in the order the one-by-one
    updates draw them), its micro-batches (size or token budget), its loss totals, its
    optimizer step with its own clipping and learning rate, and its metrics. Only the
    passes merge: micro-batch ``k`` of every policy runs as one forward
    (``logprobs_together``), the losses are summed and take one backward -- each policy's
    weights get exactly the gradient of its own loss, as the one-by-one update computes it.
    The old log-probs (several epochs or mini-batches) and the reference log-probs (KL)
    come from shared passes too (:func:`_terms_together`). Returns each policy's metrics,
    in order.
    """
    terms: list[dict] = [{} for _ in policies]
    trained = [
        i
        for i, (p, b) in enumerate(zip(policies, batches, strict=True))
        if b.batch_size[0] and p.optimizer is not None
    ]
    first = policies[trained[0]] if trained else None
    if first is not None and not isinstance(first, OwnsKL):
        if not isinstance(first, UpdatesTogether):
            raise ValueError(f"update_together: policy {first.name!r} is not UpdatesTogether")
        some = ([policies[i] for i in trained], [batches[i] for i in trained])
        wanted = {}
        if not (algo.ppo_epochs == 1 and algo.minibatches == 1):
            wanted["old_logprobs"] = lambda ps, bs: [
                lp for lp, _ in first.logprobs_together(ps, bs, temperature)
            ]
        if algo.kl_coef > 0:
            wanted["ref_logprobs"] = lambda ps, bs: first.ref_logprobs_together(ps, bs, temperature)
        for key, fn in wanted.items():
            with torch.no_grad():
                for i, out in zip(trained, _terms_together(*some, fn), strict=True):
                    terms[i][key] = out
    runs = [
        _prepare(p, b, algo, temperature, None, correction, t)
        for p, b, t in zip(policies, batches, terms, strict=True)
    ]
    live = [r for r in runs if r is not None]
    if any(r.owns_kl for r in live):  # its KL comes from its own forward (logprobs_and_kl)
        raise ValueError(
            "update_together: a policy computing its own KL (OwnsKL) cannot share passes; "
            "its kind must not declare UpdatesTogether"
        )
    orders = {id(r): _orders(r, generator) for r in live}  # drawn as one-by-one would
    if live:
        live[0].policy.model.train(True)  # one shared model
    for epoch in range(algo.ppo_epochs):
        parts = [torch.tensor_split(orders[id(r)][epoch], algo.minibatches) for r in live]
        for m in range(algo.minibatches):
            plans = []
            for r, part in zip(live, parts, strict=True):
                mini_batch, agg = _mini_batch(r, part[m])
                plans.append((r, agg, [mb for mb, _ in r.micro_batches(mini_batch)]))
            for k in range(max((len(mbs) for _, _, mbs in plans), default=0)):
                group = [(r, agg, mbs[k]) for r, agg, mbs in plans if k < len(mbs)]
                lead = group[0][0].policy
                if not isinstance(lead, UpdatesTogether):
                    raise ValueError(
                        f"update_together: policy {lead.name!r} is not UpdatesTogether"
                    )
                outs = lead.logprobs_together(
                    [r.policy for r, _, _ in group],
                    [mb for _, _, mb in group],
                    temperature,
                    with_entropy=group[0][0].want_entropy,
                )
                with span("micro_batch", policies=len(group)):
                    losses = [
                        _micro_loss(r, mb, True, agg, logp, ent, None)
                        for (r, agg, mb), (logp, ent) in zip(group, outs, strict=True)
                    ]
                    torch.stack(losses).sum().backward()
            with span("optimizer_step", policies=len(live)):
                for r in live:
                    _end_mini_batch(r)
    if live:
        live[0].policy.model.train(False)
    return [_metrics(r) if r is not None else {} for r in runs]


def _terms_together(
    policies: Sequence[Policy],
    batches: Sequence[TensorDict],
    fn: Callable[[list[Policy], list[TensorDict]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Per-row terms of every policy's rows (as :func:`_per_row` computes them for each
    alone: its own micro-batches, by size or token budget) with micro-batch ``k`` of every
    policy in ONE call ``fn(policies, micro_batches) -> [per-row tensor]``."""
    plans = [
        _micro_batch_rows(b.batch_size[0], p.cfg.micro_batch_size, None, _token_budget(p)(b))
        for p, b in zip(policies, batches, strict=True)
    ]
    parts: list[list] = [[] for _ in policies]
    for k in range(max(len(plan) for plan in plans)):
        now = [i for i, plan in enumerate(plans) if k < len(plan)]
        picks = [cast("torch.Tensor", plans[i][k]) for i in now]
        outs = fn(
            [policies[i] for i in now], [batches[i][r] for i, r in zip(now, picks, strict=True)]
        )
        for i, r, out in zip(now, picks, outs, strict=True):
            parts[i].append((r, out))
    return [_in_row_order(got) for got in parts]


def sft_update(
    policy: Policy, batch: TensorDict, dp: tuple[int, int] | None = None
) -> dict[str, float]:
    """Cross-entropy on the masked response tokens, through the same micro-batching."""
    batch = to_device(batch, policy.device)
    agg = _agg_info(batch, "token-mean", dp=dp)
    stats: dict = {"skipped_nonfinite": 0, "grad_norm": []}
    total = 0.0
    policy.model.train(True)
    tokens = _token_budget(policy)(batch)
    for mb, real in _rank_micro_batches(batch, policy.cfg.micro_batch_size, dp, tokens):
        logp, _ = policy.logprobs(mb)
        loss = aggregate(-logp, mb["loss_mask"].float(), agg)
        (loss if real else loss * 0.0).backward()
        total += float(loss.detach()) if real else 0.0
    _step(policy, stats)
    policy.model.train(False)
    return {"sft_loss": total, "skipped_nonfinite": float(stats["skipped_nonfinite"])}
