"""The policy update: PPO-style epochs over a rollout, micro-batched with accumulation.

``update`` is the same for every policy kind: it asks the policy for log-probs of the
record's tokens and combines them with the registered loss. With one epoch and one
mini-batch the old log-probs are the detached current ones, so the first ratio is
exactly 1 and no extra forward pass is spent.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from polyrl.core.algorithms import AggInfo, AlgorithmConfig, aggregate
from polyrl.core.registry import KL_ESTIMATORS, POLICY_LOSSES


def _micro_batches(batch: TensorDict, size: int):
    for start in range(0, batch.batch_size[0], size):
        yield batch[start : start + size]


def _agg_info(batch: TensorDict, mode: str, scale: int | None = None) -> AggInfo:
    return AggInfo.for_minibatch(mode, batch["loss_mask"], loss_scale_factor=scale)


@torch.no_grad()
def _logprobs_no_grad(policy, batch: TensorDict, size: int, temperature: float) -> torch.Tensor:
    parts = [policy.logprobs(mb, temperature)[0] for mb in _micro_batches(batch, size)]
    return torch.cat(parts)


def _step(policy, stats: dict) -> None:
    """Clip, guard against non-finite gradients, step. A bad step leaves weights untouched."""
    params = [p for g in policy.optimizer.param_groups for p in g["params"]]
    max_norm = policy.cfg.optim.max_grad_norm
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if not torch.isfinite(norm):
        policy.optimizer.zero_grad(set_to_none=True)
        stats["skipped_nonfinite"] += 1
        return
    policy.optimizer.step()
    policy.scheduler.step()
    policy.optimizer.zero_grad(set_to_none=True)
    stats["grad_norm"].append(float(norm))


def update(policy, batch: TensorDict, algo: AlgorithmConfig, *, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> dict[str, float]:
    """RL update of one policy from its own rows (which carry ``advantages``)."""
    n = batch.batch_size[0]
    if n == 0 or policy.optimizer is None:
        return {}
    mb_size = policy.cfg.micro_batch_size
    loss_fn = POLICY_LOSSES.get(algo.policy_loss)
    reuse_old = algo.ppo_epochs == 1 and algo.minibatches == 1
    if not reuse_old:
        batch["old_logprobs"] = _logprobs_no_grad(policy, batch, mb_size, temperature)
    if algo.kl_coef > 0:
        batch["ref_logprobs"] = torch.cat(
            [policy.ref_logprobs(mb, temperature) for mb in _micro_batches(batch, mb_size)])
    kl_fn = KL_ESTIMATORS.get(algo.kl_estimator) if algo.kl_coef > 0 else None
    stats: dict = {"skipped_nonfinite": 0, "grad_norm": [], "loss": [], "kl": [], "entropy": []}
    extra: dict[str, list[float]] = {}
    policy.model.train(True)
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(n, generator=generator) if algo.minibatches > 1 else torch.arange(n)
        for mini in torch.tensor_split(order, algo.minibatches):
            mini_batch = batch[mini]
            agg = _agg_info(mini_batch, algo.loss_agg, algo.loss_scale_factor)
            for mb in _micro_batches(mini_batch, mb_size):
                mask = mb["loss_mask"].float()
                logp, ent = policy.logprobs(mb, temperature, with_entropy=algo.entropy_coef > 0)
                old = logp.detach() if reuse_old else mb["old_logprobs"]
                loss, metrics = loss_fn(logp, old, mb["advantages"], mask, algo, agg)
                if kl_fn is not None:
                    kl = aggregate(kl_fn(logp, mb["ref_logprobs"]), mask, agg)
                    loss = loss + algo.kl_coef * kl
                    stats["kl"].append(float(kl.detach()))
                if ent is not None:
                    ent_term = aggregate(ent, mask, agg)
                    loss = loss - algo.entropy_coef * ent_term
                    stats["entropy"].append(float(ent_term.detach()))
                loss.backward()
                stats["loss"].append(float(loss.detach()))
                for k, v in metrics.items():
                    extra.setdefault(k, []).append(float(v))
            _step(policy, stats)
    policy.model.train(False)
    out = {"loss": sum(stats["loss"]), "skipped_nonfinite": float(stats["skipped_nonfinite"]),
           "lr": policy.scheduler.get_last_lr()[0]}
    for key in ("grad_norm", "kl", "entropy"):
        if stats[key]:
            out[key] = sum(stats[key]) / len(stats[key])
    out.update({k: sum(v) / len(v) for k, v in extra.items()})
    return out


def sft_update(policy, batch: TensorDict) -> dict[str, float]:
    """Cross-entropy on the masked response tokens, through the same micro-batching."""
    agg = _agg_info(batch, "token-mean")
    stats: dict = {"skipped_nonfinite": 0, "grad_norm": []}
    total = 0.0
    policy.model.train(True)
    for mb in _micro_batches(batch, policy.cfg.micro_batch_size):
        logp, _ = policy.logprobs(mb)
        loss = aggregate(-logp, mb["loss_mask"].float(), agg)
        loss.backward()
        total += float(loss.detach())
    _step(policy, stats)
    policy.model.train(False)
    return {"sft_loss": total, "skipped_nonfinite": float(stats["skipped_nonfinite"])}
