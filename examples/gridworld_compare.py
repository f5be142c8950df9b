"""GiGPO vs plain episode-level GRPO on the grid world: same recipe, same steps, several seeds.

    python examples/gridworld_compare.py                 # 3 seeds, 2 worker processes
    python examples/gridworld_compare.py --steps 60 --seeds 0 1 2 3 --workers 2

One format-only SFT warm start is trained first and shared by every run, so the two credit
schemes start from the same weights; then each (credit, seed) pair trains
``examples/gridworld_gigpo.yaml`` with ``algorithm.credit`` set to ``gigpo`` or
``episode_grpo`` and only that changed. Runs are spread over worker processes (one torch
thread each). Prints the held-out success curve of every run and the per-scheme means.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

RECIPE = Path(__file__).resolve().parent / "gridworld_gigpo.yaml"
SCHEMES = ("gigpo", "episode_grpo")
QUIET = ["run.progress=false", "run.tensorboard=false", "run.save_every=0"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_one(recipe: str, overrides: list[str]) -> dict:
    """Train one recipe in this process; returns its eval curve and timing."""
    import torch

    torch.set_num_threads(1)
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config
    from polyrl.core.registry import load_plugins

    load_plugins()
    start = time.perf_counter()
    cpu = time.process_time()
    run = train(load(Config, recipe, overrides))
    rows = _metrics(run.path)
    curve = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    steps = [r["time/step_s"] for r in rows if r.get("time/step_s") is not None]
    return {
        "run_dir": str(run.path),
        "curve": curve,
        "step_s": sum(steps) / len(steps) if steps else None,
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
    }


def compare(
    out_dir: str | Path,
    *,
    steps: int | None = None,
    seeds=(0, 1, 2),
    workers: int = 2,
    recipe: str | Path = RECIPE,
    model: str | None = None,
    eval_every: int = 5,
    extra: list[str] | None = None,
) -> dict:
    """SFT once, then every (scheme, seed) run; returns {"sft": ..., "runs": {...}}."""
    out = Path(out_dir)
    extra = list(extra or [])
    model_args = [f"policies.main.model={model}"] if model else []
    ctx = get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        sft = pool.submit(
            train_one,
            str(recipe),
            [f"run.dir={out}/sft", "train.steps=0", "run.export=true", *QUIET, *model_args, *extra],
        ).result()
        warm = str(Path(sft["run_dir"]) / "export" / "main")
        jobs = {}
        for seed in seeds:
            for scheme in SCHEMES:
                overrides = [
                    f"run.dir={out}/{scheme}-seed{seed}",
                    f"seed={seed}",
                    f"algorithm.credit={scheme}",
                    f"policies.main.model={warm}",
                    "policies.main.build=null",
                    "policies.main.build_args=null",
                    "sft.steps=0",
                    "run.export=false",
                    f"eval.every={eval_every}",
                    *QUIET,
                    *extra,
                ]
                if steps is not None:
                    overrides.append(f"train.steps={steps}")
                jobs[(scheme, seed)] = pool.submit(train_one, str(recipe), overrides)
        runs = {f"{scheme}/{seed}": job.result() for (scheme, seed), job in jobs.items()}
    return {"sft": sft, "runs": runs}


def summary(result: dict) -> dict[str, dict[str, float]]:
    """Per scheme: mean success at the start and at the end, over seeds."""
    out = {}
    for scheme in SCHEMES:
        curves = [r["curve"] for k, r in result["runs"].items() if k.startswith(scheme + "/")]
        out[scheme] = {
            "start": sum(c[0][1] for c in curves) / len(curves),
            "end": sum(c[-1][1] for c in curves) / len(curves),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=f"runs/gridworld_compare-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("overrides", nargs="*", help="extra key=value recipe overrides")
    args = p.parse_args()
    result = compare(
        args.out,
        steps=args.steps,
        seeds=args.seeds,
        workers=args.workers,
        eval_every=args.eval_every,
        extra=args.overrides,
    )
    for key, run in sorted(result["runs"].items()):
        curve = " ".join(f"{s}:{a:.2f}" for s, a in run["curve"])
        print(f"{key:16s} {curve}   ({run['step_s']:.2f} s/step)")
    for scheme, s in summary(result).items():
        print(f"{scheme:16s} success {s['start']:.3f} -> {s['end']:.3f} (mean over seeds)")
    Path(args.out, "compare.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
