"""What the gateway lets one request, one episode and one rollout cost the run.

The limits are options of the gateway (:class:`~polyrl.agents.gateway.options.GatewayOptions`,
``rollout.args`` of the ``gateway`` workflow): per request (body size, messages, images, stop strings), per
episode (bytes held, requests, rows, generated tokens) and per rollout (bytes held by all
its episodes), and how long a request's body may take to arrive. An agent past a per-request
limit gets a 4xx for that request; past an episode's request, row or token budget, the
API's rate-limit error (429); past a bytes budget a 413. Each refusal is counted
(:class:`Refusals`, the workflow's ``gateway/refused_*`` metrics) and the episode goes on.

"Bytes held" is what an episode keeps until the rollout's record is built: each filed
request is charged its body as received (every field, rendered or not: tool definitions,
call ids, metadata), the stored history it continued (``previous_response_id``), its
images as decoded RGB (3 bytes a pixel) and 8 bytes a prompt or sampled token id. A
request that would pass the budget is refused before it is parsed further.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.options import GatewayOptions


@dataclass
class Spent:
    """What one episode has cost so far (guarded by the episode's lock)."""

    bytes: int = 0
    requests: int = 0
    rows: int = 0
    tokens: int = 0


@dataclass
class Refusals:
    """Requests refused by a budget, by budget, over the run (the ``gateway/refused_*``
    metrics) and the bytes all episodes of the current rollout hold."""

    counts: dict[str, int] = field(default_factory=dict)
    held: int = 0  # bytes of the current rollout's episodes
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1


def rate_limited(what: str, used: int, cap: int, option: str, unit: str) -> RequestError:
    """The 429 an episode past one of its budgets gets (the API shapes its body)."""
    return RequestError(
        429,
        f"this episode has used {used} of its {cap} {unit} (rollout.args.{option}); the "
        "episode may go on but gets no more completions; end it and return its reward",
        code="rate_limit_exceeded",
        kind="requests" if what != "tokens" else "tokens",
    )


def too_much(held: int, adding: int, cap: int, option: str, whose: str) -> RequestError:
    return RequestError(
        413,
        f"{whose} holds {held} bytes and this request would add {adding} (stored history, "
        f"tool definitions, ids, images); rollout.args.{option}={cap}; send less per request "
        "(previous_response_id instead of the whole history, shorter tool definitions and ids)",
        code="request_too_large",
    )


def admit(spent: Spent, refusals: Refusals, limits: GatewayOptions, rows: int, nbytes: int) -> None:
    """Charge one request (its ``rows`` choices and ``nbytes`` held) to its episode and the
    rollout, or raise the refusal (counted). Called with the episode's lock held."""
    checks = (
        ("requests", spent.requests, 1, limits.max_episode_requests, "max_episode_requests"),
        ("rows", spent.rows, rows, limits.max_episode_rows, "max_episode_rows"),
        ("tokens", spent.tokens, 1, limits.max_episode_tokens, "max_episode_tokens"),
    )
    for what, used, adding, cap, option in checks:
        if used + adding > cap:
            refusals.count(what)
            unit = {"requests": "requests", "rows": "rows (choices)"}.get(what, "sampled tokens")
            raise rate_limited(what, used, cap, option, unit)
    if spent.bytes + nbytes > limits.max_episode_bytes:
        refusals.count("bytes")
        raise too_much(
            spent.bytes, nbytes, limits.max_episode_bytes, "max_episode_bytes", "this episode"
        )
    with refusals.lock:
        if refusals.held + nbytes > limits.max_rollout_bytes:
            refusals.counts["bytes"] = refusals.counts.get("bytes", 0) + 1
            raise too_much(
                refusals.held, nbytes, limits.max_rollout_bytes, "max_rollout_bytes", "the rollout"
            )
        refusals.held += nbytes
    spent.requests, spent.rows, spent.bytes = (
        spent.requests + 1,
        spent.rows + rows,
        spent.bytes + nbytes,
    )


def charge(spent: Spent, refusals: Refusals, nbytes: int, tokens: int) -> None:
    """Add what a served request keeps beyond its body (its ids) and what it sampled."""
    spent.bytes += nbytes
    spent.tokens += tokens
    with refusals.lock:
        refusals.held += nbytes


def refund(spent: Spent, refusals: Refusals, rows: int, nbytes: int) -> None:
    """Give back what :func:`admit` charged a request that was not filed (refused later,
    timed out): it holds nothing and made no rows; it still counts as a request."""
    spent.rows -= rows
    spent.bytes -= nbytes
    with refusals.lock:
        refusals.held -= nbytes


def bytes_per_token(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` stands for, measured on its whole
    vocabulary (special tokens included), plus a margin for a leading space a decoder
    drops: a text of B bytes is at least ``B / bytes_per_token`` tokens, which lets the
    gateway refuse a prompt past the context before tokenising it."""
    vocab = tokenizer.get_vocab()
    ids = sorted(set(vocab.values()))
    longest = 1
    step = 8192
    for k in range(0, len(ids), step):
        texts = tokenizer.batch_decode(
            [[i] for i in ids[k : k + step]],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        longest = max(longest, *(len(t.encode("utf-8", "surrogatepass")) for t in texts))
    return longest + 4


async def read_body(request: Any, limits: GatewayOptions) -> bytes:
    """The body within ``body_timeout`` (a 408 for a client that sends it slower), refused
    with a 413 once it is past ``max_body_bytes``: from its Content-Length before a
    byte is read, else while it arrives (never kept whole)."""
    try:
        async with asyncio.timeout(limits.body_timeout):
            return await _read_capped(request, limits)
    except TimeoutError:
        raise RequestError(
            408,
            f"the request body did not arrive within rollout.args.body_timeout="
            f"{limits.body_timeout} s; the connection is closed",
            code="request_timeout",
        ) from None


async def _read_capped(request: Any, limits: GatewayOptions) -> bytes:
    cap = limits.max_body_bytes
    too_big = RequestError(
        413,
        f"the request body is larger than this gateway takes "
        f"(rollout.args.max_body_bytes={cap} bytes); send a shorter request",
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
