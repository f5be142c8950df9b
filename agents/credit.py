"""Credit for multi-turn episodes: episode-level GRPO, discounted turn returns, GiGPO.

All three read the rows the multi-turn workflow writes (either layout): ``reward`` (the
scored episode reward), ``uid`` (the task) and ``meta`` (episode id, per-turn env rewards
``turn_rewards``, anchor observations ``anchors`` and each turn's token ``spans`` in the
response). They write per-token ``advantages``: every token of turn ``t`` gets that turn's
advantage, environment tokens and invalid rows get 0.

- ``episode_grpo``: A = A_episode, the recipe's advantage estimator (``algorithm.advantage``,
  e.g. grpo) over the episode rewards of each task's group of episodes. On ``concat`` rows
  this equals the core's ``group`` credit; on ``step`` rows it gives every turn of an
  episode its episode's advantage.
- ``turn_return``: A_t = the discounted return-to-go G_t = sum_k gamma^k r_(t+k)
  (``algorithm.gamma``) normalised over all steps of the task's episodes.
- ``gigpo`` (Feng et al., 2025, arXiv 2505.10978): A_t = A_episode + omega * A_step, where
  A_step normalises G_t within the *step group* of steps -- from any episode of the same
  task -- whose anchor observation is identical. ``omega`` is its option
  (``algorithm.credit_args: {omega: 0.5}``; default 1).

The discount, the std division and its epsilon are the recipe's ``algorithm.gamma``,
``algorithm.norm_adv_by_std`` and ``algorithm.epsilon`` (shared with the advantage
estimators). Normalisation of step groups: (G - mean) / (std + eps) with the unbiased std
(``norm_adv_by_std: false`` drops the division, as Dr.GRPO does); a group of one step gets
0, since it has no baseline, and so does a group of equal returns. Group statistics come
from :func:`polyrl.core.train.credit.group_advantages`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated

import torch
from tensordict import TensorDict

from polyrl.core.record import strings
from polyrl.core.registry import ADVANTAGES, CREDIT
from polyrl.core.train.credit import group_advantages


@dataclass
class Step:
    row: int
    start: int
    end: int
    episode: int
    turn: int
    uid: int
    anchor: str
    ret: float  # discounted return-to-go from this turn


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_(t+1), computed backwards."""
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def _steps(record: TensorDict, gamma: float) -> tuple[list[Step], dict[int, tuple[int, float]]]:
    """Every trained step of the valid rows, and each episode's (uid, reward)."""
    metas = strings(record, "meta")
    valid = record["valid"].tolist()
    uids = record["uid"].tolist()
    reward = record["reward"].tolist()
    steps: list[Step] = []
    episode_rewards: dict[int, list[float]] = defaultdict(list)
    episode_uid: dict[int, int] = {}
    returns_cache: dict[int, list[float]] = {}
    for i, meta in enumerate(metas):
        if not valid[i]:
            continue
        if not isinstance(meta, dict) or "episode" not in meta or "spans" not in meta:
            raise ValueError(
                f"row {i} has no multi-turn meta (episode, spans); the episode-"
                "level credits need rows from the multi_turn workflow"
            )
        e = int(meta["episode"])
        episode_uid[e] = uids[i]
        episode_rewards[e].append(float(reward[i]))
        if e not in returns_cache:
            returns_cache[e] = discounted_returns(meta["turn_rewards"], gamma)
        rets = returns_cache[e]
        for t, start, end in meta["spans"]:
            steps.append(
                Step(
                    i,
                    start,
                    end,
                    e,
                    t,
                    uids[i],
                    str(meta["anchors"][t]),
                    rets[t] if t < len(rets) else 0.0,
                )
            )
    episodes = {e: (episode_uid[e], sum(r) / len(r)) for e, r in episode_rewards.items()}
    return steps, episodes


def _grouped(keys: list, values: list[float], norm_by_std: bool, eps: float) -> list[float]:
    """Each value centred on its group's mean (and divided by its std + ``eps``); a group of
    one value, or of equal values, gets 0 (:func:`polyrl.core.train.credit.group_advantages`)."""
    if not values:
        return []
    index: dict = {}
    groups = torch.tensor([index.setdefault(k, len(index)) for k in keys])
    v = torch.tensor(values, dtype=torch.float64)
    return group_advantages(v, groups, norm_by_std=norm_by_std, epsilon=eps).tolist()


