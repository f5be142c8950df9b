"""What the task modules share: held-out splits and chat-form corpus text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from polyrl.core.rollout.data import write_jsonl


def chat_text(*turns: tuple[str, str]) -> str:
    """``(role, content)`` turns as the tiny tokenizers' chat template writes them, so that a
    task's ``corpus()`` trains the merges its prompts and answers will use."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def write_held_out(
    out_dir: str | Path,
    make_rows: Callable[..., list[dict]],
    n_train: int,
    n_eval: int,
    seed: int,
    eval_seed: int,
    **options: object,
) -> tuple[Path, Path]:
    """``train.jsonl`` and ``eval.jsonl`` under ``out_dir``: ``n_eval`` rows drawn with
    ``eval_seed`` first, then ``n_train`` rows with ``seed`` that exclude their uids, so eval
    measures what training never saw. ``make_rows(n, seed, exclude=..., **options)``."""
    eval_rows = make_rows(n_eval, eval_seed, **options)
    train_rows = make_rows(n_train, seed, exclude={r["uid"] for r in eval_rows}, **options)
    out = Path(out_dir).expanduser()
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    write_jsonl(train_path, train_rows)
    write_jsonl(eval_path, eval_rows)
    return train_path, eval_path
