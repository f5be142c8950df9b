"""What the Prometheus endpoint (``run.prometheus_port``) costs a step.

The README demo's recipe (tiny Qwen2 built offline, no SFT, no eval) runs the same steps
and seed with the endpoint off and on, alternated ``--repeats`` times in this process so
machine load hits both alike, the on arm scraped every ``--scrape-s`` seconds (Prometheus
scrapes every 15 s by default: this is far harsher); a step's time is the run's
``time/step_s`` (the first step of each run, warm-up, left out). Because the machine's
noise dwarfs the effect, the script also times the endpoint's own work and sets it against
the step time of the same runs:

- per step, ``log`` (the step's metrics into the gauges) with a real step's metrics;
- per span or instant the run closes (counted during the on runs by a timeline watcher),
  the endpoint's watcher (a span closed with the endpoint open, minus without);
- per scrape, the endpoint rendering ``/metrics`` (it runs on the server's thread, holding
  the interpreter lock), spread over the steps the scrapes fell in.

    .venv/bin/python benchmarks/prometheus_overhead.py [--steps 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from polyrl.core.observe import timeline
from polyrl.core.observe.prometheus import PrometheusLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import demo_steps  # noqa: E402

TARGET = 1.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(root: Path, name: str, steps: int, port: int | None) -> list[dict]:
    """The demo for ``steps`` steps (``port``: the endpoint's); its step lines."""
    return demo_steps(root, name, steps, f"run.prometheus_port={'null' if port is None else port}")


class Scraper(threading.Thread):
    """GETs ``/metrics`` every ``every`` seconds until stopped; keeps each scrape's seconds."""

    def __init__(self, port: int, every: float) -> None:
        super().__init__(daemon=True)
        self.port, self.every, self.seconds = port, every, list[float]()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                t0 = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics") as r:
                    r.read()
                self.seconds.append(time.perf_counter() - t0)
            except OSError:  # not serving yet, or closed
                pass


def publish_costs(step_metrics: dict, n: int = 2000) -> tuple[float, float, float]:
    """Seconds per ``log`` of ``step_metrics``, per span the endpoint hears (over one it
    does not) and per rendering of ``/metrics``, on an endpoint of this process."""
    from prometheus_client.exposition import generate_latest

    def spans() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with timeline.span("rollout", rows=8):
                pass
        return (time.perf_counter() - t0) / n

    bare = spans()
    logger = PrometheusLogger(0, "benchmark")
    try:
        heard = spans()
        t0 = time.perf_counter()
        for i in range(n):
            logger.log(step_metrics, i)
        log_s = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n // 10):
            generate_latest(logger.registry)
        render_s = (time.perf_counter() - t0) / (n // 10)
    finally:
        logger.close()
    return log_s, heard - bare, render_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scrape-s", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    off: list[float] = []
    on: list[float] = []
    events, scrapes, scrape_s, on_wall = 0, 0, [], 0.0
    last: dict = {}

    def count(name, start, dur, a) -> None:  # noqa: ANN001 (a timeline watcher)
        nonlocal events
        events += 1

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run(root, "warmup", 2, None)  # builds the model once; imports, caches
        for i in range(args.repeats):
            off += [r["time/step_s"] for r in run(root, f"off{i}", args.steps, None)[1:]]
            port = free_port()
            scraper = Scraper(port, args.scrape_s)
            scraper.start()
            t0 = time.perf_counter()
            with timeline.watch(count):
                rows = run(root, f"on{i}", args.steps, port)
            on_wall += time.perf_counter() - t0
            scraper.stop.set()
            scraper.join()
            scrapes += len(scraper.seconds)
            scrape_s += scraper.seconds
            on += [r["time/step_s"] for r in rows[1:]]
            last = {k: v for k, v in rows[-1].items() if k not in ("step", "time")}
    log_s, event_s, render_s = publish_costs(last)
    off_s, on_s = statistics.median(off), statistics.median(on)
    steps_on = args.repeats * args.steps
    per_step_events = events / steps_on
    per_step_scrapes = scrapes / steps_on
    publish = log_s + per_step_events * event_s + per_step_scrapes * render_s
    print(f"steps timed per arm: {len(off)} (threads {args.threads}); {len(last)} metrics a step")
    print(f"median step: endpoint off {off_s * 1e3:.1f} ms, on {on_s * 1e3:.1f} ms")
    print(f"ratio on/off, whole steps: {on_s / off_s:.4f} (machine noise included)")
    print(
        f"scrapes: {scrapes} in {on_wall:.1f} s, median GET {statistics.median(scrape_s) * 1e3:.2f} ms"
    )
    print(
        f"per step: log {log_s * 1e6:.0f} us; {per_step_events:.1f} spans x "
        f"{event_s * 1e6:.1f} us; {per_step_scrapes:.2f} scrapes x {render_s * 1e3:.2f} ms render"
    )
    default = log_s + per_step_events * event_s + off_s / 15.0 * render_s  # one per 15 s
    print(f"the same at Prometheus' default scrape interval (15 s): {default * 1e3:.3f} ms")
    bound = 1 + publish / off_s
    verdict = "PASS" if bound < TARGET else "FAIL"
    print(
        f"publish cost per step: {publish * 1e3:.3f} ms; ratio from it: {bound:.5f} "
        f"(target < {TARGET}): {verdict}"
    )


if __name__ == "__main__":
    main()
