"""A one-file environment for the multi_turn workflow: count a number down to zero.

The policy reads "3 left. Say dec." and answers one word per turn; each "dec" lowers the
number, reaching 0 ends the episode with reward 1. Any other word costs ``penalty`` and
changes nothing. The file also holds the task that writes the rows the environment starts
from (``start``) and the texts a tiny tokenizer is trained on, so
``examples/countdown_multi_turn.yaml`` needs nothing else:

    polyrl train examples/countdown_multi_turn.yaml

The recipe names both by file path: ``rollout.args.env: ./countdown_env.py:Countdown`` and
``task.name: ./countdown_env.py:task`` (paths are read beside the recipe).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Annotated

from polyrl.agents import Environment, StepResult


class Countdown(Environment):
    """One episode: say "dec" until the number is 0."""

    def __init__(
        self,
        penalty: Annotated[float, "reward of an answer other than 'dec'"] = -0.1,
    ) -> None:
        self.penalty = penalty
        self.left = 0

    def reset(self, task: dict) -> str:
        self.left = int(task["start"])  # the dataset row this episode plays
        return f"{self.left} left. Say dec."

    def step(self, action: str) -> StepResult:
        if action.strip() != "dec":
            return StepResult(f"{self.left} left. Say dec.", self.penalty, False, {})
        self.left -= 1
        done = self.left == 0
        return StepResult(f"{self.left} left.", float(done), done, {"success": done})


class CountdownTask:
    """The rows episodes start from, and the texts of the game."""

    def write_dataset(
        self,
        out_dir: str | Path,
        seed: int,
        n_train: Annotated[int, "training rows"] = 64,
        n_eval: Annotated[int, "held-out rows"] = 16,
        most: Annotated[int, "largest starting number"] = 3,
    ) -> tuple[Path, Path]:
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 1)):
            rng = random.Random(s)
            rows = []
            for _ in range(n):
                start = rng.randint(1, most)
                rows.append({"prompt": f"{start} left. Say dec.", "start": start, "answer": ""})
            path = out / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            paths.append(path)
        return paths[0], paths[1]

    def corpus(self) -> list[str]:
        """Chat-formatted turns covering every string of the game, answered with any of
        three words: a tiny model pretrained on them answers in the game's words, at
        random, and RL has to find out which one counts down."""
        texts = []
        for k in range(10):
            for word in ("dec", "inc", "wait"):
                texts.append(
                    f"<|im_start|>user\n{k} left. Say dec.<|im_end|>\n"
                    f"<|im_start|>assistant\n{word}<|im_end|>\n"
                    f"<|im_start|>user\n{k} left.<|im_end|>\n"
                )
        return texts


task = CountdownTask()
