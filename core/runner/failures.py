"""Failed rows made visible: a step with no valid row says why, and a run that never had one
fails instead of looking finished.

Rows fail where they are made (an agent or environment that raised, a timeout) or where they
are scored (a reward that raised); either way the record keeps ``valid`` false and the text
in ``error``. :class:`Failures` watches each step's record: a step with no valid row prints
its first error (which names the file and line that raised) and the count on the console;
a run whose steps never had a valid row trained nothing, so :meth:`Failures.check` raises
:class:`RunFailedError` (the CLI exits with status 3, and no model is exported). A run stops
as soon as ``train.max_unscored_steps`` steps in a row had no valid row (:attr:`Failures.stop`):
a reward or agent that fails on every row fails the same way on the next step, so running
the remaining steps would only repeat the failure.
"""

from __future__ import annotations

import sys
import traceback
from typing import TextIO

from tensordict import TensorDict

from polyrl.core.record import strings

EXIT_STATUS = 3  # `polyrl train`: the run ran, but no step had a valid row to train on


class RunFailedError(RuntimeError):
    """Every row of every step failed, or ``train.max_unscored_steps`` steps in a row did:
    the run stops, nothing is exported (``polyrl train`` exits 3)."""


def where(exc: BaseException) -> str:
    """`` (file:line)`` of the innermost frame ``exc`` passed through, for an error text that
    says where a user's code (an agent, a reward, a workflow) raised; empty if unknown."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def failed_rows(record: TensorDict) -> list[tuple[int, str]]:
    """``(row, error)`` of each row that is not valid and says why, in row order."""
    valid = record["valid"].tolist()
    errors = strings(record, "error")
    return [(i, e) for i, (ok, e) in enumerate(zip(valid, errors, strict=True)) if not ok and e]


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Failures:
    """Watches the steps of one run (see the module doc)."""

    def __init__(self, out: TextIO | None = None, max_unscored: int | None = None) -> None:
        self.out = out
        self.max_unscored = max_unscored  # stop after this many steps in a row (None: never)
        self.unscored = 0  # steps in a row, up to the latest, with no valid row
        self.last_trained = 0  # the latest step with a valid row
        self.latest: tuple[int, str] | None = None  # (step, error) of the latest unscored step
        self.steps = 0  # steps watched
        self.trained = False  # some step had a valid row
        self.rows = 0  # failed rows over the watched steps
        self.first: tuple[int, str] | None = None  # (step, error) of the first failed row

    def step(self, step: int, record: TensorDict) -> None:
        """Note one step's record; a step with no valid row says so on the console."""
        self.steps += 1
        failed = failed_rows(record)
        self.rows += len(failed)
        if failed and self.first is None:
            self.first = (step, failed[0][1])
        if bool(record["valid"].any()):
            self.trained, self.unscored, self.last_trained = True, 0, step
            return
        self.unscored += 1
        self.latest = (step, failed[0][1]) if failed else None
        n = record.batch_size[0]
        why = f"first error: {_short(failed[0][1])}" if failed else "no row says why"
        print(
            f"step {step}: no valid row, nothing to train on ({len(failed)} of {n} rows "
            f"failed); {why}",
            file=self.out or sys.stderr,
            flush=True,
        )

    @property
    def stop(self) -> bool:
        """``max_unscored`` steps in a row had no valid row: the run should end now."""
        return self.max_unscored is not None and self.unscored >= self.max_unscored

    @property
    def failed(self) -> bool:
        """Steps ran and none had a valid row."""
        return self.steps > 0 and not self.trained

    def check(self, samples: str = "samples/") -> None:
        """Raise :class:`RunFailedError` when the run :attr:`failed` or had to :attr:`stop`."""
        if not (self.failed or self.stop):
            return
        first = (
            f" The first error (step {self.first[0]}): {_short(self.first[1])}."
            if self.first
            else ""
        )
        early = (
            f" It stopped after {self.unscored} such step(s) in a row "
            f"(train.max_unscored_steps={self.max_unscored}) instead of running on."
            if self.stop
            else ""
        )
        if self.failed:
            raise RunFailedError(
                f"no step of this run had a valid row: {self.rows} rows failed over "
                f"{self.steps} steps, so nothing was trained and no model was exported."
                f"{early}{first} Rows with their errors are in {samples}train_step_*.jsonl; "
                "fix the cause and start the run again."
            )
        latest = (
            f" The latest error (step {self.latest[0]}): {_short(self.latest[1])}."
            if self.latest
            else ""
        )
        raise RunFailedError(
            f"the last {self.unscored} steps had no valid row (train.max_unscored_steps="
            f"{self.max_unscored}), so the run stopped after step "
            f"{self.last_trained + self.unscored} and exported no model; step "
            f"{self.last_trained} was the last that trained.{latest} Rows with their errors "
            f"are in {samples}train_step_*.jsonl; fix the cause and resume from the last "
            "checkpoint (run.resume: true), or raise train.max_unscored_steps."
        )
