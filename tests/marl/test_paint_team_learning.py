"""The paint team's demo (``examples/paint_team.yaml``, issue 40) learns: one seed's first
40 steps in CI, and under ``-m seeds`` the three-way comparison at seeds 0-2 (joint training
against a frozen painter and a frozen writer, from the same warm start). A file of its own,
so that the test runner can give it a worker of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paint_team import step_metrics

EXAMPLE = Path(__file__).parents[2] / "examples" / "paint_team.yaml"


def _train(run_dir: Path, seed: int, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "polyrl.core.runner.cli", "train", str(EXAMPLE), f"seed={seed}",
           f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false",
           "run.export=false", *overrides]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _evals(run_dir: Path) -> list[tuple[int, float]]:
    """Held-out success (``colour_accuracy``: the writer samples 4 prompts per goal, the ODE
    painter paints 4 pictures of each) at each evaluation: ``[(step, success), ...]``."""
    return [(m["step"], m["eval/accuracy"]) for m in step_metrics(run_dir, "eval/accuracy")]


def _judge_reads(run_dir: Path) -> tuple[float, float]:
    """The judge's training ``colour_named`` (it named the picture's main colour), the mean of
    the first and of the last ten steps."""
    key = "reward/colour_named/mean"
    named = [m[key] for m in step_metrics(run_dir, key)]
    return sum(named[:10]) / 10, sum(named[-10:]) / 10


def _held_out(run_dir: Path) -> float:
    """The mean held-out success of the last two evaluations."""
    evals = [a for _, a in _evals(run_dir)]
    return sum(evals[-2:]) / len(evals[-2:])


# The judge's reading (training colour_named), its last ten steps over its first ten, in the
# CI seed's 40 steps and the seeds' 80 (measured: +0.12 or more in 40, +0.067 to +0.35 in 80).
JUDGE_GAIN = 0.05

# The three ways, each from the same warm start: a frozen member takes its warm start and
# no RL (lr 0: ``optim.lr`` documents it); the painter's warm start is its offline pretraining.
WAYS = {
    "joint": (),
    "frozen_painter": ("policies.painter.train=false",),
    "frozen_writer": ("policies.writer.optim.lr=0",),
}


def _compare(tmp_path: Path, seed: int) -> dict[str, float]:
    """Joint training, a frozen painter, a frozen writer: held-out success of each, two at a
    time (the machine has 2 cores; each run takes one thread)."""
    procs = {}
    got = {}
    for name, extra in WAYS.items():
        if len(procs) == 2:
            _finish(procs, got, tmp_path)
        procs[name] = _train(tmp_path / name, seed, f"task.dir={tmp_path}/data_{name}", *extra)
    while procs:
        _finish(procs, got, tmp_path)
    print(f"seed {seed}: " + ", ".join(f"{k} {got[k]:.3f} {_evals(tmp_path / k)}" for k in WAYS))
    return got


def _finish(procs: dict[str, subprocess.Popen], got: dict[str, float], tmp_path: Path) -> None:
    name, proc = next(iter(procs.items()))
    out, _ = proc.communicate(timeout=3600)
    assert proc.returncode == 0, out[-3000:]
    got[name] = _held_out(tmp_path / name)
    del procs[name]


@pytest.mark.slow
@pytest.mark.learning
def test_paint_team_learns_jointly(tmp_path):
    """The CI seed of ``examples/paint_team.yaml``: its first 40 steps, models built here.
    Held-out success at steps 0 -> 40, seed 0, 2-core Xeon: 0.381 -> 0.627 (avx512), 0.381
    -> 0.631 (ATEN_CPU_CAPABILITY=avx2), 0.377 -> 0.631 (default); the frozen painter's run
    reached 0.58 at step 40, the frozen writer's 0.35. The judge's reading (first / last 10
    steps): 0.251 -> 0.371, 0.250 -> 0.376, 0.249 -> 0.378. The bars (+0.15, +0.05) sit
    below the lowest gains (0.25, 0.12) with margin."""
    models = tmp_path / "models"
    proc = _train(
        tmp_path / "run", 0, f"task.dir={tmp_path}/data", "train.steps=40", "eval.every=40",
        f"policies.writer.model={models}/writer", f"policies.painter.model={models}/painter",
        f"policies.judge.model={models}/judge",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=1800)
    assert proc.returncode == 0, out[-3000:]
    evals = _evals(tmp_path / "run")
    print(f"held-out success: {evals}")
    assert [s for s, _ in evals] == [0, 40]
    assert evals[-1][1] >= evals[0][1] + 0.15, evals
    first, last = _judge_reads(tmp_path / "run")
    print(f"the judge names the picture's main colour: {first:.3f} -> {last:.3f}")
    assert last >= first + JUDGE_GAIN, (first, last)
    assert (tmp_path / "run" / "contact_before.png").is_file()
    assert (tmp_path / "run" / "contact_after.png").is_file()


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_training_beats_both_frozen_baselines(tmp_path, seed):
    """``examples/paint_team.yaml`` three ways (``WAYS``) at seeds 0-2 (under ``seeds``:
    about 10 minutes a seed on 2 cores). Joint training ends above each frozen baseline by
    0.1 in held-out success (the mean of the last two evaluations), and its judge reads
    better than at its start; marl/README.md, "Demo C", has the figures."""
    got = _compare(tmp_path, seed)
    first, last = _judge_reads(tmp_path / "joint")
    print(f"seed {seed}: the judge names the picture's main colour: {first:.3f} -> {last:.3f}")
    assert last >= first + JUDGE_GAIN, (first, last)
    assert got["joint"] >= got["frozen_painter"] + 0.1
    assert got["joint"] >= got["frozen_writer"] + 0.1
