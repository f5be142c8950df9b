"""Steps per second, synchronous against async rollouts (``rollout.max_staleness``).

The README demo's recipe (tiny Qwen2, arithmetic, GRPO; no SFT, no evaluation between
steps; the reward is "the response has a digit 0-4", which varies within every group of
the untrained model, so every update runs), run in this process for ``--steps`` steps each way; the first two steps are
warm-up and left out of the rate.

(a) the real CPU engine. Trainer and engine share this machine's cores (one torch thread
    each), so little overlap is expected: reported as measured.
(b) the same engine with an injected latency per generate call (a sleep, which holds no
    core), sized in a calibration run so that rollout time equals update time: a stand-in
    for a GPU engine on its own device. Target: async >= 1.7x sync (2x is the ideal).

    .venv/bin/python benchmarks/async_overlap.py [--steps 14] [--k 1] [--model demo|wide]
                                                 [--backend local|ray]

``--backend local``: the engine works on a thread of the trainer's process (sharing its
cores and the GIL); ``--backend ray``: the update runs on a one-worker FSDP group and the
engine on its own actor, one core each. Multi-turn per-episode scheduling (part (c)):
``multi_turn_overlap.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# One torch thread per side (trainer, producer), as in every benchmark here: with two
# OpenMP threads per side on a busy 2-core machine, spin-waiting made the main thread's
# generate 3-15x slower than the same call in a second thread, which is not overlap.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.7


HERE = Path(__file__).resolve().parent
TIMES = Path(tempfile.mkdtemp(prefix="polyrl-async-bench-")) / "generate.jsonl"
os.environ["POLYRL_BENCH_TIMES"] = str(TIMES)  # BenchHF appends each call's duration


class Timed:
    """The latencies injected on either side."""

    engine_latency_s = 0.0
    update_latency_s = 0.0


def _register() -> None:
    from polyrl.core.rollout.rewards import register_reward

    def bench_reward(samples):
        """Whether the response has a digit 0-4: varies within every group of the
        untrained model, so every update runs (the demo's exact match would be all 0
        without the SFT warm start, and skip the update). Scored in the trainer's
        process, with the trainer-side latency."""
        if Timed.update_latency_s:
            time.sleep(Timed.update_latency_s)
        return [float(any(c in "01234" for c in s.response)) for s in samples]

    register_reward("bench_reward", batched=True)(bench_reward)


# --model: the demo's tiny model, or a wider one whose update and generate are mostly
# kernels (which release the GIL) rather than Python
MODELS = {
    "demo": [],
    "wide": [
        "policies.main.model=~/.cache/polyrl/models/tiny-qwen2-arithmetic-wide",
        "policies.main.build_args={corpus: arithmetic, hidden_size: 512, num_layers: 4, "
        "num_heads: 8, head_dim: 64, intermediate_size: 1536, seed: 0}",
    ],
}
MODEL = "demo"
# --backend: everything in this process (the engine on a thread), or Ray: the update on a
# one-worker FSDP group and the engine on its own actor, each a process with one core
BACKENDS = {
    "local": [],
    "ray": [
        "distributed.backend=ray",
        "distributed.args={workers_per_policy: 1, placement: split, num_cpus_per_worker: 1, "
        "num_cpus_per_engine: 1, threads_per_worker: 1}",
    ],
}
BACKEND = "local"


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
            "policies.main.engine.name=_bench_parts:BenchHF",
            f"policies.main.engine.args={{latency_s: {Timed.engine_latency_s}}}",
            *BACKENDS[BACKEND],
            "reward.terms=[{name: bench_reward}]",
            *MODELS[MODEL],
        ],
    )
    TIMES.write_text("")
    path = train(cfg).path
    calls = [json.loads(x) for x in TIMES.read_text().splitlines()]
    generate = [c[0] for c in calls]
    # the engine's idle time between one generate call's end and the next one's start:
    # in an async run whose producer is the slower side, the producer's own cost per batch
    # (load, capture, the record's round trip); synchronous, the rest of the step
    steady = calls[3:-1]
    idle = [(b[1] - b[0]) - a[1] for a, b in itertools.pairwise(steady)]
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    ends = sorted(r["time"] for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r)
    # steady rate: the steps after the first two (warm-up), end to end
    rate = (len(ends) - 2) / (ends[-1] - ends[1])
    gen = statistics.median(generate[3:-1])  # not: the evals, two warm-up batches
    step_s = statistics.median(r["time/step_s"] for r in rows if "time/step_s" in r)
    # what a step spends beyond generating (reward, credit, update, sync): exact when
    # synchronous; async steps overlap the two, so there it is only step time - generate
    return {
        "steps_per_s": rate,
        "generate_s": gen,
        "update_s": max(step_s - gen, 0.0),
        "engine_idle_s": statistics.median(idle),
    }


def compare(steps: int, k: int, tmp: Path, tag: str, rounds: int) -> tuple[dict, dict]:
    """Sync and async runs alternated ``rounds`` times (machine load hits both alike);
    medians of each."""
    got: dict[str, list[dict]] = {"sync": [], "async": []}
    for r in range(rounds):
        for mode, kk in (("sync", 0), ("async", k)) if r % 2 == 0 else (("async", k), ("sync", 0)):
            got[mode].append(run(steps, kk, tmp, f"{tag}-{mode}-{r}"))
    med = {
        mode: {key: statistics.median(x[key] for x in runs) for key in runs[0]}
        for mode, runs in got.items()
    }
    return med["sync"], med["async"]


def show(sync: dict, asy: dict) -> float:
    for name, r in (("sync", sync), ("async", asy)):
        print(
            f"    {name:5s}: {r['steps_per_s']:.3f} steps/s (generate {r['generate_s']:.3f} s, "
            f"rest of the step {r['update_s']:.3f} s, engine idle between calls "
            f"{1000 * r['engine_idle_s']:.0f} ms)"
        )
    ratio = asy["steps_per_s"] / sync["steps_per_s"]
    print(f"    async / sync: {ratio:.2f}x")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--k", type=int, default=1, help="max_staleness of the async runs")
    ap.add_argument("--rounds", type=int, default=2, help="alternated sync/async pairs")
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="local")
    args = ap.parse_args(argv)
    global MODEL, BACKEND
    MODEL, BACKEND = args.model, args.backend
    sys.path.insert(0, str(HERE))  # _bench_parts, named in the recipe
    if BACKEND == "ray":
        import ray

        path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path, "POLYRL_BENCH_TIMES": str(TIMES)}},
        )
    _register()
    print(
        f"torch threads: {torch.get_num_threads()}, steps: {args.steps}, k: {args.k}, "
        f"model: {args.model}, backend: {args.backend}"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("(a) real CPU engine")
        sync, _ = compare(args.steps, args.k, tmp, "real", args.rounds)
        show(sync, _)
        # (b) the shorter side waits out the difference, so rollout time = update time
        gap = sync["update_s"] - sync["generate_s"]
        Timed.engine_latency_s, Timed.update_latency_s = max(gap, 0.0), max(-gap, 0.0)
        print(
            f"(b) injected latency: {Timed.engine_latency_s:.3f} s per generate call, "
            f"{Timed.update_latency_s:.3f} s per step on the trainer's side"
        )
        ratio = show(*compare(args.steps, args.k, tmp, "latency", args.rounds))
        verdict = "meets" if ratio >= TARGET else "misses"
        print(f"    ({verdict} the {TARGET}x target; 2x is the ideal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
