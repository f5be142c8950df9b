"""MAGRPO credit assignment: joint rewards -> per-agent values -> group advantages.

Registered in ``CREDIT`` as ``"magrpo"`` (``algorithm.credit: magrpo``). It reads only the
record a multi-agent workflow produced (see :mod:`polyrl.marl.record`):

- joint-action rows (``joint_id >= 0``) carry the reward of one joint action ``r_J``, the
  turn and the parent joint (``meta["parent"]``, 0 = root);
- agent rows (``joint_id == -1``) list the joint actions they belong to (``meta["joints"]``);
- with a centralized critic, the ``baseline`` column (the critic's values, written at
  rollout).

Its options are keyword arguments, from ``algorithm.credit_args`` (``cross_value``,
``per_agent_norm``, ``counterfactual``, ``shaping_alpha``); ``polyrl config`` lists them.

Steps:

1. **Tree returns.** ``R_J = r_J + gamma * mean(R_C over J's valid children C)`` bottom-up
   (``algorithm.gamma``). A joint declared with ``score=False`` has ``r_J = 0``.
2. **Values.** Aligned (one joint per completion): ``V = R_J``. Cross: ``V`` = mean (or sum)
   of ``R_J`` over the joint actions the completion is in.
   Counterfactual: ``V = mean_J (R_J - mean R over the joints where only this agent's action
   differs)``, used as the advantage directly (it is already a difference).
   MAPoRL-style shaping: ``V + alpha (V - Q)`` with ``Q`` the agent's counterfactual value
   (cross) or its group's mean return.
3. **Advantages.** The recipe's estimator (``algorithm.advantage``) within groups keyed by
   (prompt, agent, turn, node) -- from the group-key columns, never from row order:
   ``drgrpo`` = MAGRPO's mean baseline ``V - mean_G V``; ``grpo`` also divides by the std;
   ``rloo`` leaves the row out of its own baseline; ``max_baseline`` subtracts the group max.
   With a centralized critic (``rollout.args.critic``) the baseline is instead the critic's
   value of the joint state the agent acted in (the record's ``baseline`` column, present
   only then): ``A = V - baseline``; ``V`` goes to the ``returns`` column for the critic's
   fit.
4. Optional per-agent normalisation (mean 0, std 1 per agent id).

Agent rows become valid here when their joint actions were scored; a failed joint (reward
error, episode error) takes its rows out of the update with the error text.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Annotated, Literal

import torch
from tensordict import TensorDict

from polyrl.core.record import GROUP_KEYS, group_ids, mark_invalid, strings
from polyrl.core.registry import ADVANTAGES, CREDIT
from polyrl.core.train.credit import group_advantages, group_stats

MARL_CREDITS = ("magrpo",)


@ADVANTAGES.register("max_baseline")
def max_baseline_advantage(
    rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor, cfg
) -> torch.Tensor:
    """``r - max(r in its group)``: only the group's best samples escape a penalty."""
    r = rewards.float()
    best = torch.full((int(group.max()) + 1 if group.numel() else 0,), -math.inf)
    best = best.scatter_reduce(0, group, r, reduce="amax", include_self=True)
    return (r - best[group])[:, None] * (mask != 0).float()


def tree_returns(joints: dict[int, dict], gamma: float) -> dict[int, float]:
    """``R_J = r_J + gamma * mean(R_C)`` over valid children; joints without a valid child
    among existing children become invalid (``joints[j]["error"]`` is set)."""
    children: dict[int, list[int]] = defaultdict(list)
    for j, info in joints.items():
        children[info["parent"]].append(j)
    returns: dict[int, float] = {}
    for j in sorted(joints, key=lambda k: -joints[k]["turn"]):
        info = joints[j]
        if info["error"]:
            continue
        kids = children.get(j, [])
        good = [returns[c] for c in kids if c in returns]
        if kids and not good:
            info["error"] = "every continuation of this joint action failed"
            continue
        returns[j] = info["reward"] + (gamma * sum(good) / len(good) if good else 0.0)
    return returns


