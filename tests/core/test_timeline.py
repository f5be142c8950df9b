"""run.trace_every: the per-step timeline, read back as a trace viewer reads it."""

from __future__ import annotations

import contextvars
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from polyrl.core.config import ConfigError
from polyrl.core.loop import train
from polyrl.core.observe import timeline
from polyrl.core.observe.trace_report import summarize
from tests.helpers import perfetto
from tests.helpers.timeline import load_checked, nesting, run_events


def test_only_sampled_steps_record_and_threads_inherit_the_run(tmp_path):
    tracer = timeline.Tracer(tmp_path / "trace", every=2)
    with timeline.tracing(tracer):
        for n in range(1, 5):
            with timeline.step(n):
                with timeline.span("outer", n=n) as s:
                    s.add(later=True)
                    with timeline.span("inner"):
                        timeline.instant("mark")
                # a thread started with this context records into the same step
                worker = threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(
                        lambda: timeline.span("in_thread").__enter__().__exit__(None, None, None),
                    ),
                )
                worker.start()
                worker.join()
        with timeline.span("outside_a_step"):
            pass
    events = load_checked(tracer.path)
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "step") == [2, 4]
    assert [e["args"] for e in spans if e["name"] == "outer"] == [
        {"n": 2, "later": True},
        {"n": 4, "later": True},
    ]
    assert sum(e["name"] == "in_thread" for e in spans) == 2
    assert {e["tid"] for e in spans if e["name"] == "in_thread"} != {spans[0]["tid"]}
    assert not any(e["name"] == "outside_a_step" for e in spans)
    assert sum(e["ph"] == "i" for e in events) == 2
    assert {("inner", "outer"), ("outer", "step"), ("step", None)} <= nesting(spans)
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"trainer", "MainThread"} <= names  # process and thread named for the viewer


def test_a_killed_run_leaves_a_readable_trace(tmp_path):
    tracer = timeline.Tracer(tmp_path, every=1)
    with timeline.tracing(tracer), timeline.step(1), timeline.span("done"):
        pass
    # a kill mid-write: the last line cut short, no closing bracket
    with tracer.path.open("a") as f:
        f.write('{"pid": 1, "tid": 1, "ph": "X", "na')
    events = timeline.read_trace(tracer.path)
    assert [e["name"] for e in events if e["ph"] == "X"] == ["done", "step"]
    # Perfetto imports the file as the kill left it, the cut event dropped
    slices = perfetto.load(tracer.path)
    assert [(s["name"], s["parent"]) for s in slices] == [("step", None), ("done", "step")]
    tracer.path.write_text(tracer.path.read_text().rsplit("\n", 1)[0] + "\n")
    assert [e["name"] for e in load_checked(tracer.path) if e["ph"] == "X"] == ["done", "step"]


def test_a_failing_phase_is_recorded_with_its_error(tmp_path):
    tracer = timeline.Tracer(tmp_path, every=1)
    with (
        pytest.raises(ZeroDivisionError),
        timeline.tracing(tracer),
        timeline.step(1),
        timeline.span("update"),
    ):
        1 / 0  # noqa: B018
    spans = {e["name"]: e for e in load_checked(tracer.path) if e["ph"] == "X"}
    assert spans["update"]["args"]["error"] == "ZeroDivisionError"
    assert spans["step"]["args"]["error"] == "ZeroDivisionError"


def test_negative_trace_every_is_refused_at_load(make_config):
    with pytest.raises(ConfigError, match="run.trace_every"):
        make_config("run.trace_every=-1")


def test_an_async_run_traces_producer_and_trainer_nested(make_config, one_thread):
    """max_staleness 1: the producer thread's batches and the trainer's steps, each phase
    inside the one it belongs to (in the slice trees Perfetto's trace processor builds
    from the files); an untraced step writes nothing."""
    cfg = make_config(
        "train.steps=3",
        "run.trace_every=2",
        "rollout.max_staleness=1",
        "algorithm.ppo_epochs=2",
        "algorithm.kl_coef=0.01",
        "run.export=false",
    )
    run = train(cfg)
    spans = run_events(run.path)
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "step") == [2]
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "batch") == [2]
    slices = perfetto.run_slices(run.path)
    assert sorted(s["step"] for s in slices if s["name"] in ("step", "batch")) == [2, 2]
    pairs = perfetto.nesting(slices)
    expected = {
        ("step", None),
        ("rollout", "step"),
        ("wait_rollout", "rollout"),
        ("rewards", "step"),
        ("credit", "step"),
        ("update", "step"),
        ("old_logprobs", "update"),
        ("ref_logprobs", "update"),
        ("micro_batch", "update"),
        ("optimizer_step", "update"),
        ("weight_sync", "step"),
        ("batch", None),  # the producer's thread
        ("wait_staleness_bound", "batch"),
        ("load_weights", "batch"),
        ("rollout", "batch"),
        ("generate", "rollout"),
    }
    assert expected <= pairs, expected - pairs
    gen = [e for e in spans if e["name"] == "generate"]
    rows = cfg.rollout.n * cfg.rollout.prompts_per_step
    assert sum(e["args"]["requests"] for e in gen) == rows
    assert all(0 < e["args"]["tokens"] <= rows * cfg.rollout.max_new_tokens for e in gen)
    producer = {e["tid"] for e in spans if e["name"] == "batch"}
    assert producer.isdisjoint({e["tid"] for e in spans if e["name"] == "step"})
    # `polyrl trace` on the real trace: the summary's figures and a PNG of the step
    out = subprocess.run(
        [sys.executable, "-m", "polyrl.core.runner.cli", "trace", str(run.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "1 traced steps (2)" in out and "update" in out and "engine idle" in out
    assert re.search(r"async overlap: [\d.]+ s of [\d.]+ s generation", out)
    png = Path(out.strip().splitlines()[-1])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = summarize(run.path)
    assert sum(figures["phases"].values()) <= 1.0 + 1e-9
    assert 0 <= figures["overlap"] <= 1 and figures["generation_s"] > 0
    assert figures["slowest"][0][0] == "generate"


def test_trace_of_a_directory_without_one_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "polyrl.core.runner.cli", "trace", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "run.trace_every" in out.stderr
