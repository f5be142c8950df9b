"""Rewards that see the image: CLIP score and grounding IoU (plus the core's format and math).

Both read ``Sample.images`` (the resized images the model saw) and ``Sample.meta``
(``image_sizes``/``resized_sizes`` written by the VL workflow). Combine them with the
core's ``regex_format`` (``<think>...</think><answer>...</answer>`` by default) and math
checkers (``math``, ``math_dapo``, ``gsm8k``, backed by verl) through reward weights.

**Box conventions.** Grounding answers are only comparable once both boxes are in one
frame. ``pred_convention`` is how the *model* writes boxes:

- ``qwen2.5`` (= ``resized_pixels``): absolute pixels of the resized image the model saw
- ``qwen2`` / ``qwen3`` (= ``relative1000``): integers on a 0-1000 grid over the image
- ``source_pixels``: absolute pixels of the original image; ``normalized``: 0-1 fractions

``answer_convention`` is how the dataset's ground truth is written (same names). IoU is
computed after mapping both to 0-1 fractions of the image; IoU does not change under that
per-axis scaling, so the result equals the IoU in any common pixel frame.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch

from polyrl.core.rollout.rewards import Sample, extract_answer, register_reward

CONVENTIONS = {
    "qwen2.5": "resized_pixels",
    "qwen2": "relative1000",
    "qwen3": "relative1000",
    "resized_pixels": "resized_pixels",
    "relative1000": "relative1000",
    "source_pixels": "source_pixels",
    "normalized": "normalized",
}
Convention = Literal[
    "qwen2.5", "qwen2", "qwen3", "resized_pixels", "relative1000", "source_pixels", "normalized"
]
_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
# "[x1,y1,x2,y2]", "x1,y1,x2,y2", "(x1,y1),(x2,y2)" or "[[x1,y1],[x2,y2]]", nothing else
_BOX = re.compile(
    rf"\s*(?:\[{_NUM},{_NUM},{_NUM},{_NUM}\]|{_NUM},{_NUM},{_NUM},{_NUM}"
    rf"|[\[\(]{_NUM},{_NUM}[\]\)]\s*,\s*[\[\(]{_NUM},{_NUM}[\]\)]"
    rf"|\[\s*\[{_NUM},{_NUM}\]\s*,\s*\[{_NUM},{_NUM}\]\s*\])\s*"
)


def parse_box(value: Any) -> tuple[float, float, float, float] | None:
    """A well-formed box (see ``_BOX``) or a 4-sequence as (x1, y1, x2, y2), corners sorted;
    None for anything else (a malformed box is a wrong answer, not a lucky parse)."""
    if isinstance(value, (list, tuple)) and len(value) == 4:
        nums = [float(v) for v in value]
    else:
        m = _BOX.fullmatch(str(value))
        if m is None:
            return None
        nums = [float(v) for v in m.groups() if v is not None]
    x1, y1, x2, y2 = nums
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def to_fractions(
    box: Sequence[float],
    convention: str,
    source_size: tuple[int, int] | None,
    resized_size: tuple[int, int] | None,
) -> tuple[float, float, float, float]:
    """Map a box to 0-1 fractions of the image, given how it was written."""
    kind = CONVENTIONS.get(convention)
    if kind is None:
        raise ValueError(f"unknown box convention {convention!r}; use one of {sorted(CONVENTIONS)}")
    if kind == "normalized":
        sx = sy = 1.0
    elif kind == "relative1000":
        sx = sy = 1000.0
    else:
        size = resized_size if kind == "resized_pixels" else source_size
        if not size:
            raise ValueError(
                f"box convention {convention!r} needs the "
                f"{'resized' if kind == 'resized_pixels' else 'source'} image size "
                "(meta['resized_sizes'] / meta['image_sizes'] from a VL workflow)"
            )
        sx, sy = float(size[0]), float(size[1])
    x1, y1, x2, y2 = box
    return x1 / sx, y1 / sy, x2 / sx, y2 / sy


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes (0 when both are empty)."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _size(meta: dict, key: str, index: int) -> tuple[int, int] | None:
    sizes = meta.get(key) or []
    return tuple(sizes[index]) if index < len(sizes) else None


@register_reward("grounding_iou")
def grounding_iou(
    sample: Sample,
    pred_convention: Annotated[
        Convention, "how the model writes boxes (see the module docstring)"
    ] = "qwen2.5",
    answer_convention: Annotated[
        Convention | None, "how the ground truth is written (null: pred_convention)"
    ] = None,
    answer_field: Annotated[
        str | None, "dataset row field holding the ground-truth box (null: the answer)"
    ] = None,
    image_index: Annotated[int, "which of the row's images the boxes refer to"] = 0,
    unparsable: Annotated[float, "score of a response with no box"] = 0.0,
) -> float:
    """IoU of the response's box with the ground-truth box, conventions made explicit.

    The predicted box is the ``<answer>`` block (or the whole response) when it is exactly
    one box (``[x1,y1,x2,y2]``, ``(x1,y1),(x2,y2)`` and a few such forms). The ground truth is ``sample.answer`` or, with ``answer_field``, that field of
    the dataset row; ``answer_convention`` defaults to ``pred_convention``. A response with
    no box scores ``unparsable`` (a wrong answer, not a failed reward).
    """
    meta = sample.meta or {}
    if answer_field is not None:
        gold_value = (meta.get("row") or {}).get(answer_field)
        if gold_value is None:
            raise ValueError(f"grounding_iou: the dataset row has no {answer_field!r} field")
    else:
        gold_value = sample.answer
    gold = parse_box(gold_value)
    if gold is None:
        raise ValueError(f"grounding_iou: the ground truth {gold_value!r:.60} is not a box")
    source = _size(meta, "image_sizes", image_index)
    resized = _size(meta, "resized_sizes", image_index)
    gold_f = to_fractions(gold, answer_convention or pred_convention, source, resized)
    pred = parse_box(extract_answer(sample.response))
    if pred is None:
        return float(unparsable)
    return iou(to_fractions(pred, pred_convention, source, resized), gold_f)


# --------------------------------------------------------------------------- CLIP score

_CLIP_CACHE: dict[tuple, tuple] = {}
_CLIP_LOCK = threading.Lock()


def load_clip(model: str, pretrained: str | None = None, device: str = "cpu"):
    """(model, preprocess, tokenizer) of an open_clip model, loaded once per process.

    ``model`` is an open_clip model name, or the path of an open_clip model config
    (``<name>.json``) for an architecture open_clip does not ship: it is registered here,
    in the process that scores, so a reward actor needs nothing set up beforehand.
    ``pretrained`` is a local checkpoint path or an open_clip pretrained tag (a tag needs
    the weights in the local cache or a network connection).
    """
    key = (model, pretrained, device)
    with _CLIP_LOCK:
        if key not in _CLIP_CACHE:
            import open_clip

            name = model
            if model.endswith(".json"):
                config = Path(model).expanduser()
                if not config.is_file():
                    raise FileNotFoundError(f"clip_score: model config {config} does not exist")
                open_clip.add_model_config(config)
                name = config.stem
            clip, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=pretrained or None, device=device
            )
            clip.eval().requires_grad_(False)
            _CLIP_CACHE[key] = (clip, preprocess, open_clip.get_tokenizer(name))
        return _CLIP_CACHE[key]


def _caption(sample: Sample, text: str, template: str) -> str:
    if text == "response":
        value = extract_answer(sample.response).strip()
    elif text == "answer":
        value = "" if sample.answer is None else str(sample.answer)
    elif text == "prompt":
        value = sample.prompt
    else:
        raise ValueError(f"clip_score text must be response, answer or prompt, not {text!r}")
    return template.format(value)


@register_reward("clip_score", batched=True)
@torch.no_grad()
def clip_score(
    samples: list[Sample],
    model: Annotated[
        str, "open_clip model name, or the path of a model config <name>.json"
    ] = "ViT-B-32",
    pretrained: Annotated[
        str | None, "local checkpoint path or open_clip pretrained tag (null: random init)"
    ] = None,
    text: Annotated[
        Literal["response", "answer", "prompt"],
        "the caption: the response's <answer> block, the ground truth, or the prompt",
    ] = "response",
    template: Annotated[str, "wraps the caption, e.g. 'a photo of {}'"] = "{}",
    image_index: Annotated[int, "which of the sample's images is scored"] = 0,
    scale: Annotated[float, "the cosine is multiplied by this (CLIPScore: 2.5)"] = 1.0,
    clip_negative: Annotated[bool, "negative cosines score 0 (CLIPScore: true)"] = False,
    device: Annotated[str, "where the CLIP model runs"] = "cpu",
    batch_size: Annotated[int, "images (and captions) per encoder pass"] = 64,
) -> list[float]:
    """Cosine similarity between each sample's image and its caption, times ``scale``.

    ``text`` picks the caption (the ``<answer>`` block of the response by default, the
    ground-truth answer or the prompt) and ``template`` wraps it (``"a photo of {}"``).
    CLIPScore (Hessel et al.) is ``scale=2.5, clip_negative=true``. Images are encoded once
    per distinct image object (a group of ``n`` shares one), in batches of ``batch_size``.
    """
    clip, preprocess, tokenizer = load_clip(model, pretrained, device)
    images, image_rows = [], []
    seen: dict[int, int] = {}
    for s in samples:
        if not s.images or len(s.images) <= image_index:
            raise ValueError(f"clip_score: sample {s.index} has no image {image_index}")
        img = s.images[image_index]
        if id(img) not in seen:
            seen[id(img)] = len(images)
            images.append(img)
        image_rows.append(seen[id(img)])
    captions = [_caption(s, text, template) for s in samples]
    feats = []
    for start in range(0, len(images), batch_size):
        batch = torch.stack([preprocess(im) for im in images[start : start + batch_size]])
        feats.append(clip.encode_image(batch.to(device)).float())
    img_f = torch.nn.functional.normalize(torch.cat(feats), dim=-1)[image_rows]
    txt = []
    for start in range(0, len(captions), batch_size):
        tokens = tokenizer(captions[start : start + batch_size]).to(device)
        txt.append(clip.encode_text(tokens).float())
    txt_f = torch.nn.functional.normalize(torch.cat(txt), dim=-1)
    cos = (img_f * txt_f).sum(-1)
    if clip_negative:
        cos = cos.clamp(min=0)
    return (cos * scale).tolist()