def episode_advantages(episodes: dict[int, tuple[int, float]], algo) -> dict[int, float]:
    """A_episode per episode: the recipe's estimator over each task's episode rewards."""
    if not episodes:
        return {}
    ids = sorted(episodes)
    rewards = torch.tensor([episodes[e][1] for e in ids], dtype=torch.float32)
    uid_index = {u: k for k, u in enumerate(sorted({episodes[e][0] for e in ids}))}
    groups = torch.tensor([uid_index[episodes[e][0]] for e in ids], dtype=torch.long)
    mask = torch.ones((len(ids), 1))
    adv = ADVANTAGES.get(algo.advantage)(rewards, mask, groups, algo)[:, 0]
    return dict(zip(ids, adv.tolist(), strict=True))


def _write(record: TensorDict, steps: list[Step], values: list[float]) -> torch.Tensor:
    mask = record["loss_mask"].float()
    adv = torch.zeros_like(mask)
    for s, a in zip(steps, values, strict=True):
        adv[s.row, s.start : s.end] = a
    adv = adv * mask
    adv[~record["valid"]] = 0.0
    record["advantages"] = adv
    return adv


def _metrics(record: TensorDict, adv: torch.Tensor) -> dict[str, float]:
    """Advantage summary plus episode statistics (success, return, turns, truncation, errors)."""
    mask = record["loss_mask"].float()
    valid = record["valid"]
    rows = adv[valid].sum(-1) / mask[valid].sum(-1).clamp(min=1)
    out = {
        "advantage/mean_abs": float(rows.abs().mean()) if rows.numel() else 0.0,
        "advantage/zero_frac": float((rows == 0).float().mean()) if rows.numel() else 0.0,
    }
    seen: dict[int, tuple[dict, bool, bool]] = {}
    truncated = record["truncated"].tolist()
    for i, meta in enumerate(strings(record, "meta")):
        if isinstance(meta, dict) and "episode" in meta:
            seen.setdefault(int(meta["episode"]), (meta, bool(valid[i]), truncated[i]))
    ok = [(m, t) for m, v, t in seen.values() if v]
    if seen:
        out["episode/count"] = float(len(seen))
        out["episode/errors"] = float(len(seen) - len(ok))
    if ok:
        out["episode/success"] = sum(float(m["success"]) for m, _ in ok) / len(ok)
        out["episode/return"] = sum(float(m["return"]) for m, _ in ok) / len(ok)
        out["episode/turns"] = sum(float(m["turns"]) for m, _ in ok) / len(ok)
        out["episode/truncated_frac"] = sum(float(t) for _, t in ok) / len(ok)
    return out


def episode_grpo(record: TensorDict, algo) -> dict[str, float]:
    """Every turn of an episode gets its episode's advantage (A_episode)."""
    steps, episodes = _steps(record, float(algo.gamma))
    a_ep = episode_advantages(episodes, algo)
    adv = _write(record, steps, [a_ep[s.episode] for s in steps])
    return _metrics(record, adv)


def turn_return(record: TensorDict, algo) -> dict[str, float]:
    """Discounted return-to-go of each turn, normalised over all steps of the same task."""
    steps, _ = _steps(record, float(algo.gamma))
    values = _grouped(
        [s.uid for s in steps],
        [s.ret for s in steps],
        bool(algo.norm_adv_by_std),
        float(algo.epsilon),
    )
    adv = _write(record, steps, values)
    return _metrics(record, adv)


def step_groups(steps: list[Step]) -> dict[tuple[int, str], list[int]]:
    """GiGPO step groups: indices of steps sharing a task and an identical anchor."""
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for k, s in enumerate(steps):
        groups[(s.uid, s.anchor)].append(k)
    return dict(groups)


def gigpo(
    record: TensorDict,
    algo,
    *,
    omega: Annotated[
        float, "weight of the step-level advantage: A = A_episode + omega * A_step"
    ] = 1.0,
) -> dict[str, float]:
    """GiGPO: each turn gets its episode's advantage plus ``omega`` times its step-group one."""
    steps, episodes = _steps(record, float(algo.gamma))
    a_ep = episode_advantages(episodes, algo)
    a_step = _grouped(
        [(s.uid, s.anchor) for s in steps],
        [s.ret for s in steps],
        bool(algo.norm_adv_by_std),
        float(algo.epsilon),
    )
    adv = _write(
        record, steps, [a_ep[s.episode] + omega * a for s, a in zip(steps, a_step, strict=True)]
    )
    metrics = _metrics(record, adv)
    sizes = [len(g) for g in step_groups(steps).values()]
    if sizes:
        metrics["gigpo/step_groups"] = float(len(sizes))
        metrics["gigpo/mean_group_size"] = sum(sizes) / len(sizes)
        metrics["gigpo/singleton_frac"] = sum(1 for n in sizes if n == 1) / len(sizes)
    return metrics


CREDIT.register("episode_grpo", episode_grpo)
CREDIT.register("turn_return", turn_return)
CREDIT.register("gigpo", gigpo)
