"""run.trace_every with the signaling demo: both agents' engine calls within the rollout,
both policies' updates inside the step, in a file the trace schema accepts and Perfetto's
trace processor imports with that nesting."""

from __future__ import annotations

from polyrl.core.loop import train
from tests.helpers.perfetto import nesting, run_slices
from tests.helpers.timeline import run_events


def test_a_signaling_run_traces_both_agents(marl_config):
    run = train(marl_config("run.trace_every=1", "eval.every=0"))
    spans = run_events(run.path)
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "step") == [1, 2]
    slices = run_slices(run.path)  # as Perfetto reads the files
    assert sorted(s["step"] for s in slices if s["name"] == "step") == [1, 2]
    pairs = nesting(slices)
    expected = {
        ("rollout", "step"),
        ("rewards", "step"),
        ("credit", "step"),
        ("update", "step"),
        ("micro_batch", "update"),
        ("optimizer_step", "update"),
        ("weight_sync", "step"),
        ("checkpoint", "step"),
    }
    assert expected <= pairs, expected - pairs
    updates = [e["args"]["policies"] for e in spans if e["name"] == "update"]
    assert sorted(p for u in updates for p in u) == ["listener"] * 2 + ["speaker"] * 2
    # the engine calls run on the workflow's worker thread, within each step's rollout
    rollouts = [e for e in spans if e["name"] == "rollout"]
    calls = [e for e in spans if e["name"] == "generate"]
    assert {e["args"]["engine"] for e in calls} == {"speaker", "listener"}
    for e in calls:
        assert any(
            r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] for r in rollouts
        )
