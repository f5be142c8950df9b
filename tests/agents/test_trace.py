"""run.trace_every with the gateway: each agent request is a span of its episode's track,
inside the traced step's rollout, in a file the trace schema accepts."""

from __future__ import annotations

from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.recipe import Config
from tests.helpers.gateway import GRID_AGENT, gateway_recipe
from tests.helpers.timeline import nesting, run_events


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
            f"task.dir={tmp_path}/data",
            "sft.steps=0",
            "task.args={n_train: 8, n_eval: 4, size: 3, holes: 1, min_dist: 2}",
            f"policies.main.model={grid_model_dir}",
            "policies.main.build=null",
            "policies.main.build_args=null",
            "rollout.n=2",
            "rollout.prompts_per_step=2",
            "train.steps=2",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    spans = run_events(run.path)
    assert [e["args"]["step"] for e in spans if e["name"] == "step"] == [2]
    assert {("rollout", "step"), ("update", "step"), ("micro_batch", "update")} <= nesting(spans)
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
