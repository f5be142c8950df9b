"""Drivers of the two gateway demos (``gateway_calculator.yaml``, ``gateway_two_models.yaml``).

    python examples/gateway_demos.py 1 --seeds 0 1 2     # demo 1: start and end success
    python examples/gateway_demos.py 2 --seeds 0          # demo 2: with each model swapped

Demo 2 first exports its warm start (SFT only), trains from it, then evaluates the
trained pair and each model swapped back to its warm start. Held-out success is greedy,
per episode. Seeds run in worker processes (one torch thread each).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
DEMO1 = EXAMPLES / "gateway_calculator.yaml"
DEMO2 = EXAMPLES / "gateway_two_models.yaml"
QUIET = ["run.progress=false", "run.tensorboard=false", "run.save_every=0"]


def run_recipe(recipe: str, overrides: list[str]) -> dict:
    """Train ``recipe`` in this process; its held-out success curve and run directory."""
    import torch

    torch.set_num_threads(1)
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    run = train(load(Config, str(recipe), [*QUIET, *overrides]))
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"run_dir": str(run.path), "curve": curve}


def demo1(out: Path, seed: int) -> dict:
    return run_recipe(
        str(DEMO1),
        [
            f"seed={seed}",
            f"run.dir={out}/demo1-seed{seed}",
            f"task.dir={out}/demo1-data-seed{seed}",
            f"policies.main.model={out}/model",
            "eval.every=0",
        ],
    )


def demo2(out: Path, seed: int) -> dict:
    """Warm start (SFT only, exported), RL from it, then held-out passes with each model
    swapped back to its warm start."""
    out = out / f"demo2-seed{seed}"
    common = [f"seed={seed}", f"task.dir={out}/data"]
    warm = run_recipe(
        str(DEMO2),
        [
            *common,
            f"run.dir={out}/warm",
            f"policies.planner.model={out}/model",
            f"policies.answerer.model={out}/model",
            "train.steps=0",
            "run.export=true",
        ],
    )
    fixed = ["sft.steps=0"] + [
        f"policies.{p}.{k}=null" for p in ("planner", "answerer") for k in ("build", "build_args")
    ]
    warm_dir = Path(warm["run_dir"]) / "export"
    trained = run_recipe(
        str(DEMO2),
        [
            *common,
            *fixed,
            f"run.dir={out}/trained",
            f"policies.planner.model={warm_dir / 'planner'}",
            f"policies.answerer.model={warm_dir / 'answerer'}",
            "eval.every=0",
            "run.export=true",
        ],
    )
    trained_dir = Path(trained["run_dir"]) / "export"

    def held_out(planner: Path, answerer: Path, tag: str) -> float:
        r = run_recipe(
            str(DEMO2),
            [
                *common,
                *fixed,
                f"run.dir={out}/{tag}",
                f"policies.planner.model={planner / 'planner'}",
                f"policies.answerer.model={answerer / 'answerer'}",
                "train.steps=0",
            ],
        )
        return r["curve"][-1][1]

    return {
        "warm": trained["curve"][0][1],
        "trained": trained["curve"][-1][1],
        "warm_planner": held_out(warm_dir, trained_dir, "warm-planner"),
        "warm_answerer": held_out(trained_dir, warm_dir, "warm-answerer"),
    }


def seeds(demo: int, out: str | Path, seeds=(0, 1, 2), workers: int = 2) -> list[dict]:
    """Each seed of demo 1 or 2 in a worker process."""
    fn = demo1 if demo == 1 else demo2
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return [j.result() for j in [pool.submit(fn, Path(out), s) for s in seeds]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("demo", type=int, choices=(1, 2))
    p.add_argument("--out", default=f"runs/gateway_demos-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    results = seeds(args.demo, args.out, args.seeds, args.workers)
    for seed, r in zip(args.seeds, results, strict=True):
        print(seed, json.dumps(r if args.demo == 2 else r["curve"]))


if __name__ == "__main__":
    main()
