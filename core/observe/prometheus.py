"""Live metrics for long runs: a Prometheus endpoint (``run.prometheus_port``).

The endpoint is one more metric logger (:mod:`polyrl.core.observe.loggers`): it opens with the run
directory, serves ``http://HOST:PORT/metrics`` (all interfaces) from a thread of its own,
and shuts down when the run closes, so no thread or port outlives the run. Port 0 takes a
free port, printed at start. It serves two kinds of figures.

**The step metrics**: every metric of the last logged step, one gauge each, named
``polyrl_`` + its ``metrics.jsonl`` key with each character Prometheus does not allow in a
name made ``_`` (``reward/mean`` -> ``polyrl_reward_mean``, ``perf/main/mfu`` ->
``polyrl_perf_main_mfu``), and ``polyrl_step``, the step they belong to. A key that a step
does not log (``eval/*`` between evaluations) keeps its last value; keys that sanitise to
one name share its family, told apart by a ``key`` label holding each one's own name.

**Live figures**, from the run's timeline spans as they close (:func:`timeline.watch`),
traced or not, in this process (engines and workers on Ray actors are not seen):

- ``polyrl_span_seconds_total{span}``: seconds spent in each phase (``rollout``,
  ``update``, ``micro_batch``, ``weight_sync``, ``checkpoint``, ... : the names of
  ``polyrl trace``); ``wait_rollout`` is the trainer waiting for the async producer,
  ``wait_staleness_bound`` the producer held back by ``rollout.max_staleness``;
- ``polyrl_engine_busy_seconds_total{engine}``, ``polyrl_engine_calls_total{engine}``,
  ``polyrl_engine_tokens_total{engine}``: each engine's generate calls (the engines whose
  calls are ``generate`` spans: the HF engine, the VL engine on its decode loop and the
  diffusion engine);
  ``polyrl_engine_busy_share{engine}``: its busy seconds over the wall seconds between the
  last two logged steps (calls counted when they end; concurrent calls can pass 1);
- ``polyrl_async_queued_batches``: batches the async producer has made that the trainer has
  not taken yet; ``polyrl_async_ready_batch_staleness``: the versions the newest ready
  batch's weights lag behind the update that will train on it;
- ``polyrl_gateway_request_seconds``: a histogram of the agent gateway's request latency
  (sampling, from parse to answer); ``polyrl_gateway_request_errors_total{error}``: its
  requests that failed while sampling, by exception type.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from polyrl.core.config import ConfigError, UserError
from polyrl.core.observe import timeline

INSTALL = "pip install 'polyrl[loggers]'"
_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """The Prometheus name of a ``metrics.jsonl`` key: ``polyrl_`` + the key, each
    character outside ``[a-zA-Z0-9_]`` made ``_`` (colons are for recording rules)."""
    return "polyrl_" + _BAD.sub("_", key)


def check_prometheus(port: int | None, source: str = "<config>") -> None:
    """Fail at load, not when the run starts: a port in range and the package installed."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"run.prometheus_port={port!r} in {source}: give a TCP port 1-65535, 0 for a "
            "free one, or null for no endpoint"
        )
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"run.prometheus_port={port} in {source} asks for a Prometheus endpoint, but the "
            f"prometheus_client package is not installed: {INSTALL} (or remove "
            "run.prometheus_port)"
        )


class _StepMetrics:
    """A prometheus_client collector of the last logged step's values (their names are
    known only as steps log them, so no fixed Gauge objects)."""

    def __init__(self, reserved: Iterable[str]) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, float] = {}
        self.step: int | None = None
        self.reserved = set(reserved)

    def update(self, metrics: dict[str, float], step: int) -> None:
        for key in metrics:
            if metric_name(key) in self.reserved:
                raise ValueError(
                    f"metric {key!r} is named {metric_name(key)!r} in Prometheus, the name of "
                    "a live figure of polyrl.core.observe.prometheus; rename the metric"
                )
        with self.lock:
            self.values.update(metrics)
            self.step = step

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        with self.lock:
            values, step = dict(self.values), self.step
        if step is None:
            return
        yield GaugeMetricFamily("polyrl_step", "step of the last logged metrics", value=step)
        families: dict[str, list[str]] = {}
        for key in values:
            families.setdefault(metric_name(key), []).append(key)
        for name, keys in families.items():
            if len(keys) == 1:
                yield GaugeMetricFamily(name, f"metrics.jsonl {keys[0]}", value=values[keys[0]])
                continue
            family = GaugeMetricFamily(name, "metrics.jsonl " + ", ".join(keys), labels=["key"])
            for key in keys:
                family.add_metric([key], values[key])
            yield family


