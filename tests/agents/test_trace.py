"""run.trace_every with the agents: each gateway request, environment step and tool call
is a span of its episode's track, inside the traced step's rollout, in a file the trace
schema accepts and Perfetto's trace processor imports as that."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polyrl.agents.tools import ToolEnv, tool
from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.observe import timeline
from polyrl.core.recipe import Config
from tests.helpers import perfetto
from tests.helpers.gateway import GRID_AGENT, gateway_recipe, small_grid
from tests.helpers.timeline import load_checked, parents, run_events

GRIDWORLD = Path(__file__).resolve().parents[2] / "examples" / "gridworld_gigpo.yaml"


def test_a_gateway_run_traces_each_request_within_the_rollout(grid_model_dir, tmp_path):
    cfg = load(
        Config,
        gateway_recipe(tmp_path, GRID_AGENT),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.save_every=0",
            "run.trace_every=2",
            *small_grid(tmp_path, grid_model_dir),
            "rollout.n=2",
            "rollout.prompts_per_step=2",
            "train.steps=2",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    spans = run_events(run.path)
    assert [e["args"]["step"] for e in spans if e["name"] == "step"] == [2]
    slices = perfetto.run_slices(run.path)  # as Perfetto reads the files
    pairs = perfetto.nesting(slices)
    assert {("rollout", "step"), ("update", "step"), ("micro_batch", "update")} <= pairs
    # each request on its episode's own named track, at the top of it
    tracks = {(s["thread"], s["parent"]) for s in slices if s["name"] == "gateway_request"}
    assert len(tracks) == 4 and all(t.startswith("episode ") and p is None for t, p in tracks)
    (step,) = [e for e in spans if e["name"] == "step"]
    (rollout,) = [e for e in spans if e["name"] == "rollout"]
    requests = [e for e in spans if e["name"] == "gateway_request"]
    # the grid agent asks once per turn (two turns) in each of the step's 4 episodes
    assert len({e["args"]["episode"] for e in requests}) == 4 and len(requests) >= 4
    for e in requests:  # on the episode's own track, in the rollout's time
        assert e["tid"] not in (step["tid"],)
        assert rollout["ts"] <= e["ts"] and e["ts"] + e["dur"] <= rollout["ts"] + rollout["dur"]
    by_episode: dict = {}
    for e in requests:
        by_episode.setdefault(e["args"]["episode"], set()).add(e["tid"])
    assert all(len(t) == 1 for t in by_episode.values())  # one track per episode


def test_a_multi_turn_run_traces_each_environment_step_on_its_episodes_track(
    grid_model_dir, tmp_path
):
    cfg = load(
        Config,
        str(GRIDWORLD),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.trace_every=1",
            *small_grid(tmp_path, grid_model_dir),
            "rollout.args={env: gridworld, mode: step, history: 0, max_turns: 3,"
            " max_turn_tokens: 2}",
            "rollout.n=2",
            "rollout.prompts_per_step=2",
            "train.steps=1",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    spans = run_events(run.path)
    (rollout,) = [e for e in spans if e["name"] == "rollout"]
    resets = [e for e in spans if e["name"] == "env_reset"]
    steps = [e for e in spans if e["name"] == "env_step"]
    assert sorted(e["args"]["episode"] for e in resets) == [0, 1, 2, 3]
    assert {e["args"]["episode"] for e in steps} == {0, 1, 2, 3}
    tracks: dict = {}
    for e in resets + steps + [e for e in spans if e["name"] == "env_close"]:
        assert rollout["ts"] <= e["ts"] and e["ts"] + e["dur"] <= rollout["ts"] + rollout["dur"]
        assert e["tid"] != rollout["tid"]  # the episode's own track
        tracks.setdefault(e["args"]["episode"], set()).add(e["tid"])
    assert all(len(t) == 1 for t in tracks.values()) and len(tracks) == 4
    for e in steps:  # turns in order on each track
        assert e["args"]["turn"] == sum(
            1 for o in steps if o["args"]["episode"] == e["args"]["episode"] and o["ts"] < e["ts"]
        )


@tool
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def test_a_tool_call_is_a_span_inside_the_environment_step_that_ran_it(tmp_path):
    env = ToolEnv([add])
    action = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    async def episode() -> None:  # as the multi_turn workflow steps an episode
        with timeline.span("env_step", lane="episode 7", episode=7):
            result = await env.step(action)
        assert result.observation[0]["content"] == "5"

    tracer = timeline.Tracer(tmp_path / "trace", every=1)
    with timeline.tracing(tracer), timeline.step(1):
        asyncio.run(episode())
    events = [e for e in load_checked(tracer.path) if e["ph"] == "X"]
    (call,) = [e for e in events if e["name"] == "tool_call"]
    assert call["args"] == {"tool": "add"}
    (outer,) = [p for e, p in parents(events) if e is call]
    assert outer["name"] == "env_step" and outer["tid"] == call["tid"]  # its episode's track
