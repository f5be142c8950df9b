"""Through the core loop: an environment that raises in some episodes costs only those
episodes (error recorded on the row, counted in the metrics); the rest of the batch trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

from polyrl.agents.env import register_env
from polyrl.agents.gridworld import GridWorld

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gridworld_gigpo.yaml"


@register_env("test_agents_crashing_grid")
class CrashingGrid(GridWorld):
    """The grid world, except that its simulator crashes on maps whose start is in row 0.

    A small dense reward (the action's length) gives an untrained model's episodes different
    returns, so the surviving episodes have a non-zero gradient to train on."""

    def step(self, action):
        if self.start[0] == 0:
            raise RuntimeError(f"simulator crashed on map {'/'.join(self.grid)}")
        result = super().step(action)
        result.reward += 0.1 * len(action.strip())
        return result


def test_a_raising_env_costs_only_its_episodes_and_the_batch_trains(grid_model_dir, tmp_path):
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        str(RECIPE),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.save_every=0",
            "run.samples_per_step=1000",
            f"task.dir={tmp_path}/data",
            "sft.steps=0",
            "task.args={n_train: 16, n_eval: 4, size: 3, holes: 1, min_dist: 2}",
            f"policies.main.model={grid_model_dir}",
            "policies.main.build=null",
            "policies.main.build_args=null",
            "rollout.args={env: test_agents_crashing_grid, mode: step, history: 0, max_turns: 3,"
            " max_turn_tokens: 2}",
            "rollout.n=4",
            "rollout.prompts_per_step=8",
            "train.steps=2",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/errors" in r and r["step"] >= 1]
    assert len(steps) == 2
    errors = sum(r["episode/errors"] for r in steps)
    assert 0 < errors < sum(r["episode/count"] for r in steps)  # some episodes, not all
    for r in steps:
        assert r["rollout/valid_frac"] < 1.0 or r["episode/errors"] == 0
        assert math.isfinite(r["main/loss"]) and r["main/grad_norm"] > 0  # the rest trained
    # the error text is on the rows, where the transcripts show it
    samples = [
        json.loads(x)
        for p in sorted((run.path / "samples").glob("train_step_*"))
        for x in p.read_text().splitlines()
    ]
    crashed = [s for s in samples if s["error"]]
    assert crashed and all(
        "step (turn 0) raised RuntimeError: simulator crashed" in s["error"] for s in crashed
    )
    assert crashed[0]["reward"] is None  # left out, not scored 0
    # a step-mode line is one turn; it also says which episode it is and how that went
    for line in samples:
        assert 0 <= line["turn"] < line["turns"] <= 3 and len(line["actions"]) == line["turns"]
        assert line["actions"][line["turn"]] == line["response"]
        assert isinstance(line["success"], bool) and line["finish"]
    by_episode: dict = {}  # episode ids count within a step's rollout
    for p in sorted((run.path / "samples").glob("train_step_*")):
        for x in p.read_text().splitlines():
            line = json.loads(x)
            by_episode.setdefault((p.name, line["episode"]), []).append(line["turn"])
    assert any(len(turns) > 1 for turns in by_episode.values())
    assert all(turns == list(range(len(turns))) for turns in by_episode.values())
