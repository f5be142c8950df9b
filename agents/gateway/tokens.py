"""Per-token views of a completion, shared by the gateway's APIs: log-prob entries (with
``top_logprobs``) and the ``<think>`` split of a reply into reasoning and answer (what
streaming shows as it comes is :mod:`polyrl.agents.gateway.stream`).

Every API answers from the same :class:`~polyrl.agents.gateway.episodes.Choice` (the
engine's token segment: ids, log-probs, top alternatives); these helpers only shape it, so
what an agent reads equals what the record keeps.
"""

from __future__ import annotations

from typing import Any

from polyrl.core.segment import Tokens

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def token_entry(tok: Any, tid: int, logprob: float) -> dict:
    piece = tok.decode([tid], skip_special_tokens=False)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def logprob_entries(tok: Any, tokens: Tokens, k: int) -> list[dict]:
    """OpenAI ``logprobs.content`` entries: per sampled token its text, log-prob, bytes and
    (``k`` > 0) the ``k`` likeliest alternatives the engine saw at that step."""
    out = []
    for j, (tid, lp) in enumerate(zip(tokens.ids, tokens.materialised("logprobs"), strict=True)):
        entry = token_entry(tok, tid, lp)
        alts = []
        if k and tokens.top is not None:
            top_ids, top_lps = tokens.top[j]
            alts = [token_entry(tok, a, b) for a, b in zip(top_ids[:k], top_lps[:k], strict=True)]
        entry["top_logprobs"] = alts
        out.append(entry)
    return out


def split_think(text: str) -> tuple[str | None, str]:
    """``<think>reasoning</think>answer`` -> (reasoning, answer); (None, text) otherwise.
    :func:`join_think` gives the text back exactly, so stitching still recognises it."""
    if text.startswith(THINK_OPEN) and THINK_CLOSE in text:
        end = text.index(THINK_CLOSE)
        return text[len(THINK_OPEN) : end], text[end + len(THINK_CLOSE) :]
    return None, text


def join_think(reasoning: str | None, answer: str) -> str:
    if reasoning is None:
        return answer
    return THINK_OPEN + reasoning + THINK_CLOSE + answer