def magrpo_credit(
    record: TensorDict,
    algo,
    *,
    cross_value: Annotated[
        Literal["mean", "sum"],
        "cross mode: a completion's value is the mean or the sum of the returns of the "
        "joint actions it is in",
    ] = "mean",
    per_agent_norm: Annotated[
        bool, "normalise advantages to mean 0 / std 1 per agent id, over the batch"
    ] = False,
    counterfactual: Annotated[
        bool,
        "leave-one-out: an agent's advantage is R minus the mean return of the joint "
        "actions where only this agent acted differently (needs rollout.args.joint: cross)",
    ] = False,
    shaping_alpha: Annotated[
        float,
        "MAPoRL-style shaping V + alpha (V - Q), Q the agent's counterfactual value "
        "(cross) or its group's mean return; 0: off",
    ] = 0.0,
) -> dict[str, float]:
    """See the module docstring. Writes ``advantages``; agent rows' ``reward`` := value."""
    if "joint_id" not in record.keys():  # noqa: SIM118 (TensorDict)
        raise ValueError(
            "algorithm.credit=magrpo needs a multi-agent workflow's record "
            "(joint-action rows with joint_id); this record has none"
        )
    n = record.batch_size[0]
    jid = record["joint_id"].tolist()
    metas, errors = strings(record, "meta"), strings(record, "error")
    valid = record["valid"].clone()
    reward = record["reward"].clone().float()
    joint_rows = [i for i in range(n) if jid[i] >= 0]
    with_critic = "baseline" in record.keys()  # noqa: SIM118 (TensorDict)

    # 1. joint rewards and tree returns
    joints: dict[int, dict] = {}
    for i in joint_rows:
        m = metas[i]
        err = errors[i]
        r = float(reward[i])
        if not err and not m.get("scored", True):
            r = 0.0
        elif not err and not (bool(valid[i]) and math.isfinite(r)):
            err = "joint action was not scored"
        joints[jid[i]] = {
            "row": i,
            "parent": int(m.get("parent", 0)),
            "turn": int(m["turn"]),
            "reward": r,
            "error": err,
            "members": [],
        }
    returns = tree_returns(joints, float(algo.gamma))
    for info in joints.values():
        i = info["row"]
        if info["error"] and not errors[i]:
            errors[i] = info["error"]
        elif not info["error"] and not metas[i].get("scored", True):
            valid[i], reward[i] = True, 0.0

    # 2. per-row values
    agent_rows = [i for i in range(n) if jid[i] < 0]
    for i in agent_rows:
        for j in metas[i].get("joints", []):
            if j in joints:
                joints[j]["members"].append(i)
    agent_ids = record["agent_id"].tolist()
    values = torch.zeros(n)
    direct = torch.zeros(n, dtype=torch.bool)  # counterfactual values are advantages already
    new_errors: dict[int, str] = {}
    for i in agent_rows:
        if errors[i]:
            continue
        mine = [j for j in metas[i].get("joints", []) if j in joints]
        ok = [j for j in mine if j in returns]
        if not ok:
            bad = [joints[j]["error"] for j in mine if joints[j]["error"]]
            new_errors[i] = "joint action failed: " + (bad[0] if bad else "no joint action")
            continue
        rs = [returns[j] for j in ok]
        if counterfactual:
            diffs = [
                returns[j] - q
                for j in ok
                if (q := _counterfactual(j, i, agent_ids, joints, returns, metas)) is not None
            ]
            values[i] = sum(diffs) / len(diffs) if diffs else 0.0
            direct[i] = True
        elif cross_value == "sum":
            values[i] = sum(rs)
        else:
            values[i] = sum(rs) / len(rs)
    if new_errors:
        for i, e in new_errors.items():
            errors[i] = e
    for i in agent_rows:
        valid[i] = not errors[i]

    # 3. group advantages over valid agent rows
    mask = record["loss_mask"].float()
    adv = torch.zeros_like(mask)
    targets = torch.full((n,), float("nan"))  # the critic's regression targets
    rows = torch.tensor([i for i in agent_rows if valid[i]], dtype=torch.long)
    if rows.numel():
        sub = record[rows]
        groups = group_ids(sub, GROUP_KEYS)
        v = values[rows]
        alpha = float(shaping_alpha)
        if alpha and not bool(direct[rows].any()):
            q = group_stats(v, groups)[0].to(v.dtype)
            v = v + alpha * (v - q)
        if bool(direct[rows].all()):
            a = v[:, None] * (sub["loss_mask"] != 0).float()
        elif with_critic:
            a = (v - _baseline(record, rows))[:, None] * (sub["loss_mask"] != 0).float()
            targets[rows] = v
        else:
            a = ADVANTAGES.get(algo.advantage)(v, sub["loss_mask"].float(), groups, algo)
        if per_agent_norm:
            a = _per_agent_norm(a, sub["loss_mask"].float(), sub["agent_id"], float(algo.epsilon))
        adv[rows] = a.float()
        values_out = reward.clone()
        values_out[rows] = v
        reward = values_out

    # write back: rows invalid now carry their error; others become valid
    record["reward"] = reward
    record["advantages"] = adv
    if with_critic:
        record["returns"] = targets
    record["valid"] = valid
    current = strings(record, "error")
    bad = [i for i in range(n) if errors[i] and current[i] != errors[i]]
    if bad:
        mark_invalid(record, bad, [errors[i] for i in bad])

    # metrics
    ok_rows = rows.tolist() if rows.numel() else []
    # no valid row (every episode failed): nothing to average; a record whose rows are all
    # empty may have no token columns at all
    per_row = (
        (adv[ok_rows].sum(-1) / mask[ok_rows].sum(-1).clamp(min=1)) if ok_rows else adv.new_zeros(0)
    )
    scored = [j for j, info in joints.items() if not info["error"]]
    roots = [returns[j] for j in scored if joints[j]["turn"] == 0 and j in returns]
    out = {
        "advantage/mean_abs": float(per_row.abs().mean()) if ok_rows else 0.0,
        "advantage/zero_frac": float((per_row == 0).float().mean()) if ok_rows else 0.0,
        "marl/joint_actions": float(len(joints)),
        "marl/joint_errors": float(sum(bool(info["error"]) for info in joints.values())),
        "marl/return_mean": sum(roots) / len(roots) if roots else float("nan"),
        "marl/agent_rows_invalid": float(sum(1 for i in agent_rows if not valid[i])),
    }
    for a_id in sorted({agent_ids[i] for i in ok_rows}):
        idx = [i for i in ok_rows if agent_ids[i] == a_id]
        out[f"marl/agent{a_id}/value_mean"] = float(values[idx].mean())
    return out


