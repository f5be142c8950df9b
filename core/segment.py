"""One token segment: every per-token fact a row carries, sliced and joined as one.

An engine returns the tokens it sampled as a :class:`Tokens` (and the prompt it was given
as another, holding what its prefill recorded); a workflow builds a row by joining
segments: sampled ones as they came, environment, tool and other agents' tokens as
:meth:`Tokens.given`; the record builder (``core/record.py``) turns each fact into its
column. Nothing between the engine and the record names a fact, so a new per-token fact
is a field here (with its default and column) and the engine that records it.

Facts of ``n`` tokens (every one but ``ids`` may be None: then every token holds the
fact's default, at no cost; joined with a segment that has it, the default is written):

- ``ids``: list[int] [n]
- ``logprobs``: list[float] [n], the engine's log-prob of each sampled token (default 0.0)
  -> record ``rollout_logprobs``
- ``mask``: list[int] [n], 1 where the row's policy trains on the token, the tokens it
  sampled (default 0: prompt, environment, another agent's) -> ``loss_mask``
- ``versions``: list[int] [n], the weights version that sampled each token under
  ``rollout.partial`` (default -1: not sampled) -> ``token_version``
- ``top``: list of (ids, log-probs) [n], each sampled token's k likeliest alternatives
  (``SamplingParams.top_logprobs``; default ``([], [])``); not a record column
- ``experts``: int8/int16 tensor [n, L, k], the experts each token was routed to in the L
  MoE layers (default -1: not recorded; ``core/train/moe.py``) -> ``prompt_experts`` /
  ``response_experts``
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Fact:
    """How a per-token fact is padded and recorded: ``default`` for a token without it;
    ``prompt`` / ``response``: its record columns (None: none); ``always``: the response
    column exists even when no row has the fact; ``dtype``: a list fact's column dtype
    (a tensor fact keeps its own)."""

    default: Any
    prompt: str | None = None
    response: str | None = None
    always: bool = False
    dtype: torch.dtype | None = None


def _fact(default: Any, **how: Any) -> Any:
    return field(default=None, metadata={"fact": Fact(default, **how)})


@dataclass(frozen=True, eq=False)
class Tokens:
    """``n`` tokens and what is known of each (the module docstring lists the facts)."""

    ids: list[int]
    logprobs: list[float] | None = _fact(0.0, response="rollout_logprobs", always=True)
    mask: list[int] | None = _fact(0, response="loss_mask", always=True, dtype=torch.long)
    versions: list[int] | None = _fact(-1, response="token_version", dtype=torch.long)
    top: list[tuple[list[int], list[float]]] | None = _fact(([], []))
    experts: torch.Tensor | None = _fact(-1, prompt="prompt_experts", response="response_experts")

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name, _ in FACTS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Tokens: {name} has {len(value)} entries for {n} ids")

    @classmethod
    def sampled(cls, ids: list[int], logprobs: list[float], **facts: Any) -> Tokens:
        """Tokens a policy sampled: in its loss (``mask`` 1), with the engine's facts."""
        return cls(ids, logprobs, [1] * len(ids), **facts)

    @classmethod
    def given(cls, ids: Sequence[int], **facts: Any) -> Tokens:
        """Tokens no policy of the row sampled (a prompt, an environment's reply, another
        agent's turn): every fact at its default unless given (a prompt's routing)."""
        return cls(list(ids), **facts)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, where: slice) -> Tokens:
        if not isinstance(where, slice) or where.step not in (None, 1):
            raise TypeError(f"Tokens take contiguous slices only, got {where!r}")
        return Tokens(
            self.ids[where],
            **{name: None if (v := getattr(self, name)) is None else v[where] for name, _ in FACTS},
        )

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens.cat([self, other])

    @staticmethod
    def cat(parts: Sequence[Tokens]) -> Tokens:
        """The parts one after the other; a fact some parts lack takes its default there
        (None when no part has it)."""
        if len(parts) == 1:
            return parts[0]
        ids = [t for p in parts for t in p.ids]
        facts: dict[str, Any] = {}
        for name, fact in FACTS:
            values = [getattr(p, name) for p in parts]
            known = [v for v in values if v is not None]
            if not known:
                facts[name] = None
            elif isinstance(known[0], torch.Tensor):
                like = known[0]
                for v in known:
                    if v.shape[1:] != like.shape[1:]:
                        raise ValueError(
                            f"Tokens.cat: {name} of shape {tuple(v.shape[1:])} per token "
                            f"joined with {tuple(like.shape[1:])}"
                        )
                facts[name] = torch.cat(
                    [
                        v if v is not None else _full(len(p), like, fact.default)
                        for p, v in zip(parts, values, strict=True)
                    ]
                )
            else:
                facts[name] = [
                    x
                    for p, v in zip(parts, values, strict=True)
                    for x in (v if v is not None else [fact.default] * len(p))
                ]
        return Tokens(ids, **facts)

    def fill(self, prefix: Tokens) -> Tokens:
        """These tokens with what ``prefix`` recorded of its tokens (which begin these)
        where these hold a fact's default: a later engine call's prompt segment, whose
        prefill routed the environment tokens an earlier call never saw and the earlier
        action's last token (each token keeps what the first call that recorded it gave)."""
        if all(getattr(prefix, name) is None for name, _ in FACTS):
            return self  # nothing recorded (a dense model's prompt)
        n = len(prefix)
        if prefix.ids != self.ids[:n]:
            raise ValueError(
                f"Tokens.fill: the {n} ids of the prefix do not begin these {len(self)} ids"
            )
        facts: dict[str, Any] = {}
        for name, fact in FACTS:
            mine, theirs = getattr(self, name), getattr(prefix, name)
            facts[name] = mine
            if theirs is None:
                continue
            if isinstance(theirs, torch.Tensor):
                mine = _full(len(self), theirs, fact.default) if mine is None else mine.clone()
                head = mine[:n]
                unset = _is_default(head, fact.default) & ~_is_default(theirs, fact.default)
                head[unset] = theirs[unset]
            else:
                mine = [fact.default] * len(self) if mine is None else list(mine)
                for i, x in enumerate(theirs):
                    if mine[i] == fact.default and x != fact.default:
                        mine[i] = x
            facts[name] = mine
        return Tokens(self.ids, **facts)

    def masked(self) -> Tokens:
        """The same tokens kept out of the loss (sampled by a policy that does not train
        on this row)."""
        return replace(self, mask=None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokens) or other.ids != self.ids:
            return False
        for name, _ in FACTS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                continue
            a, b = self.materialised(name, b), other.materialised(name, a)
            if isinstance(a, torch.Tensor):
                if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
                    return False
            elif list(a) != list(b):
                return False
        return True

    def materialised(self, name: str, like: Any = None) -> Any:
        """Fact ``name`` with its defaults written out (a tensor fact needs ``like``, a
        value of the same fact, for its shape and dtype)."""
        value = getattr(self, name)
        if value is not None:
            return value
        default = FACT_OF[name].default
        if isinstance(like, torch.Tensor):
            return _full(len(self), like, default)
        return [default] * len(self)


