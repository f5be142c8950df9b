"""From played episodes to one rollout record.

Each completion of an ``act()`` is one row: the agent's policy, agent id, the completion's
prompt and sampled token segments (every per-token fact the engine recorded; an agent
that does not train keeps its tokens out of the loss), and group keys (prompt uid, agent
id, turn, node). Each joint action declared with ``ep.joint`` is one more row (policy
``"<joint>"``, never trained) whose response is the joint's final output and whose prompt
is the readable transcript: the recipe's reward terms score these rows, once per joint
action. Agent rows enter the record *pending* (not valid, no error)
so rewards skip them; the ``magrpo`` credit turns joint rewards into per-agent values and
advantages and makes them valid. An episode that raises has its error written on all its
rows, which leave the update and are counted. An agent row whose prompt carried images
holds them in the ``vision`` column (the object its policy's ``join_images`` made), which
the policy's log-prob pass reads; every other row holds None there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tensordict import TensorDict

from polyrl.core.record import Row, build_rows, set_strings
from polyrl.core.rollout.paint import merge_records
from polyrl.core.segment import Tokens
from polyrl.marl.api import AgentInfo, Episode, Joint
from polyrl.marl.critic import joint_state

JOINT_POLICY = "<joint>"  # the policy column of joint-action rows: no policy trains them
RESERVED_POLICY_NAMES = (JOINT_POLICY,)


def _transcript(joint: Joint) -> tuple[list[dict], str]:
    turns, lines = [], []
    for node in joint.path():
        for m in node.messages:
            turns.append(
                {"turn": node.turn, "agent": m.agent, "observation": m.observation, "text": m.text}
            )
            obs = m.observation.replace("\n", " / ")
            lines.append(f"[t{node.turn} {m.agent}] {obs} -> {m.text.strip()}")
    return turns, "\n".join(lines)


def build_record(
    episodes: list[Episode],
    agents: dict[str, AgentInfo],
    ids: Iterable[int],
    *,
    critic: bool = False,
) -> TensorDict:
    """One text record: joint-action rows first (for readable samples), then agent rows.

    A joint-action row (policy ``JOINT_POLICY``, ``agent_id`` -1, ``joint_id`` its id)
    carries in ``meta`` the structure the ``magrpo`` credit reads:

    - ``joint``: its id; ``parent``: the previous turn's joint id (0: a root), so returns
      flow up the episode tree; ``turn``: its depth;
    - ``episode``: the episode's index in the batch (counterfactuals compare joint actions
      of one episode only); ``scored``: false for a turn declared ``score=False``, whose
      reward counts as 0;

    and, for reading and for rewards: ``final`` (the scored text, also its response),
    ``transcript`` (every message on the path from the root, with turn, agent and
    observation), ``answer`` and ``row`` (the dataset row), ``info`` / ``episode_info``
    (what the workflow attached) and ``episode_error``.

    An agent row carries ``agent`` (its name), ``episode`` and ``joints`` (the ids of the
    joint actions its message is in: its value comes from their returns); with a critic
    (``critic=True``) also ``critic_state``, the joint-state text the critic values.

    Padding uses id 0 for every policy: pads sit under the masks, and 0 exists in every
    vocabulary (one record, no per-policy concatenation).
    """
    rows: list[Row] = []
    joint_ids: list[int] = []
    for ep in episodes:
        joints = ep.joints or ([Joint(next(ids), 0, None, [], "", {}, True)] if ep.error else [])
        for j in joints:
            turns, text = _transcript(j)
            joint_ids.append(j.id)
            rows.append(
                Row(
                    Tokens.given([]),
                    Tokens.given([]),
                    JOINT_POLICY,
                    ep.uid,
                    agent_id=-1,
                    turn=j.turn,
                    node=j.parent.id if (j.parent is not None and ep.tree) else 0,
                    prompt_text=text,
                    response_text=j.final,
                    meta={
                        "answer": ep.answer,
                        "row": ep.row,
                        "final": j.final,
                        "transcript": turns,
                        "joint": j.id,
                        "parent": j.parent.id if j.parent is not None else 0,
                        "turn": j.turn,
                        "episode": ep.index,
                        "scored": j.score,
                        "info": j.info,
                        "episode_info": ep.info,
                        "episode_error": bool(ep.error),
                        # the paintings of the joint action, for image rewards
                        **(
                            {"images": [m.to_pil() for m in pics]}
                            if (pics := [m for m in j.messages if m.painting is not None])
                            else {}
                        ),
                    },
                    error=ep.error,
                    pending=not ep.error and not j.score,
                )
            )
    groups: dict[tuple, int] = {}  # (episode, agent, Message.group) -> its node key (< 0)
    paintings: list[tuple] = []
    for ep in episodes:
        by_id = {j.id: j for j in ep.joints}
        for m in ep.messages:
            info = agents[m.agent]
            node = m.node
            if m.group is not None:
                node = groups.setdefault((ep.index, m.agent, m.group), -1 - len(groups))
            if m.painting is not None:
                paintings.append((ep, m, info, node))
                continue
            extra = {}
            if critic and m.joints:
                above = by_id[m.joints[0]].parent
                lines = _transcript(above)[1].split("\n") if above is not None else []
                extra["critic_state"] = joint_state(str(ep.task), lines, max(m.turn, 0), m.agent)
            err = ep.error or (
                "" if m.joints else f"agent {m.agent!r}: message is in no joint action (ep.joint)"
            )
            joint_ids.append(-1)
            rows.append(
                Row(
                    m.prompt,
                    m.tokens if info.train else m.tokens.masked(),
                    info.policy,
                    ep.uid,
                    agent_id=info.agent_id,
                    turn=max(m.turn, 0),
                    node=node,
                    prompt_text=m.prompt_text,
                    response_text=m.text,
                    meta={
                        "answer": ep.answer,
                        "agent": m.agent,
                        "episode": ep.index,
                        "joints": list(m.joints),
                        **extra,
                    },
                    truncated=m.finish_reason == "length",
                    vision=m.vision,
                    error=err,
                    pending=not err,  # the credit validates rows whose joints were scored
                )
            )
    if not rows:
        raise RuntimeError("the workflow produced no rows")
    rec = build_rows(rows, pad_id=0)
    rec["joint_id"] = torch.tensor(joint_ids, dtype=torch.long)
    if paintings:
        rec = merge_records([rec, painting_rows(paintings)])
    return rec


def painting_rows(paintings: list[tuple]) -> TensorDict:
    """The painters' rows: each painting's trajectory row (its policy kind's own layout,
    core.rollout.paint.Painting) with the team's group keys, policy, texts, meta and error; pending
    like every agent row until the credit values it. A frozen painter's steps train nothing
    (loss mask 0); a painting whose sampling failed carries its error."""
    rows = torch.cat([m.painting.trajectory for _, m, _, _ in paintings])
    b = rows.batch_size[0]
    errors = [
        ep.error
        or m.painting.error
        or ("" if m.joints else f"agent {m.agent!r}: painting is in no joint action (ep.joint)")
        for ep, m, _, _ in paintings
    ]
    train = torch.tensor([info.train for _, _, info, _ in paintings])
    rows["loss_mask"] = rows["loss_mask"] * train[:, None].long()
    rows["uid"] = torch.tensor([ep.uid for ep, _, _, _ in paintings], dtype=torch.long)
    rows["agent_id"] = torch.tensor([i.agent_id for _, _, i, _ in paintings], dtype=torch.long)
    rows["turn"] = torch.tensor([max(m.turn, 0) for _, m, _, _ in paintings], dtype=torch.long)
    rows["node"] = torch.tensor([node for _, _, _, node in paintings], dtype=torch.long)
    rows["reward"] = torch.full((b,), float("nan"))
    rows["valid"] = torch.zeros(b, dtype=torch.bool)  # pending, or failed
    rows["truncated"] = torch.zeros(b, dtype=torch.bool)
    rows["joint_id"] = torch.full((b,), -1, dtype=torch.long)
    set_strings(rows, "policy", [info.policy for _, _, info, _ in paintings])
    set_strings(rows, "prompt_text", [m.prompt_text for _, m, _, _ in paintings])
    set_strings(rows, "response_text", [f"<image of {m.text!r}>" for _, m, _, _ in paintings])
    set_strings(rows, "error", errors)
    meta = [
        {
            "answer": ep.answer,
            "agent": m.agent,
            "episode": ep.index,
            "joints": list(m.joints),
            "cut_tokens": m.painting.cut_tokens,
        }
        for ep, m, _, _ in paintings
    ]
    set_strings(rows, "meta", meta)
    return rows
