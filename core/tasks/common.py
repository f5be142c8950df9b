"""What the task modules share: the train/held-out split, and chat-form corpus text.

A task that writes ``n_train`` training rows and ``n_eval`` held-out rows declares only its
own options and how it makes its rows; :func:`split_task` turns that row maker into the
task's ``write_dataset`` (:class:`polyrl.core.interfaces.Task`), whose options are the two
counts and the row maker's keyword parameters, as a recipe gives them flat in
``task.args``::

    @split_task(64, 32, "maps")  # n_train, n_eval: "training maps", "held-out maps"
    def write_dataset(
        split: Split, size: Annotated[int, "maps are size x size cells"] = 3
    ) -> tuple[list[dict], list[dict]]:
        '''Maps of ``size`` x ``size`` cells; held-out maps never appear in training.'''
        return held_out(make_rows, split, split.seed + 1, size=size)
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from polyrl.core.rollout.data import write_jsonl

Rows = tuple[list[dict], list[dict]]  # (training rows, held-out rows)


@dataclasses.dataclass(frozen=True)
class Split:
    """What every split task's row maker is asked for: the folder the data goes to (``out``,
    for the files rows point at, such as images), the run's ``seed``, and how many training
    (``n_train``) and held-out (``n_eval``) rows to make. A recipe gives the counts in
    ``task.args``, beside the task's own options."""

    out: Path
    seed: int
    n_train: int
    n_eval: int


def write_splits(
    out_dir: str | Path, train_rows: list[dict], eval_rows: list[dict]
) -> tuple[Path, Path]:
    """``train.jsonl`` and ``eval.jsonl`` under ``out_dir``; their paths, as a task's
    ``write_dataset`` returns them."""
    out = Path(out_dir).expanduser()
    return write_jsonl(out / "train.jsonl", train_rows), write_jsonl(out / "eval.jsonl", eval_rows)


def held_out(
    make_rows: Callable[..., list[dict]],
    split: Split,
    eval_seed: int,
    *args: object,
    **options: object,
) -> Rows:
    """Training and held-out rows that share no uid: ``split.n_eval`` rows drawn with
    ``eval_seed`` first, then ``split.n_train`` rows with ``split.seed`` that exclude their
    uids, so eval measures what training never saw. ``make_rows(n, seed, *args,
    exclude=..., **options)``."""
    eval_rows = make_rows(split.n_eval, eval_seed, *args, **options)
    exclude = {r["uid"] for r in eval_rows}
    return make_rows(split.n_train, split.seed, *args, exclude=exclude, **options), eval_rows


def split_task(
    n_train: int | None, n_eval: int | None, rows: str
) -> Callable[[Callable[..., Rows]], Callable[..., tuple[Path, Path]]]:
    """A task's ``write_dataset(out_dir, *, seed, n_train, n_eval, **options)`` made from
    its row maker ``make(split, **options) -> (training rows, held-out rows)``.

    ``split`` is the :class:`Split`; the row maker's keyword parameters after it are the
    task's own options (``Annotated[T, "doc"]`` documents one, as for any part), and its
    docstring says what the rows are. ``n_train`` and ``n_eval`` are the counts' defaults
    (None: a recipe must give it), documented as "training <rows>" and "held-out <rows>".
    The rows are written to ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``.
    """

    def count(name: str, default: int | None, doc: str) -> inspect.Parameter:
        return inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if default is None else default,
            annotation=Annotated[int, doc],
        )

    def wrap(make: Callable[..., Rows]) -> Callable[..., tuple[Path, Path]]:
        # The task's options, as the registry reads them (polyrl.core.options.derive) and
        # as a call is checked against them: the counts, then the row maker's own keyword
        # parameters with their resolved types.
        hints = typing.get_type_hints(make, include_extras=True)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, Any))
            for p in list(inspect.signature(make).parameters.values())[1:]
        ]
        params = [
            inspect.Parameter(
                "out_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str | Path
            ),
            inspect.Parameter("seed", inspect.Parameter.KEYWORD_ONLY, annotation=int),
            count("n_train", n_train, f"training {rows}"),
            count("n_eval", n_eval, f"held-out {rows}"),
            *own,
        ]
        sig = inspect.Signature(params, return_annotation=tuple[Path, Path])

        def write_dataset(*args: Any, **kwargs: Any) -> tuple[Path, Path]:
            call = sig.bind(*args, **kwargs)  # a TypeError names a missing or unknown option
            call.apply_defaults()
            options = dict(call.arguments)
            out = Path(options.pop("out_dir")).expanduser()
            split = Split(out, options.pop("seed"), options.pop("n_train"), options.pop("n_eval"))
            return write_splits(out, *make(split, **options))

        write_dataset.__signature__ = sig  # type: ignore[attr-defined]
        write_dataset.__annotations__ = {p.name: p.annotation for p in params} | {
            "return": sig.return_annotation
        }
        write_dataset.__doc__ = make.__doc__
        write_dataset.__module__ = make.__module__
        write_dataset.__qualname__ = make.__qualname__
        return write_dataset

    return wrap


def chat_text(*turns: tuple[str, str]) -> str:
    """``(role, content)`` turns as the tiny tokenizers' chat template writes them, so that a
    task's ``corpus()`` trains the merges its prompts and answers will use."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
