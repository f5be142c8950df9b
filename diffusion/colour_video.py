"""The colour-over-time task for text-to-video: prompts such as "red, then blue".

A prompt asks for a video whose first frames show one palette colour and whose last
frames show another (whole frames, or a blob on the dark background of :mod:`.colour`).
Registered as task ``colour_video`` (``write_dataset``, ``corpus``, ``sft_rows``); the
video rewards that score it (``video_colour``, ``video_colour_accuracy``,
``temporal_consistency``) are in :mod:`.rewards`, the tiny Wan pre-training on its videos
in :mod:`.tiny`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Annotated

import torch
from torch import Tensor

from polyrl.core.registry import TASKS
from polyrl.core.tasks.common import write_splits
from polyrl.diffusion import colour as colour_task

TEMPLATES = ("{a}, then {b}", "{a} then {b}", "{a} turning {b}")


def prompt_colours(prompt: str, names: list[str] | None = None) -> tuple[str, str] | None:
    """The first two palette colours a prompt names, in order ("red, then blue")."""
    words = prompt.lower().replace(",", " ").split()
    found = [w for w in words if w in (names or colour_task.PALETTE)]
    return (found[0], found[1]) if len(found) >= 2 else None


def frame_targets(frames: int) -> list[int]:
    """Which colour each frame should show: 0 (the first) for the first half, 1 for the
    second half; -1 for the middle frame of an odd count (the change, scored by neither)."""
    half = frames // 2
    return [0] * half + [-1] * (frames - 2 * half) + [1] * half


def pairs(names: list[str] | None = None, both_orders: bool = True) -> list[tuple[str, str]]:
    """Ordered pairs of distinct colours; ``both_orders=False`` keeps each pair in palette
    order only ("red, then blue" but not "blue, then red")."""
    names = colour_task.palette_names(names)
    return [
        (a, b)
        for i, a in enumerate(names)
        for j, b in enumerate(names)
        if i != j and (both_orders or i < j)
    ]


def write_dataset(
    out_dir: str | Path,
    seed: int,
    n_train: Annotated[int, "training prompts, each a random ordered pair and template"] = 512,
    colours: Annotated[list[str] | None, "palette colours (null: red, green, blue, yellow)"] = None,
    eval_pairs: Annotated[
        list[str] | None,
        "evaluation prompts (null: every pair of colours with the first template)",
    ] = None,
    both_orders: Annotated[
        bool,
        "each pair in both orders (false: palette order only, e.g. 'red, then blue' but not "
        "'blue, then red': then the set of colours alone tells the order)",
    ] = True,
) -> tuple[Path, Path]:
    """train.jsonl (random "a, then b" prompts) and eval.jsonl (fixed ones) under ``out_dir``."""
    all_pairs = pairs(colours, both_orders)
    rng = random.Random(seed)
    train = []
    for _ in range(n_train):
        a, b = rng.choice(all_pairs)
        train.append({"prompt": rng.choice(TEMPLATES).format(a=a, b=b), "answer": [a, b]})
    evl = []
    for p in (
        eval_pairs
        if eval_pairs is not None
        else [TEMPLATES[0].format(a=a, b=b) for a, b in all_pairs]
    ):
        ab = prompt_colours(p, colours)
        if ab is None:
            raise ValueError(f"task.args.eval_pairs: {p!r} names fewer than two palette colours")
        evl.append({"prompt": p, "answer": list(ab)})
    return write_splits(out_dir, train, evl)


def corpus(both_orders: bool = True, colours: list[str] | None = None) -> list[str]:
    """Every prompt of the task (the tiny tokenizer's vocabulary and pre-training captions)."""
    return [t.format(a=a, b=b) for a, b in pairs(colours, both_orders) for t in TEMPLATES]


def sft_rows(rows) -> list[dict]:
    raise NotImplementedError("the colour_video task has no supervised targets; set sft.steps=0")


def render_videos(
    colour_idx: Tensor,
    frames: int,
    size: int,
    generator: torch.Generator,
    names: list[str],
    blob: bool = False,
) -> Tensor:
    """Videos [B, 3, frames, size, size] in [0, 1] whose colour is ``colour_idx[:, 0]`` in
    the first half and ``colour_idx[:, 1]`` in the second (the middle frame of an odd count
    takes the second), with a little pixel noise. ``blob``: one still blob of that colour on
    the dark background (as the image task); otherwise the whole frame has the colour."""
    pal = torch.tensor([colour_task.PALETTE[n] for n in names])
    b = colour_idx.shape[0]
    if blob:
        first = colour_task.render_blobs(colour_idx[:, 0], size, generator, names)
        # the same blob (same place), recoloured
        bg = torch.tensor(colour_task.BACKGROUND)[None, :, None, None]
        fg = (first - bg).abs().sum(1) > 0.3
        second = torch.where(fg[:, None], pal[colour_idx[:, 1]][:, :, None, None], first)
    else:
        first, second = (
            pal[colour_idx[:, k]][:, :, None, None].expand(b, 3, size, size) for k in (0, 1)
        )
    out = []
    for f, tgt in enumerate(frame_targets(frames)):
        img = first if tgt == 0 else second
        noise = 0.03 * torch.randn(img.shape, generator=generator) if f else 0.0
        out.append((img + noise).clamp(0, 1))
    return torch.stack(out, dim=2)


TASKS.register("colour_video", sys.modules[__name__])
