"""Demo B of issue 21: a vision-language looker and a text-only solver learn to talk.

The looker (a VL policy) sees a coloured square and says one symbol; the solver (text only)
reads the question and that symbol and names the colour; both get reward 1 when it is
right (``look_and_answer`` in :mod:`polyrl.marl.workflows`). The task is registered in
``TASKS`` as ``"vl_team_colour"``: images and rows, the tokenizer corpus, and warm-start
rows per role.

The warm start teaches formats, and one side a habit, as the signaling game does (there the
speaker has it): the looker learns to say *some* symbol, uniformly and without the image
(its warm-start prompts carry none), so success starts at chance and a looker that has not
been trained by RL stays there; the solver learns to answer a colour, following an
arbitrary symbol -> colour code in a ``solver_bias`` share of its rows. RL must teach the
looker to see the colour and to pick the symbol the solver reads as that colour, and the
solver to keep to (and sharpen) its reading. Images are drawn here rather than taken from
the multimodal plugin's ``vl_shapes`` (plugins do not import each other).
"""

from __future__ import annotations

import random
import sys
from typing import Annotated

from PIL import Image, ImageDraw

from polyrl.core.registry import TASKS
from polyrl.core.tasks.common import Rows, Split, chat_text, split_task
from polyrl.marl.workflows import LOOKER_ROLE, SOLVER_ROLE

COLOURS = {
    "red": (215, 25, 25),
    "green": (30, 170, 50),
    "blue": (35, 70, 230),
    "yellow": (250, 225, 20),
}
SYMBOLS = ("Q", "X", "Z", "J", "V", "W", "Y", "R")
QUESTION = "What colour is the square?"
BACKGROUND = (245, 245, 245)


def solver_prompt(message: str) -> str:
    """What the solver reads: ``look_and_answer``'s default template on this task."""
    return f"{QUESTION}\nThe looker says: {message}"


def draw(colour: str, size: int, rng: random.Random) -> Image.Image:
    """A square of ``colour`` (40-60% of the side) at a random place on a light canvas."""
    img = Image.new("RGB", (size, size), BACKGROUND)
    side = rng.randint(int(0.4 * size), int(0.6 * size))
    x, y = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
    ImageDraw.Draw(img).rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    return img


def solver_code(rng: random.Random, symbols: list[str]) -> dict[str, str]:
    """An arbitrary one-to-one code, symbol -> colour, drawn with the task seed: the
    solver's habit (symbols beyond the colours' count mean nothing to it)."""
    return dict(zip(rng.sample(symbols, len(COLOURS)), COLOURS, strict=True))


@split_task(1000, 100, "episodes")
def write_dataset(
    split: Split,
    size: Annotated[int, "image side in pixels"] = 56,
    n_symbols: Annotated[int, "symbols the looker may say (>= the 4 colours)"] = 6,
    solver_bias: Annotated[
        float, "share of the solver's warm-start rows that follow its symbol -> colour code"
    ] = 0.75,
) -> Rows:
    """PNG images under ``images/`` and ``train.jsonl`` / ``eval.jsonl``: one image an
    episode, held-out images never trained on, colours uniform. ``solver_bias``: the share
    of the solver's warm-start rows that read a coded symbol by the code (the rest answer a
    random colour); 0 is format only on both sides, which leaves RL a symmetry to break."""
    if not len(COLOURS) <= n_symbols <= len(SYMBOLS):
        raise ValueError(
            f"task.args.n_symbols must be in {len(COLOURS)}..{len(SYMBOLS)} (one symbol per "
            f"colour at least), got {n_symbols}"
        )
    if not 0.0 <= solver_bias <= 1.0:
        raise ValueError(f"task.args.solver_bias must be in [0, 1], got {solver_bias}")
    if size < 28:
        raise ValueError(f"task.args.size must be >= 28 pixels (two vision patches), got {size}")
    rng = random.Random(split.seed)
    symbols = list(SYMBOLS[:n_symbols])
    code = solver_code(rng, symbols)
    (split.out / "images").mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {"train": [], "eval": []}
    for name, n in (("train", split.n_train), ("eval", split.n_eval)):
        for i in range(n):
            colour = rng.choice(list(COLOURS))
            image = f"images/{name}_{i:05d}.png"
            draw(colour, size, rng).save(split.out / image)
            row = {"prompt": f"<image>{QUESTION}", "images": image, "answer": colour}
            row |= {"uid": f"{name}{i}", "symbols": symbols}
            if name == "train":
                row["code"], row["bias"] = code, solver_bias
            rows[name].append(row)
    return rows["train"], rows["eval"]


def sft_rows(rows: list[dict]) -> list[dict]:
    """Warm-start rows for both roles (each policy trains on all; the role prompts tell
    them apart). The looker's prompts hold no image: it learns to say a uniformly random
    symbol, so its warm start cannot tell colours apart."""
    out = []
    for i, row in enumerate(rows):
        rng = random.Random(f"{row['uid']}#{i}")
        symbols, code = row["symbols"], row.get("code") or {}
        looker = [{"role": "system", "content": LOOKER_ROLE}, {"role": "user", "content": QUESTION}]
        out.append({"prompt": looker, "response": rng.choice(symbols)})
        heard = rng.choice(symbols)
        habit = heard in code and rng.random() < row.get("bias", 0.0)
        answer = code[heard] if habit else rng.choice(list(COLOURS))
        solver = [
            {"role": "system", "content": SOLVER_ROLE},
            {"role": "user", "content": solver_prompt(heard)},
        ]
        out.append({"prompt": solver, "response": answer})
    return out


def corpus() -> list[str]:
    """Every text both roles see or say, in chat form, for the offline tokenizers."""
    texts = []
    for sym in SYMBOLS:
        looker = (("system", LOOKER_ROLE), ("user", QUESTION))
        texts.append(chat_text(*looker, ("assistant", sym)))
        solver = (("system", SOLVER_ROLE), ("user", solver_prompt(sym)))
        texts.extend(chat_text(*solver, ("assistant", colour)) for colour in COLOURS)
    return texts


TASKS.register("vl_team_colour", sys.modules[__name__])
