"""Prompts in the gateway: how long a model's context is, a cheap check that a rendered
prompt cannot fit it (before it is tokenised), and the cache of rendered prompts.

Tokenising is the slow part of building a prompt (a 1 MB text takes seconds on a small
vocabulary; 12 MB minutes), so a text that cannot fit the context is refused from its byte
count alone: a token stands for at most a few bytes, measured once per tokenizer
(:func:`~polyrl.agents.gateway.limits.bytes_per_token`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.limits import bytes_per_token

# Bytes of rendered prompts (their messages and ids) the server keeps for reuse.
CACHE_BYTES = 64 * 1024 * 1024


def context_length(policy: Any) -> int | None:
    """The positions a policy's model takes (prompt + completion), from its config's
    ``max_position_embeddings``; None when it does not say (no check)."""
    config = getattr(getattr(policy, "model", None), "config", None)
    path = getattr(getattr(policy, "cfg", None), "model", None)
    if config is None and isinstance(path, str):  # a Ray handle: the weights are elsewhere
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception:  # a config it cannot read: no check rather than no run
            return None
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class LengthCheck:
    """Refuses, before tokenising it, a prompt whose text cannot fit its model's context."""

    def __init__(self, tokenizers: dict[str, Any], contexts: dict[str, int | None]) -> None:
        self.tokenizers, self.contexts = tokenizers, contexts
        self._per_token: dict[str, int] = {}  # per model: most bytes one token stands for
        self._lock = threading.Lock()  # prompts render on worker threads

    def per_token(self, model: str) -> int:
        with self._lock:
            per = self._per_token.get(model)
            if per is None:
                tok = self.tokenizers[model]
                backend = getattr(tok, "backend_tokenizer", None)
                normalises = backend is None or backend.normalizer is not None
                per = bytes_per_token(tok) * (3 if normalises else 1)
                self._per_token[model] = per
            return per

    def check(self, model: str, text: str, head: int) -> None:
        """Refuse, before tokenising it, a prompt whose text cannot fit the model's context:
        a token stands for at most ``bytes_per_token`` UTF-8 bytes (measured on the
        tokenizer, x3 for a tokenizer that normalises: NFC composes up to 3 characters
        into one), so a text of B bytes is at least B / that many tokens. Tokenising 12 MB
        takes minutes; this check costs one pass over the text."""
        context = self.contexts.get(model)
        if not context:
            return
        per = self.per_token(model)
        if len(text) * 4 <= (context - head) * per:  # at most 4 bytes a character
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        least = head + size // per
        if least > context:
            raise RequestError(
                400,
                f"model {model!r} takes {context} tokens (its context length); this "
                f"request's prompt is {size} bytes of text, at least {least} tokens; send a "
                "shorter conversation",
                code="context_length_exceeded",
                param="messages",
            )


class RenderCache:
    """A mapping bounded in entries and bytes that forgets the least recently used entry
    (an agent's long prompts never pin memory past ``max_bytes``)."""

    def __init__(self, size: int, max_bytes: int = CACHE_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()  # prompts render on worker threads

    def get(self, key: Any) -> Any:
        with self.lock:
            entry = self.data.get(key)
            if entry is None:
                return None
            self.data.move_to_end(key)
            return entry[0]

    def put(self, key: Any, value: Any, nbytes: int) -> None:
        if nbytes > self.max_bytes // 16:  # too big to be worth keeping
            return
        with self.lock:
            old = self.data.pop(key, None)
            self.bytes += nbytes - (old[1] if old is not None else 0)
            self.data[key] = (value, nbytes)
            while len(self.data) > self.size or self.bytes > self.max_bytes:
                self.bytes -= self.data.popitem(last=False)[1][1]
