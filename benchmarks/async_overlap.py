"""Steps per second, synchronous against async rollouts (``rollout.max_staleness``).

The README demo's recipe (tiny Qwen2, arithmetic, GRPO; no SFT, no evaluation between
steps), run in this process for ``--steps`` steps each way; the first two steps are
warm-up and left out of the rate.

(a) the real CPU engine. Trainer and engine share this machine's cores, so little overlap
    is expected: reported as measured.
(b) the same engine with an injected latency per generate call (a sleep, which holds no
    core), sized in a calibration run so that rollout time equals update time: a stand-in
    for a GPU engine on its own device. Target: async >= 1.7x sync (2x is the ideal).

    .venv/bin/python benchmarks/async_overlap.py [--steps 14] [--k 1]

Multi-turn per-episode scheduling (part (c) of the async issue) is not built yet; this
benchmark does not measure it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.7


class Timed:
    """Generate-call durations of every engine built while it is installed."""

    calls: list[float] = []
    latency_s = 0.0


def _register() -> None:
    from polyrl.core.engine import HFEngine
    from polyrl.core.registry import ENGINES

    class BenchHF(HFEngine):
        def generate(self, prompts, params):
            t0 = time.perf_counter()
            if Timed.latency_s:
                time.sleep(Timed.latency_s)  # the engine is busy elsewhere: no core is held
            out = super().generate(prompts, params)
            Timed.calls.append(time.perf_counter() - t0)
            return out

    if "bench_hf" not in ENGINES:
        ENGINES.register("bench_hf", BenchHF)


def run(steps: int, k: int, tmp: Path, tag: str) -> dict[str, float]:
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        ROOT / "core" / "recipes" / "arithmetic_grpo.yaml",
        [
            f"run.dir={tmp}/{tag}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.save_every=0",
            "eval.every=0",
            "sft.steps=0",
            "task.args={n_train: 2000, n_eval: 16, max_operand: 30, ops: '+'}",
            f"train.steps={steps}",
            f"rollout.max_staleness={k}",
            "policies.main.engine.name=bench_hf",
        ],
    )
    Timed.calls = []
    t_start = time.perf_counter()
    path = train(cfg).path
    total = time.perf_counter() - t_start
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    ends = sorted(r["time"] for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r)
    step_s = [r["time/step_s"] for r in rows if "time/step_s" in r][2:]
    # steady rate: timed steps between the end of step 2 and the end of the last
    rate = (len(ends) - 2) / (ends[-1] - ends[1]) if len(ends) > 3 else float("nan")
    gen = Timed.calls[2:-1] if len(Timed.calls) > 3 else Timed.calls  # drop warm-up, eval
    return {
        "steps_per_s": rate,
        "step_s_median": statistics.median(step_s) if step_s else float("nan"),
        "generate_s_median": statistics.median(gen) if gen else float("nan"),
        "total_s": total,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--k", type=int, default=1, help="max_staleness of the async runs")
    args = ap.parse_args(argv)
    _register()
    print(f"torch threads: {torch.get_num_threads()}, steps: {args.steps}, k: {args.k}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        Timed.latency_s = 0.0
        sync = run(args.steps, 0, tmp, "sync")
        asy = run(args.steps, args.k, tmp, "async")
        print("(a) real CPU engine")
        for name, r in (("sync", sync), ("async", asy)):
            print(
                f"    {name:5s}: {r['steps_per_s']:.3f} steps/s, step {r['step_s_median']:.3f} s, "
                f"generate {r['generate_s_median']:.3f} s"
            )
        print(f"    async / sync: {asy['steps_per_s'] / sync['steps_per_s']:.2f}x")
        # (b) rollout = update: the update is what a synchronous step spends beyond generate
        update_s = max(sync["step_s_median"] - sync["generate_s_median"], 0.0)
        Timed.latency_s = max(update_s - sync["generate_s_median"], 0.0)
        sync_l = run(args.steps, 0, tmp, "sync_latency")
        asy_l = run(args.steps, args.k, tmp, "async_latency")
        ratio = asy_l["steps_per_s"] / sync_l["steps_per_s"]
        print(
            f"(b) injected latency {Timed.latency_s:.3f} s per generate call "
            f"(rollout {sync_l['generate_s_median']:.3f} s vs update {update_s:.3f} s)"
        )
        for name, r in (("sync", sync_l), ("async", asy_l)):
            print(f"    {name:5s}: {r['steps_per_s']:.3f} steps/s, step {r['step_s_median']:.3f} s")
        verdict = "meets" if ratio >= TARGET else "misses"
        print(f"    async / sync: {ratio:.2f}x ({verdict} the {TARGET}x target; 2x is the ideal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
