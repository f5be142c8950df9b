"""Synthetic single-turn arithmetic ("12+7=" -> "19"), the first GRPO demo task.

It is small enough that a tiny model learns it on CPU in minutes, and its answers are checked
exactly, so a rising reward curve means learning rather than noise. Train and eval problems
are disjoint, so eval accuracy measures generalisation to unseen operand pairs.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

from polyrl.core.registry import RECIPES, TASKS
from polyrl.core.tasks.common import Rows, Split, chat_text, held_out, split_task

OPS = "+-*"
STYLES = ("bare", "question")
ROLES = ("system", "user", "assistant")


def _check(max_operand: int, ops: str, style: str) -> None:
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {OPS!r}, got {ops!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def _problems(max_operand: int, ops: str) -> list[tuple[int, str, int]]:
    """Every distinct problem; subtraction keeps a >= b so answers stay non-negative."""
    probs = []
    for op in dict.fromkeys(ops):
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and a < b:
                    continue
                probs.append((a, op, b))
    return probs


def solve(a: int, op: str, b: int) -> int:
    """The exact answer of ``a op b``."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown op {op!r}")


def render(a: int, op: str, b: int, style: str = "bare") -> str:
    """Prompt text; kept to a handful of tokens because the demo model is tiny."""
    expr = f"{a}{op}{b}"
    return f"{expr}=" if style == "bare" else f"What is {expr}?"


def make_rows(
    n: int,
    seed: int,
    max_operand: int = 20,
    ops: str = "+",
    *,
    style: str = "bare",
    exclude: Iterable[str] = (),
) -> list[dict]:
    """``n`` rows {"prompt", "answer", "uid"}, distinct while the problem space allows.

    Problems whose uid is in ``exclude`` are never drawn (this is how eval stays held out).
    When ``n`` exceeds the remaining problems, the pool is reshuffled and drawn again.
    """
    _check(max_operand, ops, style)
    banned = set(exclude)
    pool = [p for p in _problems(max_operand, ops) if f"{p[0]}{p[1]}{p[2]}" not in banned]
    if n > 0 and not pool:
        raise ValueError("no problems left to draw; raise max_operand or add ops")
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < n:
        order = pool[:]
        rng.shuffle(order)
        for a, op, b in order[: n - len(rows)]:
            rows.append(
                {
                    "prompt": render(a, op, b, style),
                    "answer": str(solve(a, op, b)),
                    "uid": f"{a}{op}{b}",
                }
            )
    return rows


@split_task(None, None, "problems")
def write_dataset(
    split: Split,
    max_operand: Annotated[int, "operands run over 0..max_operand"] = 20,
    ops: Annotated[str, "operators to draw from, a subset of '+-*'"] = "+",
    style: Annotated[str, "bare: '12+7='; question: 'What is 12+7?'"] = "bare",
) -> Rows:
    """Write train.jsonl and eval.jsonl under ``out_dir`` with disjoint problems: the
    held-out ones all distinct and never in train, training ones repeating when the space
    is smaller than ``n_train``."""
    _check(max_operand, ops, style)
    total = len(_problems(max_operand, ops))
    if split.n_eval >= total:
        raise ValueError(f"n_eval={split.n_eval} leaves no training problems (only {total} exist)")
    options = {"max_operand": max_operand, "ops": ops, "style": style}
    return held_out(make_rows, split, split.seed + 1, **options)


def sft_rows(rows: Iterable[dict]) -> list[dict]:
    """{"prompt", "response"} pairs with the correct answer, for the SFT warm start."""
    return [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]


def corpus(max_operand: int = 20) -> list[str]:
    """Texts that cover every string this task and its SFT targets produce, in chat form.

    The tokenizer is trained on these, so its merges fit the chat headers and prompt words.
    """
    texts = []
    for a, op, b in _problems(max_operand, OPS):
        for style in STYLES:
            texts.append(
                chat_text(("user", render(a, op, b, style)), ("assistant", str(solve(a, op, b))))
            )
    texts.extend(chat_text((role, "")) for role in ROLES)
    return texts


TASKS.register("arithmetic", sys.modules[__name__])
RECIPES.register("arithmetic", Path(__file__).parents[1] / "recipes" / "arithmetic_grpo.yaml")
