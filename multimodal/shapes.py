"""Synthetic image questions drawn with Pillow: the vision-language demo task ("vl_shapes").

Three questions, each about a small image of coloured shapes:

- ``colour``: "What colour is the square?" (a square plus distractor shapes of other colours)
- ``count``: "How many circles?" (1 to ``max_count`` circles, plus distractor squares)
- ``ground``: "Where is the red square?" with a box answer ``[x1,y1,x2,y2]``

Box answers follow the model family's convention (``box_convention``): ``qwen2.5`` gives
absolute pixels of the image the model sees (images here are drawn at a size Qwen-VL keeps,
a multiple of 28 within the pixel limits, so source and resized pixels agree); ``qwen2`` and
``qwen3`` give integers on a 0-1000 grid relative to the image. Every ground row also keeps
the box in source pixels (``box``) so rewards can convert exactly.

Rows are ``{"prompt": "<image>...", "images": ["images/train/000012.png"], "answer", ...}``
with image paths relative to the data directory (the dataset's default image root). Train
and eval images are drawn from different seeds.

The SFT rows (``sft_rows``) teach the *answer format* only by default
(``sft_targets="format"``): their targets are random valid answers, so after the warm start
the model answers in the right vocabulary at chance accuracy, and what it learns about the
images it learns from the reward. ``sft_targets="answers"`` uses the true answers instead.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Annotated, Literal

from PIL import Image, ImageDraw

from polyrl.core.registry import TASKS
from polyrl.core.tasks.common import Rows, Split, chat_text, split_task

COLOURS = {
    "red": (215, 25, 25),
    "green": (30, 170, 50),
    "blue": (35, 70, 230),
    "yellow": (250, 225, 20),
}
BACKGROUND = (245, 245, 245)
BACKGROUNDS = ("plain", "gradient")


def _canvas(size: int, background: str) -> Image.Image:
    """A plain light background, or a pastel gradient whose red channel grows with x and
    green with y, so every image region shows where it is."""
    if background == "plain":
        return Image.new("RGB", (size, size), BACKGROUND)
    if background != "gradient":
        raise ValueError(f"background must be one of {BACKGROUNDS}, got {background!r}")
    import numpy as np

    ramp = np.linspace(120, 220, size)
    arr = np.empty((size, size, 3), dtype=np.uint8)
    arr[..., 0] = ramp[None, :]
    arr[..., 1] = ramp[:, None]
    arr[..., 2] = 170
    return Image.fromarray(arr, "RGB")


QUESTIONS = ("colour", "count", "ground")
BOX_CONVENTIONS = ("qwen2.5", "qwen2", "qwen3")
PROMPTS = {
    "colour": "What colour is the square?",
    "count": "How many circles?",
    "ground": "Where is the {colour} square?",
}
SYSTEM_WORDS = (
    "Answer with one word.",
    "Answer with a number.",
    "Answer with a box [x1,y1,x2,y2].",
)


def _check(
    question: str,
    size: int,
    box_convention: str,
    sft_targets: str,
    outline: int = 0,
    shape_size: tuple[float, float] = (0.3, 0.5),
) -> None:
    if question not in (*QUESTIONS, "mixed"):
        raise ValueError(f"question must be one of {QUESTIONS} or 'mixed', got {question!r}")
    if size < 28 or size % 28:
        raise ValueError(
            f"size must be a positive multiple of 28 (Qwen-VL's resize factor), got {size}"
        )
    if box_convention not in BOX_CONVENTIONS:
        raise ValueError(f"box_convention must be one of {BOX_CONVENTIONS}, got {box_convention!r}")
    if sft_targets not in ("format", "answers"):
        raise ValueError(f"sft_targets must be 'format' or 'answers', got {sft_targets!r}")
    if outline < 0:
        raise ValueError(f"outline must be >= 0 pixels (0: a filled square), got {outline}")
    if len(shape_size) != 2 or not 0 < shape_size[0] <= shape_size[1] < 1:
        raise ValueError(f"shape_size must be (min, max) with 0 < min <= max < 1, got {shape_size}")


def _place(
    rng: random.Random, size: int, side: int, taken: list[tuple[int, int, int, int]]
) -> tuple[int, int, int, int]:
    """A box of ``side`` pixels inside the canvas, overlapping the taken ones as little as
    a few tries allow."""
    best = None
    for _ in range(30):
        x, y = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
        box = (x, y, x + side, y + side)
        if not any(
            box[0] < t[2] and t[0] < box[2] and box[1] < t[3] and t[1] < box[3] for t in taken
        ):
            return box
        best = box
    return best


def _draw(
    draw: ImageDraw.ImageDraw,
    shape: str,
    box: tuple[int, int, int, int],
    colour: str,
    outline: int = 0,
) -> None:
    fill = COLOURS[colour]
    x1, y1, x2, y2 = box
    if shape == "square" and outline:
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), outline=fill, width=outline)
    elif shape == "square":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=fill)
    elif shape == "circle":
        draw.ellipse((x1, y1, x2 - 1, y2 - 1), fill=fill)
    else:
        draw.polygon([(x1, y2 - 1), ((x1 + x2) // 2, y1), (x2 - 1, y2 - 1)], fill=fill)


def box_text(box: tuple[int, int, int, int], size: int, convention: str) -> str:
    """A box answer in the model family's convention (see the module docstring)."""
    if convention == "qwen2.5":
        coords = box
    else:
        coords = tuple(round(c * 1000 / size) for c in box)
    return "[" + ",".join(str(int(c)) for c in coords) + "]"


