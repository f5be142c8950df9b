"""End to end: the README's VL demo recipes learn to look at images, via the CLI (seed 0
in CI, seeds 0-2 under ``-m seeds``).

Colour: after the format-only warm start the held-out accuracy is at chance (4 colours:
0.25); GRPO must lift each seed by 0.15 and the three seeds' mean to 0.75. Grounding: GRPO must raise the held-out
mean IoU over the warm start's, to well above what any constant box scores. All runs go
through ``polyrl train``, two single-threaded processes at a time (tiny models gain
nothing from a second thread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "vl_shapes_grpo.yaml"
GROUNDING = ROOT / "examples" / "vl_shapes_grounding.yaml"


def _metric(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r.get(key) is not None]


def _train(recipe: Path, run_dir: Path, model: str, *overrides: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "polyrl.core.runner.cli",
        "train",
        str(recipe),
        f"run.dir={run_dir}",
        f"policies.main.model={model}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.export=false",
        "eval.every=0",
        *overrides,
    ]
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 (closed by the caller)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _run_all(jobs: list[tuple], parallel: int = 2) -> None:
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            recipe, run_dir, model, overrides = pending.pop(0)
            running.append((run_dir, _train(recipe, run_dir, model, *overrides)))
        time.sleep(0.5)
        for run_dir, proc in list(running):
            if proc.poll() is not None:
                running.remove((run_dir, proc))
                if proc.returncode:
                    log = run_dir.with_suffix(".log").read_text()[-3000:]
                    pytest.fail(f"polyrl train for {run_dir} failed:\n{log}")


SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def demo_runs(tiny_vl_dir, tmp_path_factory):
    """Runs the colour and grounding demos for the seeds asked (each once per module), two
    at a time on the 2 cores; returns the run directories by seed and ("ground", seed)."""
    root = tmp_path_factory.mktemp("vl_e2e")
    runs: dict = {}

    def run(seeds: tuple[int, ...]) -> dict:
        jobs = []
        for seed in (s for s in seeds if s not in runs):
            runs[seed], runs["ground", seed] = root / f"colour{seed}", root / f"ground{seed}"
            jobs.append((GROUNDING, runs["ground", seed], tiny_vl_dir, (f"seed={seed}",)))
            colour = (f"seed={seed}", "task.args.n_train=600")
            jobs.append((RECIPE, runs[seed], tiny_vl_dir, colour))
        _run_all(jobs, parallel=2)
        return runs

    return run


def _colour_finals(runs: dict, seeds: tuple[int, ...]) -> list[float]:
    """Each seed's held-out accuracy rises clearly from chance; returns the final ones.

    It learns one colour at a time, and where a seed stands at step 100 turns on float
    rounding: one machine reached 1.00 on every seed, another left seeds 0 and 1 at 0.76
    and 0.71; group statistics in float64 (exact 0 for equal rewards) moved seed 1's loss
    by 1e-6 at step 6 and it stood at 0.49 (0.71 before) on this CPU. Seeds 0/1/2 under
    ATEN_CPU_CAPABILITY=avx2: 0.25/0.21/0.30 -> 0.94/1.00/1.00; default: 0.25/0.21/0.30 ->
    1.00/0.49/0.98 (mean 0.82): a seed's bar, 0.15, is half the lowest rise (0.28)."""
    finals = []
    for seed in seeds:
        acc = _metric(runs[seed], "eval/accuracy")
        print(
            f"seed {seed}: held-out accuracy {acc[0]:.2f} after the format warm start -> "
            f"{acc[-1]:.2f} after GRPO"
        )
        assert acc[0] <= 0.45, (seed, acc)  # chance, not learned in the warm start
        assert acc[-1] >= acc[0] + 0.15, (seed, acc)
        finals.append(acc[-1])
    return finals


