"""End to end: the README's VL demo recipe learns to look at images (3 seeds), via the CLI.

After the format-only warm start the held-out accuracy is at chance (4 colours: 0.25);
GRPO must lift it to >= 0.8 for every seed. All runs go through ``polyrl train``, two
single-threaded processes at a time (tiny models gain nothing from a second thread).
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "polyrl.core.cli", "train", str(recipe),
           f"run.dir={run_dir}", f"policies.main.model={model}", "run.progress=false",
           "run.tensorboard=false", "run.export=false", "eval.every=0", *overrides]
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
def e2e_runs(tiny_vl_dir, tmp_path_factory) -> dict:
    """All demo runs (3 colour seeds, 1 grounding run), two at a time on the 2 cores."""
    root = tmp_path_factory.mktemp("vl_e2e")
    runs = {seed: root / f"colour{seed}" for seed in SEEDS}
    runs["ground"] = root / "ground"
    jobs = [(RECIPE, runs[seed], tiny_vl_dir, (f"seed={seed}", "task.args.n_train=600"))
            for seed in SEEDS]
    jobs.insert(1, (GROUNDING, runs["ground"], tiny_vl_dir, ("task.args.n_train=600",)))
    _run_all(jobs, parallel=2)
    return runs


@pytest.mark.slow
def test_tiny_vlm_learns_the_colour_question(e2e_runs):
    for seed in SEEDS:
        acc = _metric(e2e_runs[seed], "eval/accuracy")
        print(f"seed {seed}: held-out accuracy {acc[0]:.2f} after the format warm start -> "
              f"{acc[-1]:.2f} after GRPO")
    for seed in SEEDS:
        acc = _metric(e2e_runs[seed], "eval/accuracy")
        assert acc[0] <= 0.45, (seed, acc)  # chance, not learned in the warm start
        assert acc[-1] >= 0.8, (seed, acc)
    # image samples and answers in the run directory
    from polyrl.multimodal.samples import write_contact_sheet

    sheet = write_contact_sheet(e2e_runs[0])
    assert sheet.is_file() and sheet.parent == e2e_runs[0] / "samples"
    assert any((e2e_runs[0] / "data" / "images" / "eval").glob("*.png"))
    for name in ("answers_before.png", "answers_after.png"):  # written by each evaluation
        assert (e2e_runs[0] / name).is_file(), name


@pytest.mark.slow
def test_tiny_vlm_grounding_iou_rises(e2e_runs):
    """Mean IoU on held-out images rises clearly under GRPO. (How far: to about the best
    constant box's IoU, printed for comparison; the tiny model learns the box format and
    prior within this budget, not per-image localisation.)"""
    from polyrl.multimodal.rewards import iou

    run = e2e_runs["ground"]
    ious = _metric(run, "eval/accuracy")  # the eval's accuracy term is the IoU reward
    train = [json.loads(x) for x in (run / "data" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (run / "data" / "eval.jsonl").read_text().splitlines()]
    mean_box = [sum(r["box"][i] for r in train) / len(train) for i in range(4)]
    constant = sum(iou(mean_box, r["box"]) for r in held) / len(held)
    print(f"grounding: held-out mean IoU {ious[0]:.3f} after the warm start -> {ious[-1]:.3f} "
          f"after GRPO (the mean training box scores {constant:.3f})")
    assert ious[-1] >= ious[0] + 0.1, ious
