"""A rich progress bar that shows reward and accuracy as training runs."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.stats = {"reward": float("nan"), "acc": float("nan"), "s_step": float("nan")}
        if enabled:
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "reward {task.fields[reward]:.3f}  acc {task.fields[acc]:.3f}  "
                    "{task.fields[s_step]:.2f}s/step"
                ),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("train", total=total, completed=start, **self.stats)

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.__exit__(*exc)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self.stats["reward"] = metrics.get("reward/mean", self.stats["reward"])
        self.stats["acc"] = metrics.get("eval/accuracy", self.stats["acc"])
        self.stats["s_step"] = metrics.get("time/step_s", self.stats["s_step"])
        if self.enabled:
            self._bar.update(self._task, completed=step, **self.stats)
