"""Failed rows made visible: a step with no valid row says why, and a run that never had one
fails instead of looking finished.

Rows fail where they are made (an agent or environment that raised, a timeout) or where they
are scored (a reward that raised); either way the record keeps ``valid`` false and the text
in ``error``. :class:`Failures` watches each step's record: a step with no valid row prints
its first error (which names the file and line that raised) and the count on the console;
a run whose steps never had a valid row trained nothing, so :meth:`Failures.check` raises
:class:`RunFailedError` (the CLI exits with status 3, and no model is exported).
"""

from __future__ import annotations

import sys
import traceback
from typing import TextIO

from tensordict import TensorDict

from polyrl.core.record import strings

EXIT_STATUS = 3  # `polyrl train`: the run ran, but no step had a valid row to train on


class RunFailedError(RuntimeError):
    """Every row of every step failed: nothing was trained (``polyrl train`` exits 3)."""


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

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
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
            self.trained = True
            return
        n = record.batch_size[0]
        why = f"first error: {_short(failed[0][1])}" if failed else "no row says why"
        print(
            f"step {step}: no valid row, nothing to train on ({len(failed)} of {n} rows "
            f"failed); {why}",
            file=self.out or sys.stderr,
            flush=True,
        )

    @property
    def failed(self) -> bool:
        """Steps ran and none had a valid row."""
        return self.steps > 0 and not self.trained

    def check(self, samples: str = "samples/") -> None:
        """Raise :class:`RunFailedError` when the run :attr:`failed`."""
        if not self.failed:
            return
        first = (
            f" The first error (step {self.first[0]}): {_short(self.first[1])}."
            if self.first
            else ""
        )
        raise RunFailedError(
            f"no step of this run had a valid row: {self.rows} rows failed over "
            f"{self.steps} steps, so nothing was trained and no model was exported.{first} "
            f"Rows with their errors are in {samples}train_step_*.jsonl; fix the cause "
            "and start the run again."
        )
