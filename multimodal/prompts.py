"""A ``vl`` row's prompt as chat messages of text, image and video parts, in prompt order.

A prompt is a string with ``<image>`` / ``<video>`` markers or a list of chat messages
whose contents are strings or part lists; both become messages whose contents are part
lists (:func:`to_messages`), so the dataset counts and places vision inputs one way.
"""

from __future__ import annotations

import math
import re
from typing import Any

from polyrl.core.rollout.data import DataError


def blank(value: Any) -> bool:
    return (
        value is None
        or (isinstance(value, float) and math.isnan(value))
        or (isinstance(value, str) and not value.strip())
    )


def split_markers(text: str, markers: dict[str, str]) -> list[dict]:
    """Text and vision parts in order; ``markers`` maps a marker (``<image>``) to its part
    type (``image``)."""
    pattern = "(" + "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)) + ")"
    parts: list[dict] = []
    for piece in re.split(pattern, text):
        if piece in markers:
            parts.append({"type": markers[piece]})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def vision_part(part: Any) -> str | None:
    """``image`` / ``video`` for a chat content part of that kind, else None."""
    if not isinstance(part, dict):
        return None
    for kind in ("image", "video"):
        if part.get("type") == kind or kind in part:
            return kind
    return None


def to_messages(prompt: Any, markers: dict[str, str], where: str, field: str) -> list[dict]:
    """Chat messages whose contents are part lists (text / image / video) in prompt order."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": split_markers(prompt, markers)}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(
            f"{where}: field {field!r} must be a string or a non-empty list of "
            f"{{'role', 'content'}} messages, not {type(prompt).__name__}."
        )
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(
                f"{where}: field {field!r}, message {j} is {m!r:.80}; chat "
                "messages must be dicts with a string 'role' and a 'content'."
            )
        content = m["content"]
        if isinstance(content, str):
            parts = split_markers(content, markers)
        elif isinstance(content, list):
            parts = []
            for part in content:
                kind = vision_part(part)
                if kind is not None:
                    parts.append({"type": kind})
                elif isinstance(part, dict) and part.get("type") == "text":
                    parts.extend(split_markers(str(part.get("text", "")), markers))
                else:
                    raise DataError(
                        f"{where}: field {field!r}, message {j} has a content part "
                        f"{part!r:.80}; use {{'type': 'text', 'text': ...}}, "
                        "{'type': 'image'} or {'type': 'video'}."
                    )
        else:
            raise DataError(
                f"{where}: field {field!r}, message {j}: 'content' must be a "
                f"string or a list of parts, not {type(content).__name__}."
            )
        messages.append({"role": m["role"], "content": parts})
    return messages


def count_parts(messages: list[dict], kind: str = "image") -> int:
    return sum(part["type"] == kind for m in messages for part in m["content"])


def prepend_parts(messages: list[dict], k: int, kind: str = "image") -> None:
    target = next((m for m in messages if m["role"] == "user"), messages[0])
    target["content"] = [{"type": kind} for _ in range(k)] + target["content"]