def _full(n: int, like: torch.Tensor, value: Any) -> torch.Tensor:
    return torch.full((n, *like.shape[1:]), value, dtype=like.dtype, device=like.device)


def _is_default(x: torch.Tensor, default: Any) -> torch.Tensor:
    """Per token: every entry at the default (nothing recorded)."""
    return (x == default).reshape(x.shape[0], -1).all(1)


FACTS: list[tuple[str, Fact]] = [
    (f.name, f.metadata["fact"]) for f in fields(Tokens) if "fact" in f.metadata
]
FACT_OF = dict(FACTS)


def _pad(
    values: Sequence[Any], width: int, fact: Fact, left: bool, like: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row values of one fact (None: the default) padded to ``width`` tokens; a tensor
    fact's rows are shaped like ``like``."""
    if like is not None:
        out = torch.full((len(values), width, *like.shape[1:]), fact.default, dtype=like.dtype)
    else:
        out = torch.full((len(values), width), fact.default, dtype=fact.dtype or torch.float32)
    for i, v in enumerate(values):
        if v is None or not len(v):
            continue
        if isinstance(v, torch.Tensor):
            if v.shape[1:] != out.shape[2:]:
                raise ValueError(
                    f"record row {i}: {fact.response or fact.prompt} of shape "
                    f"{tuple(v.shape[1:])} per token, other rows {tuple(out.shape[2:])}"
                )
        else:
            v = torch.as_tensor(v, dtype=out.dtype)
        if left:
            out[i, width - len(v) :] = v
        else:
            out[i, : len(v)] = v
    return out


def token_columns(
    prompts: Sequence[Tokens], responses: Sequence[Tokens], pad_id: int
) -> dict[str, torch.Tensor]:
    """A record's per-token columns: ``prompt_ids`` / ``prompt_mask`` left-padded,
    ``response_ids`` / ``response_mask`` right-padded (ids with ``pad_id``), and each
    fact's columns padded with its default; a fact no row has (prompt or response) gets
    no column unless ``always``."""
    p = max((len(t) for t in prompts), default=0)
    r = max((len(t) for t in responses), default=0)
    ids, real = Fact(pad_id, dtype=torch.long), Fact(0, dtype=torch.long)
    out = {
        "prompt_ids": _pad([t.ids for t in prompts], p, ids, left=True),
        "prompt_mask": _pad([[1] * len(t) for t in prompts], p, real, left=True),
        "response_ids": _pad([t.ids for t in responses], r, ids, left=False),
        "response_mask": _pad([[1] * len(t) for t in responses], r, real, left=False),
    }
    for name, fact in FACTS:
        sides = [(fact.prompt, prompts, p, True), (fact.response, responses, r, False)]
        values = {col: [getattr(t, name) for t in rows] for col, rows, _, _ in sides if col}
        known = [v for vs in values.values() for v in vs if v is not None]
        if not (fact.always or known):
            continue
        like = next((v for v in known if isinstance(v, torch.Tensor)), None)
        for column, _, width, left in sides:
            if column is not None:
                out[column] = _pad(values[column], width, fact, left, like)
    return out


def padding() -> tuple[dict[str, Any], dict[str, Any]]:
    """The facts' (prompt, response) record columns with the value their padding takes."""
    prompt = {f.prompt: f.default for _, f in FACTS if f.prompt}
    response = {f.response: f.default for _, f in FACTS if f.response}
    return prompt, response
