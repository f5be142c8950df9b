"""The colour task: prompts name a colour, images should be dominated by it.

A synthetic text-to-image task small enough for a tiny model on CPU. Images are
``size x size`` pictures of one coloured blob on a dark background; a prompt such as
"a red blob" names the blob's colour. The reward (``colour`` in :mod:`.rewards`) is the
share of pixels nearest to the named colour; ``colour_accuracy`` is 1 when the named
colour is the most common non-background colour.

Registered as task ``colour`` (``write_dataset``, ``corpus``, ``sft_rows``), so a recipe's
``task: {name: colour}`` writes its train/eval prompt files.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import torch

from polyrl.core.registry import TASKS
from polyrl.core.tasks.common import write_splits

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.75, 0.15),
    "blue": (0.10, 0.20, 0.90),
    "yellow": (0.95, 0.85, 0.10),
}
BACKGROUND = (0.12, 0.12, 0.12)
TEMPLATES = ("a {c} blob", "a {c} circle", "{c}")


def palette_names(names: Iterable[str] | None = None) -> list[str]:
    names = list(names) if names is not None else list(PALETTE)
    unknown = [n for n in names if n not in PALETTE]
    if unknown or not names:
        raise ValueError(f"unknown colours {unknown}; the palette has {sorted(PALETTE)}")
    return names


def prompt_colour(prompt: str, names: Iterable[str] | None = None) -> str | None:
    """The (first) palette colour a prompt names, or None."""
    words = prompt.lower().replace(",", " ").split()
    for w in words:
        if w in (names or PALETTE):
            return w
    return None


def render_blobs(
    colour_idx: torch.Tensor, size: int, generator: torch.Generator, names: list[str] | None = None
) -> torch.Tensor:
    """Images [B, 3, size, size] in [0, 1]: one ellipse of each row's colour, random place."""
    names = palette_names(names)
    b = colour_idx.shape[0]
    pal = torch.tensor([PALETTE[n] for n in names])
    yy, xx = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    cy = torch.rand(b, generator=generator) * size * 0.5 + size * 0.25
    cx = torch.rand(b, generator=generator) * size * 0.5 + size * 0.25
    ry = torch.rand(b, generator=generator) * size * 0.2 + size * 0.2
    rx = torch.rand(b, generator=generator) * size * 0.2 + size * 0.2
    inside = (
        ((yy - cy[:, None, None]) / ry[:, None, None]) ** 2
        + ((xx - cx[:, None, None]) / rx[:, None, None]) ** 2
    ) <= 1
    bg = torch.tensor(BACKGROUND)[None, :, None, None].expand(b, 3, size, size)
    fg = pal[colour_idx][:, :, None, None].expand(b, 3, size, size)
    img = torch.where(inside[:, None], fg, bg)
    img = img + 0.03 * torch.randn(img.shape, generator=generator)
    return img.clamp(0, 1)


def make_rows(
    n: int, seed: int, names: list[str] | None = None, templates: Iterable[str] = TEMPLATES
) -> list[dict]:
    names, templates = palette_names(names), list(templates)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        c, t = rng.choice(names), rng.choice(templates)
        rows.append({"prompt": t.format(c=c), "answer": c})
    return rows


def eval_rows(
    names: list[str] | None = None, per_colour: int = 2, templates: Iterable[str] = TEMPLATES
) -> list[dict]:
    """Fixed evaluation prompts: each colour with the first ``per_colour`` templates."""
    templates = list(templates)
    return [
        {"prompt": templates[k % len(templates)].format(c=c), "answer": c}
        for c in palette_names(names)
        for k in range(per_colour)
    ]


def write_dataset(
    out_dir: str | Path,
    seed: int,
    n_train: Annotated[int, "training prompts, each a random colour and template"] = 512,
    per_colour_eval: Annotated[
        int, "evaluation prompts per colour (the first templates, fixed)"
    ] = 2,
    colours: Annotated[
        list[str] | None, "palette colours to use (null: red, green, blue, yellow)"
    ] = None,
) -> tuple[Path, Path]:
    """train.jsonl (random colour prompts) and eval.jsonl (fixed ones) under ``out_dir``."""
    return write_splits(
        out_dir, make_rows(n_train, seed, colours), eval_rows(colours, per_colour_eval)
    )


def corpus() -> list[str]:
    """Every prompt this task can produce (the tiny tokenizer's vocabulary comes from it)."""
    return [t.format(c=c) for c in PALETTE for t in TEMPLATES]


def sft_rows(rows: Iterable[dict]) -> list[dict]:
    raise NotImplementedError("the colour task has no supervised targets; set sft.steps=0")


TASKS.register("colour", sys.modules[__name__])
