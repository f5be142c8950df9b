"""A zoom tool and the ``vl_zoom`` task: read a detail the base view cannot resolve.

:func:`crop` is the tool: the model names a region (a quadrant 1-4, or a box of 0-1
fractions) and gets it back from the full-resolution source at ``size`` pixels, far finer
than the view it had. It is a plain typed function, so agents' ``tool`` can wrap it for a
``ToolEnv``; this plugin uses it in its own environment, registered in the core's
``ENVIRONMENTS`` (plugins never import each other).

The ``vl_zoom`` task: a 448x448 scene of grey blotches (tinted at random per quadrant
and per blotch) holds four dots, 200 pixels across, one per quadrant, in the four colours
(a random permutation). The question names a quadrant, last ("Zoom 1-4 or say the colour
of the dot in the top left, quadrant 1"). The first observation is the scene as a 1x1
thumbnail blown up to 56x56: whatever the permutation, the dots add the same mean colour,
so the view tells nothing about which colour is where. The policy answers a colour word
(the episode ends, reward 1 when right) or says ``zoom k`` (k = 1 top left, 2 top right, 3
bottom left, 4 bottom right) and gets that quadrant at 56x56 (its dot 50 pixels across),
then must answer. With ``tool: false`` a zoom is refused in words and the policy answers
from the thumbnail alone.

Each scene is asked about all four quadrants, in four consecutive rows: read in order, a
step's batch holds whole scenes, so a zoom that pays whatever the question cancels out
within the step. The warm start (:func:`sft_rows`) teaches the format of the first turn
(every ``zoom k`` equally for each question) and to read the colour of a zoomed dot (the
second turn after the right zoom). Which quadrant to zoom, and to zoom at all rather than
guess, is left to RL.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Annotated

from PIL import Image, ImageDraw

from polyrl.core.registry import ENVIRONMENTS, TASKS
from polyrl.core.tasks.common import Rows, Split, chat_text, split_task
from polyrl.multimodal.shapes import COLOURS

SCENE = 448  # source side in pixels
DOT_RADIUS = 100  # the dot fills most of a zoomed quadrant
THUMB = 1  # side of the base thumbnail
QUADRANTS = {1: "top left", 2: "top right", 3: "bottom left", 4: "bottom right"}
QUESTION = "Zoom 1-4 or say the colour of the dot in the {where}, quadrant {k}"
ZOOMED = "zoom {k}:"
NO_TOOL = "zoom is not available; answer with a colour."


def crop(image: Image.Image, region: int | tuple[float, float, float, float], size: int):
    """``region`` of ``image`` at ``size`` x ``size`` pixels (box-filtered).

    Args:
        image: the full-resolution source
        region: a quadrant 1-4 (top left, top right, bottom left, bottom right) or a box
            (x0, y0, x1, y1) in fractions of the width and height
        size: side of the returned image
    """
    w, h = image.size
    if isinstance(region, int):
        if region not in QUADRANTS:
            raise ValueError(f"zoom: quadrant must be 1-4, got {region}")
        col, row = (region - 1) % 2, (region - 1) // 2
        box = (col * w // 2, row * h // 2, (col + 1) * w // 2, (row + 1) * h // 2)
    else:
        x0, y0, x1, y1 = region
        if not (0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1):
            raise ValueError(
                f"zoom: a box needs 0 <= x0 < x1 <= 1, 0 <= y0 < y1 <= 1; got {region}"
            )
        box = (round(x0 * w), round(y0 * h), round(x1 * w), round(y1 * h))
    return image.crop(box).resize((size, size), Image.Resampling.BOX)


def draw_scene(rng: random.Random, order: list[str] | None = None) -> tuple[Image.Image, list[str]]:
    """A scene and its dots' colours by quadrant (1-4): a random permutation of the four
    colours, or ``order``."""
    blotch = 8  # grey blotches of 56 pixels, tinted per quadrant and per blotch at random
    img = Image.new("RGB", (SCENE, SCENE))
    draw = ImageDraw.Draw(img)
    step = SCENE // blotch
    quadrant_tint = [[rng.randint(-40, 40) for _ in range(3)] for _ in range(4)]
    for by in range(blotch):
        for bx in range(blotch):
            q = quadrant_tint[(by * 2 // blotch) * 2 + bx * 2 // blotch]
            tint = tuple(128 + q[c] + rng.randint(-30, 30) for c in range(3))
            draw.rectangle([bx * step, by * step, (bx + 1) * step - 1, (by + 1) * step - 1], tint)
    colours = list(COLOURS)
    rng.shuffle(colours)
    colours = list(order) if order is not None else colours
    half, radius = SCENE // 2, DOT_RADIUS
    for k, colour in enumerate(colours):
        col, row = k % 2, k // 2
        cx = col * half + rng.randint(radius + 4, half - radius - 4)
        cy = row * half + rng.randint(radius + 4, half - radius - 4)
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], COLOURS[colour])
    return img, colours


def base_view(image: Image.Image, thumb: int, size: int) -> Image.Image:
    """The scene as a ``thumb`` x ``thumb`` thumbnail blown up to ``size`` (pixelated)."""
    small = image.resize((thumb, thumb), Image.Resampling.BOX)
    return small.resize((size, size), Image.Resampling.NEAREST)


_ZOOM = re.compile(r"^\s*zoom\s*([1-4])\s*$")


class ZoomEnv:
    """The ``vl_zoom`` environment (see the module docstring); one instance per episode."""

    max_turns = 2

    def __init__(
        self,
        tool: Annotated[
            bool, "zoom is available (false: refused, answer from the base view)"
        ] = True,
        thumb: Annotated[int, "side of the base thumbnail in pixels"] = THUMB,
        view: Annotated[int, "side of the base view and of a zoom, in pixels"] = 56,
    ) -> None:
        self.tool, self.thumb, self.view = tool, thumb, view

    def reset(self, task: dict):
        self.scene, _ = draw_scene(random.Random(task["scene_seed"]))
        self.answer, self.zooms = task["answer"], 0
        return [base_view(self.scene, self.thumb, self.view), task["prompt"]]

    def step(self, action: str):
        m = _ZOOM.match(action)
        if m and self.zooms == 0:
            self.zooms += 1
            if not self.tool:
                return NO_TOOL, 0.0, False, {"zoomed": False}
            k = int(m.group(1))
            zoomed = crop(self.scene, k, self.view)
            return [ZOOMED.format(k=k), zoomed], 0.0, False, {"zoomed": True}
        right = action.strip().lower() == self.answer
        return ("right" if right else "wrong"), float(right), True, {"success": right}


ENVIRONMENTS.register("vl_zoom", ZoomEnv)


# --------------------------------------------------------------------------- the task


def make_rows(n: int, seed: int, out: Path, split: str) -> list[dict]:
    """``n`` scenes (each drawn again from its ``scene_seed`` by the environment), each asked
    about all four quadrants in four consecutive rows, with the warm-start views (base, the
    asked quadrant) saved as PNG."""
    rng = random.Random(seed)
    (out / "zoom" / split).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        scene_seed = rng.randrange(2**31)
        img, colours = draw_scene(random.Random(scene_seed))
        base_path = out / "zoom" / split / f"{i:06d}_base.png"
        base_view(img, THUMB, 56).save(base_path)
        for k, where in QUADRANTS.items():
            zoom_path = base_path.with_name(f"{i:06d}_z{k}.png")
            crop(img, k, 56).save(zoom_path)
            rows.append(
                {
                    "prompt": QUESTION.format(k=k, where=where),
                    "answer": colours[k - 1],
                    "colours": colours,
                    "scene_seed": scene_seed,
                    "quadrant": k,
                    "sft_images": [str(base_path), str(zoom_path)],
                }
            )
    return rows


@split_task(128, 50, "scenes")
def write_dataset(split: Split) -> Rows:
    """Write scenes, ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``: four rows a scene,
    one per quadrant, the held-out scenes drawn from another seed."""
    out = split.out.resolve()  # the rows name their images by absolute path
    train = make_rows(split.n_train, split.seed, out, "train")
    return train, make_rows(split.n_eval, split.seed + 10_000, out, "eval")


def sft_rows(rows: list[dict]) -> list[dict]:
    """Five warm-start rows per question: turn one once with each ``zoom k`` (so the warm
    start's first turn is uniform over k for every question: RL has all four to choose
    from), and turn two (the dot's colour, after the zoom that shows it)."""
    out = []
    for r in rows:
        first = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["prompt"]}]}
        ]
        second = [
            *first,
            {"role": "assistant", "content": f"zoom {r['quadrant']}"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": ZOOMED.format(k=r["quadrant"])},
                    {"type": "image"},
                ],
            },
        ]
        out += [
            {"prompt": first, "images": r["sft_images"][:1], "response": f"zoom {k}"}
            for k in QUADRANTS
        ]
        out.append({"prompt": second, "images": r["sft_images"], "response": r["answer"]})
    return out


def corpus() -> list[str]:
    """Every text the task produces, in chat form, for the tiny model's tokenizer."""
    texts = []
    for k, where in QUADRANTS.items():
        q = QUESTION.format(k=k, where=where)
        for a in [*COLOURS, *(f"zoom {k}" for k in QUADRANTS)]:
            texts.append(chat_text(("user", q), ("assistant", a)))
    for k in QUADRANTS:
        texts.append(chat_text(("user", ZOOMED.format(k=k))))
    texts += [chat_text(("user", t)) for t in (NO_TOOL, "right", "wrong")]
    return texts


TASKS.register("vl_zoom", sys.modules[__name__])