@pytest.mark.learning
@pytest.mark.slow
def test_tiny_vlm_learns_the_colour_question(demo_runs):
    """Seed 0 in CI; the three seeds' mean is the ``seeds`` test below."""
    runs = demo_runs((0,))
    _colour_finals(runs, (0,))
    # image samples and answers in the run directory
    from polyrl.multimodal.samples import write_contact_sheet

    sheet = write_contact_sheet(runs[0])
    assert sheet.is_file() and sheet.parent == runs[0] / "samples"
    assert any((runs[0] / "data" / "images" / "eval").glob("*.png"))
    for name in ("answers_before.png", "answers_after.png"):  # written by each evaluation
        assert (runs[0] / name).is_file(), name


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.seeds
def test_tiny_vlm_learns_the_colour_question_three_seeds(demo_runs):
    finals = _colour_finals(demo_runs(SEEDS), SEEDS)
    assert sum(finals) / len(finals) >= 0.75, finals


def _grounding(runs: dict, seeds: tuple[int, ...]) -> tuple[list, list, list]:
    """Each seed ends above the best constant box (the best of the training boxes, scored
    on the held-out images); returns the start, end and constant-box IoUs by seed."""
    from polyrl.multimodal.rewards import iou

    start, end, constants = [], [], []
    for seed in seeds:
        run = runs["ground", seed]
        rows = {
            split: [
                json.loads(x) for x in (run / "data" / f"{split}.jsonl").read_text().splitlines()
            ]
            for split in ("train", "eval")
        }
        boxes, held = {tuple(r["box"]) for r in rows["train"]}, rows["eval"]
        constant = max(sum(iou(b, r["box"]) for r in held) / len(held) for b in boxes)
        ious = _metric(run, "eval/accuracy")  # the eval's accuracy term is the IoU reward
        print(
            f"grounding seed {seed}: held-out mean IoU {ious[0]:.3f} after the warm start "
            f"-> {ious[-1]:.3f} after GRPO (best constant box {constant:.3f})"
        )
        start.append(ious[0])
        end.append(ious[-1])
        constants.append(constant)
        assert ious[-1] >= constant + 0.05, (seed, ious, constant)
    return start, end, constants


@pytest.mark.learning
@pytest.mark.slow
def test_tiny_vlm_grounding_ends_above_the_best_constant_box(demo_runs):
    """Seed 0 in CI ends above the best constant box (0.05); that the IoU rises is the
    three seeds' claim, the ``seeds`` test below. Seed 0 alone does not rise on every
    kernel set: from 0.490 after the warm start it ends at 0.780 under avx2 and 0.503
    under default (this Intel Xeon), over a best constant box of 0.300."""
    _grounding(demo_runs((0,)), (0,))


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.seeds
def test_tiny_vlm_grounding_iou_rises_three_seeds(demo_runs):
    """GRPO raises the held-out mean IoU (3 seeds, mean) and every seed ends above the best
    constant box, the mean
    far above it: the model localises per image, not just the box prior.

    Where a seed ends turns on float rounding (butterfly effects over 100 steps): seed 0
    ended at 0.71 on the machine of the README's figures, at 0.85 (code before this round)
    and 0.53 (float64 group statistics, losses equal to 1e-8 at step 1) on another CPU,
    where seeds 1 and 2 went 0.31 -> 0.82 and 0.87 -> 0.67. Under each kernel set
    (ATEN_CPU_CAPABILITY), seeds 0/1/2 end at: avx2 0.850 / 0.760 / 0.583 (best constant
    boxes 0.300 / 0.310 / 0.350; from 0.490 / 0.490 / 0.670); default 0.800 / 0.820 /
    0.670 (from 0.490 / 0.340 / 0.430); avx512 (an AMD EPYC) one seed at 0.419 over a
    constant box of 0.300. So a single seed is only required to end
    clearly above the best constant box (0.05); the mean carries the size of the gain."""
    start, end, constants = _grounding(demo_runs(SEEDS), SEEDS)
    mean = sum(end) / len(end)
    assert mean >= sum(constants) / len(constants) + 0.25, (end, constants)
    assert mean >= sum(start) / len(start) + 0.05, (start, end)
