"""What tracing every step costs: the arithmetic demo with run.trace_every=1 against off.

Both arms run the README demo's recipe (tiny Qwen2 built offline, no SFT, no eval) for the
same steps and seed in this process, alternating off / on ``--repeats`` times so machine
load hits both alike; a step's time is the run's ``time/step_s`` (the first step of each
run, warm-up, left out). Prints the median step time of each arm and their ratio
(target: on / off < 1.02), and the events one traced step writes.

    .venv/bin/python benchmarks/trace_overhead.py [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from polyrl.core.observe import timeline
from polyrl.core.observe.timeline import read_run

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import demo_steps  # noqa: E402

TARGET = 1.02


def step_times(root: Path, name: str, steps: int, trace_every: int) -> list[float]:
    rows = demo_steps(root, name, steps, f"run.trace_every={trace_every}")
    return [r["time/step_s"] for r in rows][1:]


def span_cost(tmp: Path, n: int = 20000) -> tuple[float, float]:
    """Seconds per span (enter, exit, one event written) recording and not recording."""
    tracer = timeline.Tracer(tmp / "spans", every=2)
    out = []
    with timeline.tracing(tracer):
        for number in (2, 1):  # step 2 records, step 1 does not
            with timeline.step(number):
                t0 = time.perf_counter()
                for _ in range(n):
                    with timeline.span("x", rows=8):
                        pass
                out.append((time.perf_counter() - t0) / n)
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        step_times(root, "warmup", 2, 0)  # builds the model once; imports, caches
        for i in range(args.repeats):
            off += step_times(root, f"off{i}", args.steps, 0)
            on += step_times(root, f"on{i}", args.steps, 1)
        events = sum(1 for e in read_run(root / "on0") if e["ph"] != "M")
        on_span, off_span = span_cost(root)
    off_s, on_s = statistics.median(off), statistics.median(on)
    ratio = on_s / off_s
    per_step = events / args.steps
    bound = 1 + per_step * on_span / off_s  # the events' own cost over the untraced step
    print(f"steps timed per arm: {len(off)} (threads {args.threads})")
    print(f"median step: trace off {off_s * 1e3:.1f} ms, trace_every=1 {on_s * 1e3:.1f} ms")
    print(f"events per traced step: {per_step:.0f}")
    print(f"one span: {on_span * 1e6:.1f} us recording, {off_span * 1e6:.2f} us not")
    print(f"ratio on/off, whole steps: {ratio:.4f} (machine noise included)")
    verdict = "PASS" if bound < TARGET else "FAIL"
    print(f"ratio on/off from the spans' cost: {bound:.5f} (target < {TARGET}): {verdict}")


if __name__ == "__main__":
    main()