def _counterfactual(
    j: int,
    row: int,
    agent_ids: list[int],
    joints: dict[int, dict],
    returns: dict[int, float],
    metas: list,
) -> float | None:
    """Mean return of the sibling joints where only ``row``'s agent acted differently."""
    me = agent_ids[row]
    info = joints[j]
    others = frozenset((agent_ids[r], r) for r in info["members"] if agent_ids[r] != me)
    alts = []
    for k, other in joints.items():
        if (
            k == j
            or k not in returns
            or other["parent"] != info["parent"]
            or other["turn"] != info["turn"]
        ):
            continue
        if metas[other["row"]].get("episode") != metas[info["row"]].get("episode"):
            continue
        rest = frozenset((agent_ids[r], r) for r in other["members"] if agent_ids[r] != me)
        mine = [r for r in other["members"] if agent_ids[r] == me]
        if rest == others and mine and row not in mine:
            alts.append(returns[k])
    return sum(alts) / len(alts) if alts else None


def _baseline(record: TensorDict, rows: torch.Tensor) -> torch.Tensor:
    """The critic's values of these agent rows' joint states (written at rollout)."""
    b = record["baseline"][rows].float()
    if not bool(torch.isfinite(b).all()):
        raise ValueError("the critic gave no finite baseline for some agent rows")
    return b


def _per_agent_norm(
    adv: torch.Tensor, mask: torch.Tensor, agent: torch.Tensor, eps: float
) -> torch.Tensor:
    """Row advantages standardised per agent id over the batch (an agent with one row
    keeps its advantage)."""
    row = adv.sum(-1) / mask.sum(-1).clamp(min=1)
    has = mask.sum(-1) > 0
    out = row.clone()
    if bool(has.any()):
        x = row[has].double()
        count = group_stats(x, agent[has])[2]
        norm = group_advantages(x, agent[has], epsilon=eps)
        out[has] = torch.where(count >= 2, norm, x).to(row.dtype)
    return out[:, None] * (mask != 0).float()


CREDIT.register("magrpo", magrpo_credit)