class PrometheusLogger:
    """Serves the step metrics and the live figures on ``port`` until :meth:`close`."""

    def __init__(self, port: int, name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.exposition import start_http_server

        # a registry of its own: nothing joins the library's global one, so runs in one
        # process (tests) each start empty and leave nothing behind
        self.registry = CollectorRegistry()
        reg = self.registry
        self.span_seconds = Counter(
            "polyrl_span_seconds", "seconds spent in each timeline span", ["span"], registry=reg
        )
        self.busy = Counter(
            "polyrl_engine_busy_seconds", "seconds in generate calls", ["engine"], registry=reg
        )
        self.calls = Counter("polyrl_engine_calls", "generate calls", ["engine"], registry=reg)
        self.tokens = Counter("polyrl_engine_tokens", "tokens generated", ["engine"], registry=reg)
        self.busy_share = Gauge(
            "polyrl_engine_busy_share",
            "share of the wall time between the last two logged steps in generate calls",
            ["engine"],
            registry=reg,
        )
        self.queued = Gauge(
            "polyrl_async_queued_batches", "batches made ahead, not yet trained", registry=reg
        )
        self.staleness = Gauge(
            "polyrl_async_ready_batch_staleness",
            "versions the newest ready batch's weights lag the update that trains on it",
            registry=reg,
        )
        self.latency = Histogram(
            "polyrl_gateway_request_seconds", "gateway request latency", registry=reg
        )
        self.errors = Counter(
            "polyrl_gateway_request_errors", "gateway requests failed", ["error"], registry=reg
        )
        reserved = {
            sample_name
            for metric in (self.span_seconds, self.busy, self.calls, self.tokens)
            + (self.busy_share, self.queued, self.staleness, self.latency, self.errors)
            for family in metric.describe()
            for suffix in ("", "_total", "_created", "_bucket", "_sum", "_count")
            for sample_name in [family.name + suffix]
        } | {"polyrl_step"}
        self.steps = _StepMetrics(reserved)
        reg.register(self.steps)
        self._lock = threading.Lock()
        self._busy_s: dict[str, float] = {}  # per engine, since the run started
        self._mark: tuple[float, dict[str, float]] = (time.monotonic(), {})
        try:
            self.server, self.thread = start_http_server(port, registry=reg)
        except OSError as e:
            raise UserError(
                f"run.prometheus_port={port}: cannot listen there ({e.strerror or e}); "
                "choose a free port, or 0 for any free one"
            ) from None
        self.port = int(self.server.server_port)
        self._watching = contextlib.ExitStack()
        self._watching.enter_context(timeline.watch(self._on_event))
        print(
            f"prometheus: run {name!r} serves its metrics at "
            f"http://{socket.gethostname()}:{self.port}/metrics",
            flush=True,
        )

    def _on_event(self, name: str, start: float, dur_us: float | None, args: dict) -> None:
        """A span or instant of the run closed (any thread): count it."""
        if dur_us is None:  # an instant
            if name == "batch_ready":
                self.queued.set(args["queued"])
                self.staleness.set(args["batch"] - 1 - args["version"])
            return
        seconds = dur_us / 1e6
        self.span_seconds.labels(name).inc(seconds)
        if name == "generate":
            engine = str(args.get("engine"))
            self.busy.labels(engine).inc(seconds)
            self.calls.labels(engine).inc()
            self.tokens.labels(engine).inc(args.get("tokens", 0))
            with self._lock:
                self._busy_s[engine] = self._busy_s.get(engine, 0.0) + seconds
        elif name == "wait_rollout" and "queued" in args:
            self.queued.set(args["queued"])
        elif name == "gateway_request":
            self.latency.observe(seconds)
            if "error" in args:
                self.errors.labels(args["error"]).inc()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.steps.update(metrics, step)
        now = time.monotonic()
        with self._lock:
            then, before = self._mark
            busy = dict(self._busy_s)
            self._mark = (now, busy)
        for engine, seconds in busy.items():
            self.busy_share.labels(engine).set(
                (seconds - before.get(engine, 0.0)) / max(now - then, 1e-9)
            )

    def close(self) -> None:
        self._watching.close()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
