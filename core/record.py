"""The one rollout record that flows from workflow to reward, credit and update.

A record is a ``tensordict.TensorDict`` with batch size ``[B]``: one row per trained
sample (one agent's turn, one episode, one denoising trajectory). Rewards, credit
assignment and the trainer read only this record.

Text rows carry (``P`` prompt length, ``R`` response length):

- ``prompt_ids [B,P]`` left-padded, ``prompt_mask [B,P]``
- ``response_ids [B,R]`` right-padded: the exact ids the engine sampled, plus any
  environment/tool/other-agent ids spliced in by a multi-turn workflow
- ``response_mask [B,R]``: real (non-pad) response tokens
- per-token facts, one column each, from the rows' token segments
  (:mod:`polyrl.core.segment`, which lists them): ``loss_mask [B,R]`` (tokens this row's
  policy generated, a subset of response_mask), ``rollout_logprobs [B,R]`` (the engine's
  log-probs, 0 elsewhere), and where recorded the weights version of each token
  (``rollout.partial``) and MoE routing (prompt and response), padded with the fact's default
- async mode: ``policy_version [B]``, the oldest weights version among the row's tokens
- group key parts ``uid`` (prompt), ``agent_id``, ``turn``, ``node`` (int64 ``[B]``)
- ``reward [B]`` (NaN until scored, or when scoring failed), ``valid [B]`` (bool)
- non-tensor ``policy``, ``prompt_text``, ``response_text``, ``error`` (str; "" = none),
  ``meta`` (dict with the dataset row's ground truth and anything a workflow adds)
- after credit: ``advantages [B,R]``

Diffusion rows carry their own tensors (latents, sigmas, per-step log-probs, prompt
embeddings) with the same group keys, reward, valid, policy and error fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from polyrl.core.segment import Tokens, padding, token_columns

GROUP_KEYS = ("uid", "agent_id", "turn", "node")
_PROMPT_FACTS, _RESPONSE_FACTS = padding()  # the token facts' columns (core/segment.py)
# per-response-token columns, with the value their padding takes
RESPONSE_COLUMNS = {"response_ids": 0, "response_mask": 0, "advantages": 0, **_RESPONSE_FACTS}
# per-prompt-token columns (left-padded), with the value their padding takes
PROMPT_COLUMNS = {"prompt_ids": 0, "prompt_mask": 0, **_PROMPT_FACTS}
NON_TENSOR_FIELDS = ("policy", "prompt_text", "response_text", "error", "meta")


def _stack_non_tensor(values: Sequence[Any]) -> NonTensorStack:
    """One non-tensor column. Rows with equal immutable values (a policy name, an empty
    error, a group's prompt text) share one ``NonTensorData``: building one costs ~10 us,
    which made record building a sixth of a tiny-model marl step."""
    shared: dict[Any, NonTensorData] = {}
    items = []
    for v in values:
        if isinstance(v, (str, int, float, bool, type(None))):
            key = (type(v), v)
            item = shared.get(key)
            if item is None:
                item = shared[key] = NonTensorData(v)
            items.append(item)
        else:
            items.append(NonTensorData(v))
    return NonTensorStack(*items)


def pad_left(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists to one tensor; returns (ids, mask)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def pad_tokens(t: torch.Tensor, before: int, after: int, value: float) -> torch.Tensor:
    """``t [B, T, ...]`` padded along its token dimension (dim 1)."""
    if not (before or after):
        return t
    pad = torch.full((t.shape[0], before + t.shape[1] + after, *t.shape[2:]), value, dtype=t.dtype)
    pad = pad.to(t.device)
    pad[:, before : before + t.shape[1]] = t
    return pad


def pad_right(rows: Sequence[Sequence[float]], pad: float, dtype: torch.dtype) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def text_record(
    *,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    rollout_logprobs: Sequence[Sequence[float]],
    policy: Sequence[str],
    uid: Sequence[int],
    pad_id: int,
    loss_mask: Sequence[Sequence[int]] | None = None,
    agent_id: Sequence[int] | None = None,
    turn: Sequence[int] | None = None,
    node: Sequence[int] | None = None,
    prompt_text: Sequence[str] | None = None,
    response_text: Sequence[str] | None = None,
    meta: Sequence[dict] | None = None,
    truncated: Sequence[bool] | None = None,
) -> TensorDict:
    """A text record from per-row id, log-prob and loss-mask lists (``loss_mask`` None:
    every response token is the policy's; a shorter mask leaves the rest out). Rows with
    more per-token facts are built from token segments (:func:`build_rows`)."""
    n = len(prompt_ids)
    for name, value in (
        ("response_ids", response_ids),
        ("rollout_logprobs", rollout_logprobs),
        ("policy", policy),
        ("uid", uid),
    ):
        if len(value) != n:
            raise ValueError(f"text_record: {name} has {len(value)} rows, prompt_ids has {n}")
    masks = loss_mask if loss_mask is not None else [[1] * len(r) for r in response_ids]
    if len(masks) != n or any(len(m) > len(r) for m, r in zip(masks, response_ids, strict=True)):
        raise ValueError("text_record: loss_mask must mark a subset of the response tokens")

    def column(values: Sequence[Any] | None, default: Callable[[], Any]) -> list[Any]:
        return list(values) if values else [default() for _ in range(n)]

    responses = [
        Tokens(list(r), list(lp), list(m) + [0] * (len(r) - len(m)))
        for r, lp, m in zip(response_ids, rollout_logprobs, masks, strict=True)
    ]
    columns: dict[str, list[Any]] = {
        "policy": list(policy),
        "uid": list(uid),
        "agent_id": column(agent_id, int),
        "turn": column(turn, int),
        "node": column(node, int),
        "prompt_text": column(prompt_text, str),
        "response_text": column(response_text, str),
        "meta": column(meta, dict),
        "truncated": column(truncated, bool),
    }
    if any(len(values) != n for values in columns.values()):
        raise ValueError(f"text_record: every per-row field must have {n} entries")
    rows = [
        Row(Tokens.given(p), r, **{name: values[k] for name, values in columns.items()})
        for k, (p, r) in enumerate(zip(prompt_ids, responses, strict=True))
    ]
    return _assemble(rows, pad_id)


def _assemble(rows: Sequence[Row], pad_id: int) -> TensorDict:
    """The record of ``rows``' prompt and response segments and their per-row fields."""
    n = len(rows)
    td = TensorDict(
        {
            **token_columns([r.prompt for r in rows], [r.response for r in rows], pad_id),
            "uid": torch.as_tensor([r.uid for r in rows], dtype=torch.long),
            "agent_id": torch.as_tensor([r.agent_id for r in rows], dtype=torch.long),
            "turn": torch.as_tensor([r.turn for r in rows], dtype=torch.long),
            "node": torch.as_tensor([r.node for r in rows], dtype=torch.long),
            "reward": torch.full((n,), float("nan")),
            "valid": torch.ones(n, dtype=torch.bool),
            "truncated": torch.as_tensor([r.truncated for r in rows], dtype=torch.bool),
        },
        batch_size=[n],
    )
    td["policy"] = _stack_non_tensor([r.policy for r in rows])
    td["prompt_text"] = _stack_non_tensor([r.prompt_text for r in rows])
    td["response_text"] = _stack_non_tensor([r.response_text for r in rows])
    td["error"] = _stack_non_tensor([""] * n)
    td["meta"] = _stack_non_tensor([r.meta for r in rows])
    return td


def strings(td: TensorDict, key: str) -> list:
    """A non-tensor column as a Python list."""
    value = td.get(key)
    if isinstance(value, NonTensorData):
        return [value.data] * td.batch_size[0]
    return list(value.tolist())


def set_strings(td: TensorDict, key: str, values: Sequence[Any]) -> None:
    if len(values) != td.batch_size[0]:
        raise ValueError(f"{key}: {len(values)} values for {td.batch_size[0]} rows")
    td[key] = _stack_non_tensor(list(values))


def shallow(td: TensorDict) -> TensorDict:
    """A new record sharing every column with ``td`` (set columns on it freely).

    ``TensorDict.clone(recurse=False)`` does the same but walks every non-tensor row
    (24 ms for 256 rows); ``select`` over all keys does not.
    """
    return td.select(*td.keys())


def to_device(td: TensorDict, device: torch.device | str) -> TensorDict:
    """``td`` with its tensors on ``device``: ``td`` itself when they already are.

    ``TensorDict.to`` rebuilds every non-tensor row even when nothing moves (35 ms for a
    256-row record, once per micro-batch), so the common CPU case skips it.
    """
    device = torch.device(device)
    tensors = [td.get(k) for k in td.keys()]  # noqa: SIM118 (TensorDict)
    if all(t.device == device for t in tensors if isinstance(t, torch.Tensor)):
        return td
    return td.to(device)


def group_ids(
    td: TensorDict, keys: Sequence[str] = ("uid", "agent_id", "turn", "node")
) -> torch.Tensor:
    """Dense group index per row from the group key parts (never from row order)."""
    parts = torch.stack([td[k] for k in keys], dim=1)
    return torch.unique(parts, dim=0, return_inverse=True)[1]


def select_policy(td: TensorDict, name: str) -> TensorDict:
    """Rows trained by policy ``name``, with padding trimmed to those rows (maybe none)."""
    if td.batch_size[0] == 0:
        return td
    keep = torch.tensor([p == name for p in strings(td, "policy")], dtype=torch.bool)
    return trim(take(td, keep))


def valid_rows(td: TensorDict) -> TensorDict:
    """The rows that take part in the update (``valid``), without a copy when all do."""
    return take(td, td["valid"])


def take(td: TensorDict, keep: torch.Tensor) -> TensorDict:
    """The rows of ``td`` where ``keep [B]`` (bool) is true: ``td`` itself when all are.

    An index list, not the mask: tensordict walks a mask once per row of every non-tensor
    column (35 ms against 6 ms for 336 rows and 7 such columns), but it cannot index those
    columns with an empty list, which only the mask does.
    """
    if bool(keep.all()):
        return td
    if not bool(keep.any()):
        return td[keep]
    return td[keep.nonzero().squeeze(1)]


def trim(td: TensorDict) -> TensorDict:
    """Drop all-padding columns (after selecting rows, prompts/responses may shrink)."""
    if "prompt_mask" not in td.keys() or td.batch_size[0] == 0:  # noqa: SIM118 (TensorDict)
        return td
    p_keep = int(td["prompt_mask"].sum(1).max())
    r_keep = int(td["response_mask"].sum(1).max())
    out = shallow(td)
    for key in PROMPT_COLUMNS:
        if key in td.keys():  # noqa: SIM118 (TensorDict)
            out[key] = td[key][:, td[key].shape[1] - p_keep :]
    for key in RESPONSE_COLUMNS:
        if key in td.keys():  # noqa: SIM118 (TensorDict)
            out[key] = td[key][:, :r_keep]
    return out


def concat(records: Sequence[TensorDict]) -> TensorDict:
    """Concatenate text records whose prompt/response widths may differ."""
    records = [r for r in records if r.batch_size[0] > 0]
    if not records:
        raise ValueError("concat: no rows")
    if len(records) == 1:
        return records[0]
    p = max(r["prompt_ids"].shape[1] for r in records)
    rl = max(r["response_ids"].shape[1] for r in records)
    fixed = []
    for r in records:
        r = shallow(r)
        dp, dr = p - r["prompt_ids"].shape[1], rl - r["response_ids"].shape[1]
        if dp:
            for key, pad in PROMPT_COLUMNS.items():  # ids' pad value is hidden by the mask
                if key in r.keys():  # noqa: SIM118 (TensorDict)
                    r[key] = pad_tokens(r[key], dp, 0, pad)
        if dr:
            for key, pad in RESPONSE_COLUMNS.items():
                if key in r.keys():  # noqa: SIM118 (TensorDict)
                    r[key] = pad_tokens(r[key], 0, dr, pad)
        fixed.append(r)
    return torch.cat(fixed)


def mark_invalid(td: TensorDict, rows: Sequence[int], errors: Sequence[str]) -> None:
    """Record errors on rows and leave them out of the update (never score them 0)."""
    errs = strings(td, "error")
    for i, e in zip(rows, errors, strict=True):
        errs[i] = e
        td["valid"][i] = False
    set_strings(td, "error", errs)


@dataclass
class Row:
    """One text row as a workflow collects it; :func:`build_rows` turns rows into the
    record (the columns of :func:`text_record`, each token fact's, plus ``vision``).

    ``prompt`` / ``response``: the row's token segments (:class:`~polyrl.core.segment.Tokens`):
    a completion's ``prompt`` and ``tokens``, or a trajectory joined from sampled segments
    and environment tokens; every fact they carry (loss mask, log-probs, weights
    versions, MoE routing) becomes its column. ``vision``: the row's joined images (the
    policy's log-prob pass reads them). ``error``: recorded on the row, which leaves the
    update (never scored 0). ``pending``: kept out of the update until a later part
    validates it (e.g. a credit that scores it).
    """

    prompt: Tokens
    response: Tokens
    policy: str
    uid: int
    agent_id: int = 0
    turn: int = 0
    node: int = 0
    prompt_text: str = ""
    response_text: str = ""
    meta: dict = field(default_factory=dict)
    truncated: bool = False
    vision: Any = None
    error: str = ""
    pending: bool = False


def build_rows(rows: Sequence[Row], pad_id: int) -> TensorDict:
    """The one record builder every text workflow uses: ``rows`` in order, padded with
    ``pad_id``; errors marked, pending rows not valid, images in ``vision``."""
    if not rows:
        raise ValueError("build_rows: no rows (a rollout must produce at least one)")
    record = _assemble(rows, pad_id)
    if any(r.vision is not None for r in rows):
        set_strings(record, "vision", [r.vision for r in rows])
    pending = [i for i, r in enumerate(rows) if r.pending]
    if pending:
        record["valid"][torch.tensor(pending)] = False
    failed = [i for i, r in enumerate(rows) if r.error]
    if failed:
        mark_invalid(record, failed, [rows[i].error for i in failed])
    return record