def _sides(size: int, shape_size: tuple[float, float]) -> tuple[int, int]:
    lo = max(4, round(size * shape_size[0]))
    return lo, max(lo + 1, min(size - 4, round(size * shape_size[1])))


def make_example(
    rng: random.Random,
    question: str,
    size: int = 56,
    distractors: int = 1,
    max_count: int = 4,
    box_convention: str = "qwen2.5",
    shape_size: tuple[float, float] = (0.3, 0.5),
    cells: int = 0,
    background: str = "plain",
    outline: int = 0,
) -> tuple[Image.Image, dict]:
    """One image and its row fields (prompt, answer and what the answer was made from).

    ``shape_size``: the side of the asked-about shape, as a (min, max) fraction of ``size``.
    ``cells`` > 0: the square instead sits in one cell of a ``cells`` x ``cells`` grid, a
    margin of 1/7 cell inside it (a grounding task with cells^2 possible boxes; a constant
    or random guess scores a mean IoU of about 1 / cells^2). ``background="gradient"``
    colours the background by position: a vision tower without absolute position
    embeddings (Qwen-VL's uses relative rotary ones) can then see *where* a shape is from
    content alone, which a tiny model learns far faster than reading M-RoPE positions.
    ``outline`` > 0 draws the asked-about square as an outline that many pixels wide, so
    the background (and with ``background="gradient"`` its position) shows inside it.
    """
    img = _canvas(size, background)
    draw = ImageDraw.Draw(img)
    taken: list[tuple[int, int, int, int]] = []
    lo, hi = _sides(size, shape_size)
    colours = list(COLOURS)
    if question == "count":
        k = rng.randint(1, max_count)
        lo, small_hi = _sides(size, (shape_size[0] * 0.5, shape_size[0]))
        for _ in range(k):
            box = _place(rng, size, rng.randint(lo, small_hi), taken)
            taken.append(box)
            _draw(draw, "circle", box, rng.choice(colours))
        for _ in range(distractors):
            box = _place(rng, size, rng.randint(lo, small_hi), taken)
            taken.append(box)
            _draw(draw, "square", box, rng.choice(colours))
        return img, {
            "prompt": "<image>" + PROMPTS["count"],
            "answer": str(k),
            "question": "count",
            "count": k,
        }
    colour = rng.choice(colours)
    if cells:  # the square sits in one cell of a cells x cells grid, a margin inside it
        cell = size // cells
        m = max(1, cell // 7)
        cx, cy = rng.randrange(cells), rng.randrange(cells)
        target = (cx * cell + m, cy * cell + m, (cx + 1) * cell - m, (cy + 1) * cell - m)
    else:
        target = _place(rng, size, rng.randint(lo, hi), taken)
    taken.append(target)
    others = [c for c in colours if c != colour]
    for _ in range(distractors):
        box = _place(rng, size, rng.randint(max(4, lo // 2), lo), taken)
        taken.append(box)
        _draw(draw, rng.choice(("circle", "triangle")), box, rng.choice(others))
    _draw(draw, "square", target, colour, outline)  # drawn last: never hidden by a distractor
    if question == "colour":
        return img, {
            "prompt": "<image>" + PROMPTS["colour"],
            "answer": colour,
            "question": "colour",
            "box": list(target),
        }
    return img, {
        "prompt": "<image>" + PROMPTS["ground"].format(colour=colour),
        "answer": box_text(target, size, box_convention),
        "question": "ground",
        "box": list(target),
        "box_convention": box_convention,
    }


def _format_target(
    rng: random.Random,
    row: dict,
    size: int,
    max_count: int,
    box_convention: str,
    shape_size: tuple[float, float],
    cells: int,
) -> str:
    """A random answer of the right shape (the 'format' SFT target)."""
    if row["question"] == "colour":
        return rng.choice(list(COLOURS))
    if row["question"] == "count":
        return str(rng.randint(1, max_count))
    if cells:
        cell = size // cells
        m = max(1, cell // 7)
        x, y = rng.randrange(cells) * cell, rng.randrange(cells) * cell
        return box_text((x + m, y + m, x + cell - m, y + cell - m), size, box_convention)
    side = rng.randint(*_sides(size, shape_size))
    x, y = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
    return box_text((x, y, x + side, y + side), size, box_convention)


def make_rows(
    n: int,
    seed: int,
    out_dir: str | Path,
    split: str,
    *,
    question: str = "colour",
    size: int = 56,
    distractors: int = 1,
    max_count: int = 4,
    box_convention: str = "qwen2.5",
    sft_targets: str = "format",
    shape_size: tuple[float, float] = (0.3, 0.5),
    cells: int = 0,
    background: str = "plain",
    outline: int = 0,
) -> list[dict]:
    """Draw ``n`` examples, write their PNGs under ``out_dir/images/<split>/`` and return rows."""
    _check(question, size, box_convention, sft_targets, outline, tuple(shape_size))
    rng = random.Random(f"vl_shapes/{split}/{seed}")
    image_dir = Path(out_dir) / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        q = rng.choice(QUESTIONS) if question == "mixed" else question
        img, row = make_example(
            rng,
            q,
            size,
            distractors,
            max_count,
            box_convention,
            tuple(shape_size),
            cells,
            background,
            outline,
        )
        rel = f"images/{split}/{i:06d}.png"
        img.save(Path(out_dir) / rel)
        row["images"] = [rel]
        row["width"], row["height"] = size, size
        row["sft_response"] = (
            row["answer"]
            if sft_targets == "answers"
            else _format_target(rng, row, size, max_count, box_convention, tuple(shape_size), cells)
        )
        rows.append(row)
    return rows


@split_task(2000, 200, "images")
def write_dataset(
    split: Split,
    question: Annotated[
        Literal["colour", "count", "ground", "mixed"],
        "colour (of the square), count (circles), ground (box of the square), or mixed",
    ] = "colour",
    size: Annotated[int, "image side in pixels, a multiple of 28"] = 56,
    distractors: Annotated[int, "other shapes per image"] = 1,
    max_count: Annotated[int, "count: most circles per image"] = 4,
    box_convention: Annotated[
        Literal["qwen2.5", "qwen2", "qwen3"],
        "box answers: qwen2.5 (absolute pixels) or qwen2 / qwen3 (a 0-1000 grid)",
    ] = "qwen2.5",
    sft_targets: Annotated[
        Literal["format", "answers"],
        "warm-start targets: format (random valid answers) or answers (the true ones)",
    ] = "format",
    shape_size: Annotated[
        tuple[float, float], "side of the asked-about shape, (min, max) fraction of size"
    ] = (0.3, 0.5),
    cells: Annotated[
        int, "> 0: the square sits in one cell of a cells x cells grid (0: anywhere)"
    ] = 0,
    background: Annotated[
        Literal["plain", "gradient"], "plain, or a gradient that shows position by colour"
    ] = "plain",
    outline: Annotated[int, "> 0: the square as an outline this many pixels wide"] = 0,
) -> Rows:
    """Write images, ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``, the held-out
    images drawn from another seed (options: see :func:`make_example`)."""
    kw = dict(
        question=question,
        size=size,
        distractors=distractors,
        max_count=max_count,
        box_convention=box_convention,
        sft_targets=sft_targets,
        shape_size=tuple(shape_size),
        cells=cells,
        background=background,
        outline=outline,
    )
    train = make_rows(split.n_train, split.seed, split.out, "train", **kw)
    return train, make_rows(split.n_eval, split.seed + 10_000, split.out, "eval", **kw)


def sft_rows(rows: list[dict]) -> list[dict]:
    """Warm-start rows {"prompt", "images", "response"} (targets chosen at write time)."""
    return [
        {"prompt": r["prompt"], "images": r["images"], "response": r["sft_response"]} for r in rows
    ]


def corpus() -> list[str]:
    """Texts covering every prompt and answer this task produces, in chat form (no image
    tokens), for training the tiny model's tokenizer."""
    answers = [*COLOURS, *(str(k) for k in range(10)), "[12,30,40,52]", "[103,257,964,1000]"]
    prompts = [
        PROMPTS["colour"],
        PROMPTS["count"],
        *(PROMPTS["ground"].format(colour=c) for c in COLOURS),
    ]
    texts = []
    for p in prompts:
        for a in answers:
            texts.append(chat_text(("user", p), ("assistant", a)))
            texts.append(chat_text(("assistant", f"<think>{p}</think><answer>{a}</answer>")))
    texts.extend(chat_text(("system", s)) for s in SYSTEM_WORDS)
    return texts


TASKS.register("vl_shapes", sys.modules[__name__])
