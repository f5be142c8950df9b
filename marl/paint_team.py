"""A team of three model kinds: an LLM writer, a diffusion painter and a VLM judge.

The ``paint_team`` workflow: the writer sees a hidden goal (``ep.task``, e.g. "Goal:
red") and writes a short prompt (``rollout.n`` of them); the painter paints ``images``
pictures from each prompt alone (``team["painter"].paint``: an image request of the core's
episode runtime, served by the diffusion engine with every waiting request in one call);
the judge sees each picture alone and answers ``question`` (``judge_n`` answers per
picture). One joint action per (prompt, picture, answer): its final text is the judge's
answer, its ``images`` the picture, so image rewards (``colour``, ``colour_accuracy``) score
the pixels against the row's answer, and ``colour_named`` the judge's answer against the
pixels (it read the picture right; with ``goal: true``, right and the goal: the chain held).

Credit (``magrpo``; marl/README.md, "Teams that paint"): the writer's value is the mean
return of its subtree (its pictures and their answers); the painter's pictures of one
prompt form its group (per-prompt statistics, as Flow-GRPO: the writer held fixed); the
judge's answers of one picture form its group when ``judge_n > 1`` (the picture held
fixed), else the judge's rows of the row's goal do.

The task ``paint_team`` (``TASKS``) writes goals (a colour; the painter's palette), the
writer's and judge's warm-start rows (the writer names a random colour, blind to the goal,
except on the ``writer_hint`` share of rows where it names it; the judge a random colour,
its prompts hold no image: format only) and the corpus.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Annotated

from polyrl.core.registry import TASKS
from polyrl.core.tasks.common import chat_text, write_splits
from polyrl.marl.runtime import workflow

COLOURS = ("red", "green", "blue", "yellow")  # the tiny painters' palette (diffusion colour)
WRITER_ROLE = "Write the painter a prompt for the goal."
JUDGE_ROLE = "Answer in one word."
QUESTION = "What colour is the blob?"


def goal_text(colour: str) -> str:
    """What the writer sees: the hidden goal."""
    return f"Goal: {colour}"


@workflow(
    "paint_team",
    agents={"writer": WRITER_ROLE, "painter": "", "judge": JUDGE_ROLE},
    painters=("painter",),
    lookers=("judge",),
)
async def paint_team(
    ep,
    team,
    images: Annotated[int, "pictures the painter paints per prompt (its advantage group)"] = 4,
    judge_n: Annotated[
        int, "answers the judge gives per picture (> 1: its advantage group is the picture)"
    ] = 1,
    question: Annotated[str, "what the judge is asked beside the picture"] = QUESTION,
):
    """Writer -> painter -> judge; see the module docstring."""
    if images < 1 or judge_n < 1:
        raise ValueError(f"paint_team: images and judge_n must be >= 1, got {images}, {judge_n}")
    prompts = await team["writer"].act(str(ep.task), n=ep.G)
    pictures = await ep.gather(team["painter"].paint(p, n=images) for p in prompts)
    lines = [(p, pic) for p, pics in zip(prompts, pictures, strict=True) for pic in pics]
    answers = await ep.gather(
        team["judge"].act(
            [pic.to_pil(), question], n=judge_n, group=("picture", k) if judge_n > 1 else None
        )
        for k, (_, pic) in enumerate(lines)
    )
    for (prompt, pic), said in zip(lines, answers, strict=True):
        for answer in said:
            ep.joint([prompt, pic, answer], final=answer.text)


# ------------------------------------------------------------------------------- the task


def write_dataset(
    out_dir: str | Path,
    seed: int,
    n_train: Annotated[int, "training goals, each a random colour"] = 512,
    per_colour_eval: Annotated[int, "held-out goals per colour"] = 8,
    writer_hint: Annotated[
        float,
        "share of the writer's warm-start rows that name their goal (the rest name a random "
        "colour): 0 is a writer blind to its goal, 1 one that already names it",
    ] = 0.0,
) -> tuple[Path, Path]:
    """``train.jsonl`` / ``eval.jsonl``: ``{"prompt": "Goal: red", "answer": "red"}``; a
    training row with ``"warm": true`` is one whose warm-start writer names its goal."""
    if n_train < 1 or per_colour_eval < 1:
        raise ValueError("task.args.n_train and per_colour_eval must be >= 1")
    if not 0.0 <= writer_hint <= 1.0:
        raise ValueError(f"task.args.writer_hint must be in [0, 1], got {writer_hint}")
    rng = random.Random(seed)
    train = [rng.choice(COLOURS) for _ in range(n_train)]
    held = [c for c in COLOURS for _ in range(per_colour_eval)]
    hint = random.Random(f"{seed}#hint")  # its own stream: the goals stay those of seed
    rows = {
        split: [
            {"prompt": goal_text(c), "answer": c, "uid": f"{split}{i}"} for i, c in enumerate(goals)
        ]
        for split, goals in (("train", train), ("eval", held))
    }
    for row in rows["train"]:
        if hint.random() < writer_hint:
            row["warm"] = True
    return write_splits(out_dir, rows["train"], rows["eval"])


def sft_rows(rows: list[dict]) -> list[dict]:
    """Warm-start rows for the writer and the judge (each text policy trains on all; the
    role prompts tell them apart): the writer names its goal on rows marked ``warm``
    (``writer_hint`` of them), else a uniformly random colour, the judge a uniformly random colour,
    without an image (format only)."""
    out = []
    for i, row in enumerate(rows):
        rng = random.Random(f"{row['uid']}#{i}")
        writer = [
            {"role": "system", "content": WRITER_ROLE},
            {"role": "user", "content": row["prompt"]},
        ]
        said = rng.choice(COLOURS)  # drawn either way: the judge's rows stay as they were
        out.append({"prompt": writer, "response": row["answer"] if row.get("warm") else said})
        judge = [{"role": "system", "content": JUDGE_ROLE}, {"role": "user", "content": QUESTION}]
        out.append({"prompt": judge, "response": rng.choice(COLOURS)})
    return out


def corpus() -> list[str]:
    """Every text the writer and the judge see or say, in chat form (offline tokenizers)."""
    texts = []
    for goal in COLOURS:
        for said in COLOURS:
            writer = (("system", WRITER_ROLE), ("user", goal_text(goal)), ("assistant", said))
            texts.append(chat_text(*writer))
    for said in COLOURS:
        texts.append(chat_text(("system", JUDGE_ROLE), ("user", QUESTION), ("assistant", said)))
    return texts


TASKS.register("paint_team", sys.modules[__name__])
