"""Images in the gateway's requests: OpenAI ``image_url`` content parts for a VLM policy.

An agent sends an image as ``{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}`` in a message's content, as it would to any OpenAI-compatible VLM server. The
gateway never fetches a URL (a run must not depend on the network): only data URLs are
taken. Each image is decoded here, checked against the gateway's limits before its pixels
are read, and named by a digest of its bytes, which is how stitching recognises the same
image when an agent sends its history again. The policy encodes the images through the
core's :class:`~polyrl.core.interfaces.TakesImageTurns`, so this module knows no model.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from typing import Any

from PIL import Image

from polyrl.agents.gateway.options import GatewayOptions

_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,(.*)", re.S)


class ImagePartError(ValueError):
    """A content part that is not a usable image; the message names the part and the fix."""


def image_url(part: dict, where: str) -> str:
    """The URL of an ``image_url`` part (an object with ``url``, or the URL itself)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ImagePartError(f"{where}: an image_url part needs image_url.url (a data URL)")
    return url


def decode(url: str, where: str, pixels_left: int) -> tuple[Image.Image, str]:
    """The RGB image of a data URL and its digest; errors say what to send instead."""
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ImagePartError(
            f"{where}: {shown!r} is not a base64 data URL; the gateway fetches nothing, "
            "send the image inline as data:image/png;base64,..."
        )
    try:
        raw = base64.b64decode(m.group(1), validate=True)
    except (binascii.Error, ValueError):
        raise ImagePartError(f"{where}: the data URL's base64 does not decode") from None
    try:
        img = Image.open(io.BytesIO(raw))
        w, h = img.size  # from the header: nothing decoded yet
    except Exception as e:
        raise ImagePartError(
            f"{where}: the data URL holds no image PIL can read ({type(e).__name__})"
        ) from None
    if w * h > pixels_left:
        raise ImagePartError(
            f"{where}: a {w}x{h} image exceeds the request's pixel limit "
            f"({pixels_left} pixels left of rollout.args.max_pixels); send it smaller"
        )
    try:
        rgb = img.convert("RGB")
    except Exception as e:
        raise ImagePartError(
            f"{where}: the image does not decode ({type(e).__name__}: {e})"
        ) from None
    return rgb, hashlib.sha256(raw).hexdigest()[:16]


def content(value: Any, where: str, limits: GatewayOptions, images: list) -> tuple[Any, str]:
    """A message's content as the chat template renders it (a string, or text and image
    parts when it has images) and its comparison text (image digests in place of the
    images); its decoded images are appended to ``images`` (the request's, in order)."""
    if value is None:
        return "", ""
    if isinstance(value, str):
        return value, value
    if not isinstance(value, list):
        raise ImagePartError(f"{where}.content must be a string or a list of parts")
    parts, key = [], []
    for k, part in enumerate(value):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = str(part.get("text", ""))
            parts.append({"type": "text", "text": text})
            key.append(text)
        elif kind == "image_url":
            if len(images) >= limits.max_images:
                raise ImagePartError(
                    f"{at}: the request has more than rollout.args.max_images="
                    f"{limits.max_images} images"
                )
            used = sum(im.width * im.height for im in images)
            img, digest = decode(image_url(part, at), at, limits.max_pixels - used)
            images.append(img)
            parts.append({"type": "image"})
            key.append(f"\x00image:{digest}\x00")
        else:
            raise ImagePartError(
                f"{at}: type {kind!r} is not supported; use 'text' or 'image_url' (a data URL)"
            )
    if all(p["type"] == "text" for p in parts):  # text only: one string, as before
        text = "".join(p["text"] for p in parts)
        return text, text
    return parts, "".join(key)


def count(messages: list[dict]) -> int:
    """Image parts in rendered messages."""
    return sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    )
