"""Images across the turns of a conversation: the Qwen-VL side of ``TakesImageTurns``.

A multi-turn workflow (agents' ``multi_turn``, marl's teams) renders each turn with one
``<|image_pad|>`` per image and calls :func:`encode_images` once per turn: the image
processor runs once on that turn's images (its own resize, as the real processor does on
the whole conversation), and each image's placeholder becomes ``t*h*w / merge^2`` image
tokens. :func:`join_images` joins a row's per-turn inputs, in order, into one
:class:`~polyrl.multimodal.vision.VisionInputs` with ``image_starts``: where each image's
tokens begin in the row. The engine and the policy's forward take the image positions
from ``image_starts`` (a placeholder id the policy sampled in an earlier turn stays text)
and the M-RoPE positions from the model's own ``get_rope_index`` over the whole row.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from polyrl.multimodal.images import ImageError, to_rgb
from polyrl.multimodal.vision import COUNTERS, VisionInputs


def image_token_id(processor: Any) -> int:
    """The id of the placeholder the chat template writes once per image."""
    token = getattr(processor, "image_token", "<|image_pad|>")
    tid = processor.tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == processor.tokenizer.unk_token_id:
        raise ImageError(f"the processor's tokenizer has no {token!r} token")
    return int(tid)


def encode_images(processor: Any, images: list[Any]) -> tuple[list[list[int]], VisionInputs]:
    """Each image's placeholder ids and the turn's processed images (one processor call)."""
    for k, img in enumerate(images):
        if not isinstance(img, Image.Image):
            raise ImageError(f"image {k} of the turn is a {type(img).__name__}, not a PIL image")
    if not images:
        return [], VisionInputs("turn", None, torch.zeros((0, 3), dtype=torch.long))
    rgb = [to_rgb(img) for img in images]
    out = processor.image_processor(images=rgb, return_tensors="pt")
    grid = out["image_grid_thw"].to(torch.long)
    merge = getattr(processor.image_processor, "merge_size", 2)
    patch = getattr(processor.image_processor, "patch_size", 14)
    counts = [int(g.prod()) // merge**2 for g in grid]
    token = image_token_id(processor)
    COUNTERS["images_processed"] += len(images)
    inputs = VisionInputs(
        "turn",
        out["pixel_values"],
        grid,
        tuple(img.size for img in images),
        tuple((int(g[2]) * patch, int(g[1]) * patch) for g in grid),
    )
    return [[token] * c for c in counts], inputs


def join_images(handles: list[VisionInputs], starts: list[int], key: str) -> VisionInputs | None:
    """One row's images from its turns' inputs, in order; None when it has no image."""
    with_images = [h for h in handles if h is not None and h.num_images]
    if len(starts) != sum(h.num_images for h in with_images):
        raise ValueError(
            f"{key}: {len(starts)} image starts for {sum(h.num_images for h in with_images)} images"
        )
    if list(starts) != sorted(starts):
        raise ValueError(f"{key}: image starts {starts} are not in order")
    if not with_images:
        return None
    return VisionInputs(
        key,
        torch.cat([h.pixel_values for h in with_images]),
        torch.cat([h.image_grid_thw for h in with_images]),
        tuple(s for h in with_images for s in h.sizes),
        tuple(s for h in with_images for s in h.resized),
        image_starts=tuple(int(s) for s in starts),
    )


def placeholder_mask(
    ids: torch.Tensor,
    left_pad: torch.Tensor,
    rows: list[VisionInputs | None],
    default: torch.Tensor,
    merge_size: int,
    token: int,
) -> torch.Tensor:
    """``default`` with the rows that carry ``image_starts`` marked by position instead:
    image k covers ``t*h*w / merge^2`` tokens from ``left_pad + image_starts[k]``."""
    mask = default.clone()
    for b, v in enumerate(rows):
        if v is None or v.image_starts is None:
            continue
        mask[b] = False
        pad = int(left_pad[b])
        for start, g in zip(v.image_starts, v.image_grid_thw, strict=True):
            n = int(g.prod()) // merge_size**2
            lo = pad + start
            span = ids[b, lo : lo + n]
            if span.numel() != n or not bool((span == token).all()):
                raise ValueError(
                    f"row {b} ({v.key}): image tokens expected at {start}..{start + n} "
                    "of the row, but the ids there are not all image tokens; the row's "
                    "ids and its vision inputs do not belong together"
                )
            mask[b, lo : lo + n] = True
    return mask


class ImageTurns:
    """:class:`~polyrl.core.interfaces.TakesImageTurns` from a processor alone: what the
    ``qwen_vl`` policy and the Ray driver's handle on it both offer a workflow."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.image_token_id = image_token_id(processor)

    def encode_images(self, images: list[Any]) -> tuple[list[list[int]], VisionInputs]:
        return encode_images(self.processor, images)

    def join_images(self, handles: list, starts: list[int], key: str) -> VisionInputs | None:
        return join_images(handles, starts, key)
