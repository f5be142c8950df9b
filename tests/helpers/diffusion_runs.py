"""What the diffusion end-to-end tests share: a recipe's tiny model built once, and
``polyrl train`` on a recipe as a one-thread child process on that model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

EXAMPLES = Path(__file__).parents[2] / "examples"


def build_model(recipe: Path, tmp_path_factory, name: str) -> str:
    """The model of ``recipe``'s main policy (its ``build`` with its ``build_args``:
    pre-training included), built once with one thread under a fresh temp folder."""
    import polyrl.diffusion  # noqa: F401  (registers the builders)
    from polyrl.core.registry import MODELS

    main = yaml.safe_load(recipe.read_text())["policies"]["main"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        path = MODELS.get(main["build"])(
            tmp_path_factory.mktemp("models") / name, **main["build_args"]
        )
        print(f"built {main['build']} ({name}) in {time.perf_counter() - t0:.0f}s")
    finally:
        torch.set_num_threads(threads)
    return str(path)


def run_recipe(recipe: Path, model: str, run_dir: Path, seed: int, *overrides: str):
    """``polyrl train recipe`` as a child process (one thread) on the pre-built ``model``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "polyrl.core.runner.cli",
        "train",
        str(recipe),
        f"seed={seed}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.export=false",
        f"policies.main.model={model}",
        "policies.main.build=null",  # built once by the test's fixture
        "policies.main.build_args=null",
        *overrides,
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def metrics(run_dir: Path) -> list[dict]:
    """Every line of the run's ``metrics.jsonl``."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait(runs: dict, timeout: float = 900) -> None:
    """Every child run to its end; one that fails fails the test with its output's tail."""
    for key, proc in runs.items():
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"run {key!r} failed:\n{out[-3000:]}"


def check_colour_learns(run_dir: Path, seed: int) -> None:
    """The colour demo's bar: the reward (mean of the first 3 vs the last 5 training steps)
    rises by more than 0.4, and the named colour is right in at least 90% of the final ODE
    evaluation's images and of the last 5 training steps' samples."""
    rows = metrics(run_dir)
    train = [r for r in rows if r.get("reward/mean") is not None]
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    first = sum(r["reward/mean"] for r in train[:3]) / 3
    last = sum(r["reward/mean"] for r in train[-5:]) / 5
    acc = sum(r["reward/colour_accuracy/mean"] for r in train[-5:]) / 5
    print(
        f"seed {seed}: reward {first:.3f} -> {last:.3f}; colour right {evals[0]:.2f} -> "
        f"{evals[-1]:.2f} (eval, ODE), {acc:.2f} (last 5 training steps)"
    )
    assert last > first + 0.4, (seed, first, last)
    assert evals[-1] >= 0.9 and acc >= 0.9, (seed, evals, acc)
