"""Training progress on the console: reward, accuracy and speed as the run goes.

On a terminal a rich progress bar; elsewhere (a log file, a pipe, a batch job) one line per
step, printed as the step ends, since a bar there would show only when the run is over.
"""

from __future__ import annotations

import math
import sys
from typing import Any

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
        self.enabled, self.total = enabled, total
        # floats; typed Any as they pass on as rich's free task fields (**fields: Any)
        self.stats: dict[str, Any] = {
            "reward": float("nan"),
            "acc": float("nan"),
            "s_step": float("nan"),
            "tok_s": float("nan"),  # generated tokens per second (perf/gen_tokens_per_s)
            "mfu": float("nan"),  # model FLOPs utilisation of the step (perf/mfu)
        }
        self._bar = None
        if enabled:
            bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "reward {task.fields[reward]:.3f}  acc {task.fields[acc]:.3f}  "
                    "{task.fields[s_step]:.2f}s/step  {task.fields[tok_s]:.0f} tok/s  "
                    "mfu {task.fields[mfu]:.1%}"
                ),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            if bar.console.is_terminal:
                self._bar = bar
                self._task = bar.add_task("train", total=total, completed=start, **self.stats)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stop the bar however the block ends; an error goes on up."""
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, metrics: dict[str, float], *, final: bool = False) -> None:
        """Show ``step``'s metrics; ``final``: the run's final evaluation (after the last step)."""
        self.stats["reward"] = metrics.get("reward/mean", self.stats["reward"])
        self.stats["acc"] = metrics.get("eval/accuracy", self.stats["acc"])
        self.stats["s_step"] = metrics.get("time/step_s", self.stats["s_step"])
        self.stats["tok_s"] = metrics.get("perf/gen_tokens_per_s", self.stats["tok_s"])
        self.stats["mfu"] = metrics.get("perf/mfu", self.stats["mfu"])
        if self._bar is not None:
            self._bar.update(self._task, completed=step, **self.stats)
        elif self.enabled:
            r, a, t = self.stats["reward"], self.stats["acc"], self.stats["s_step"]
            if final:
                what = "final eval"
            elif "time/step_s" in metrics:
                tok, mfu = self.stats["tok_s"], self.stats["mfu"]
                perf = f"{tok:.0f} tok/s  " if math.isfinite(tok) else ""
                perf += f"mfu {mfu:.1%}  " if math.isfinite(mfu) else ""
                what = f"{perf}{t:.2f}s/step"
            else:
                what = "eval"  # the evaluation before the first step
            print(
                f"train {step}/{self.total}  reward {r:.3f}  acc {a:.3f}  {what}",
                file=sys.stdout,
                flush=True,
            )
