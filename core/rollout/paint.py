"""Image requests beside token requests: how a workflow reaches a painter (a diffusion
policy) without knowing its plugin, and how its trajectories join a text record.

- :class:`ImageRequest`: a prompt (text, or token ids of the painter's own tokenizer), ``n``
  images, an optional seed, training or evaluation sampling. The episode runtime
  (:class:`~polyrl.core.rollout.batching.Batcher.paint`) queues it beside token requests and serves
  every waiting image request of one policy in one :meth:`PaintsImages.paint` call per flush.
- :class:`Painting`: one image ``[3, H, W]`` in ``[0, 1]`` and its trajectory, one row of the
  painter's own record layout (latents, σ's, per-step log-probs, masks, embeddings:
  whatever its policy kind's log-prob pass reads), the weights version of every step, an
  error ("" = fine) and how many prompt tokens the text encoder cut.
- :func:`merge_records`: one record from records of different layouts (token rows and
  trajectory rows), each column padded where its rows lack it, so rewards, credit and the
  per-policy update read one record; :func:`~polyrl.core.record.select_policy` then trims a
  policy's rows back to its own widths.
- :class:`MemberAlgorithm`: a workflow whose members train with their own loss settings
  (a painter: Flow-GRPO's clip range and Gaussian KL; an LLM: PPO's); the session updates
  each policy with ``member_algorithm(name, algorithm)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from polyrl.core.interfaces import engine_caps
from polyrl.core.record import (
    NON_TENSOR_FIELDS,
    PROMPT_COLUMNS,
    RESPONSE_COLUMNS,
    set_strings,
    strings,
)


@dataclass
class ImageRequest:
    """``n`` images of one prompt. ``prompt``: text, or ids of the painter's tokenizer.
    ``seed``: the starting noise of these images from this seed (None: the engine's RNG).
    ``deterministic``: evaluation sampling (the ODE from fixed noise; nothing trains)."""

    prompt: str | list[int]
    n: int = 1
    seed: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"an image request needs n >= 1, got {self.n}")


@dataclass(eq=False)
class Painting:
    """One image of an :class:`ImageRequest`, with what training on it needs."""

    image: torch.Tensor  # [3, H, W] (video: [3, F, H, W]) in [0, 1]; zeros when it failed
    trajectory: TensorDict  # one row (batch size [1]) of the painter's record layout
    versions: list[int] = field(default_factory=list)  # weights version of each step
    error: str = ""  # "" = fine; else the row leaves the update with this error
    prompt_text: str = ""  # the prompt as the painter read it (after any cut)
    cut_tokens: int = 0  # prompt tokens beyond what the text encoder takes (dropped)


@runtime_checkable
class PaintsImages(Protocol):
    """An engine (class or handle) that serves image requests (its ``caps`` say
    ``paints_images``): ``paint(requests)`` gives,
    for each request, its ``n`` paintings, all in one call (one sampling pass over every
    request's rows). ``prompt_limit()``: the tokens of a prompt its text encoder takes
    (longer prompts are cut, and each painting counts its cut tokens)."""

    def paint(self, requests: Sequence[ImageRequest]) -> list[list[Painting]]: ...

    def prompt_limit(self) -> int: ...


def paints_images(engine: Any) -> bool:
    """Whether ``engine`` (an engine, its class or a Ray handle) serves image requests."""
    return engine_caps(engine).paints_images


@runtime_checkable
class MemberAlgorithm(Protocol):
    """A workflow whose policies train with loss settings of their own: the session
    updates policy ``name`` with ``member_algorithm(name, algo)`` instead of ``algo``."""

    def member_algorithm(self, name: str, algo: Any) -> Any: ...


def _pad_to(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``t [B, w, ...]`` right-padded along dim 1 to ``width`` (left for prompt columns is
    done by the caller)."""
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def merge_records(records: Sequence[TensorDict]) -> TensorDict:
    """One record of ``records``' rows in order. Per-token columns (response columns,
    prompt columns) are padded to the widest (prompt columns on the left), with their pad
    value; a column some records lack is filled with its pad value (0, ``False``, -1 for
    versions, NaN for rewards) in their rows, shaped as where it exists; a non-tensor
    column some lack holds "" there (``meta``: an empty dict)."""
    records = [r for r in records if r.batch_size[0] > 0]
    if not records:
        raise ValueError("merge_records: no rows")
    if len(records) == 1:
        return records[0]
    have = [set(r.keys()) for r in records]
    keys: dict[str, None] = {}
    for r in records:
        keys |= dict.fromkeys(r.keys())
    sizes = [r.batch_size[0] for r in records]
    out = TensorDict({}, batch_size=[sum(sizes)])
    for key in keys:
        if key in NON_TENSOR_FIELDS or not all(
            isinstance(r.get(key), torch.Tensor)
            for r, h in zip(records, have, strict=True)
            if key in h
        ):
            values: list = []
            for r, b, h in zip(records, sizes, have, strict=True):
                if key in h:
                    values += strings(r, key)
                else:
                    values += [{} if key == "meta" else ""] * b
            set_strings(out, key, values)
            continue
        present = [r[key] for r, h in zip(records, have, strict=True) if key in h]
        like = present[0]
        pad = PROMPT_COLUMNS.get(key, RESPONSE_COLUMNS.get(key, 0))
        if key == "reward":
            pad = float("nan")
        width = max(t.shape[1] for t in present) if like.dim() > 1 else None
        parts = []
        for r, b, h in zip(records, sizes, have, strict=True):
            if key in h:
                t = r[key]
            else:
                shape = (b, *like.shape[1:]) if width is None else (b, 0, *like.shape[2:])
                t = torch.full(shape, pad, dtype=like.dtype)
            if width is not None:
                if t.shape[2:] != like.shape[2:]:
                    raise ValueError(
                        f"merge_records: column {key!r} has rows of shape {tuple(t.shape[2:])} "
                        f"and {tuple(like.shape[2:])} beyond its first two dimensions"
                    )
                if key in PROMPT_COLUMNS:
                    t = _pad_to(t.flip(1), width, pad).flip(1)
                else:
                    t = _pad_to(t, width, pad)
            parts.append(t.to(like.dtype))
        out[key] = torch.cat(parts)
    return out
