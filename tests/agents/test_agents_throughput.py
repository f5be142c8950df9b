"""tokens/s of multi-turn agents: only the tokens the model sampled count as generated, not
the observations the environment spliced into the rows; all of them run forward. A grid
world run (the multi-turn workflow) and a gateway run: one step against the hand count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.observe.throughput import Throughput
from polyrl.core.recipe import Config
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.train.algorithms import AlgorithmConfig
from tests.helpers.agents import gw_rows
from tests.helpers.gateway import GRID_AGENT, gateway_recipe, small_grid
from tests.helpers.throughput import ONE_PASS, Cost, check_by_hand, linear_weights, logged_step

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gridworld_gigpo.yaml"


def test_generated_tokens_are_the_models_not_the_environments(make_workflow, items):
    actions = ["right", "down", "down", "right"]  # top-left to the goal: four turns
    wf, engine = make_workflow(
        lambda text, call, i: (actions[min(call, 3)], True), env="gridworld", max_turns=6
    )
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    rec = wf.rollout(items(gw_rows()), params)
    assert rec.batch_size[0] == 4 and len(engine.calls) == 4  # 2 tasks x 2, one row each
    # by hand: the scripted engine writes one token per letter, then the end token; on the
    # first grid (S.H / ... / H.G) the four moves reach the goal, on the second (S.. / .H. /
    # ..G) "right, down" falls into the hole after two turns; each task runs 2 episodes
    sampled = 2 * (6 + 5 + 5 + 6) + 2 * (6 + 5)
    rec["valid"] = torch.ones(4, dtype=torch.bool)
    out = Throughput({"main": object()}, AlgorithmConfig(), peak=1.0).step(
        rec, step_s=2.0, update_s={"main": 0.5}
    )
    assert out["perf/main/gen_tokens"] == sampled
    assert out["perf/gen_tokens_per_s"] == sampled / 2.0
    # the rows' responses hold the observations too: more tokens than the model sampled,
    # and the update runs them all (prompt + response) forward
    response = int(rec["response_mask"].sum())
    assert response > sampled
    assert out["perf/main/train_tokens"] == response + int(rec["prompt_mask"].sum())


def _grid_cost(model_dir: str) -> Cost:
    """The grid model's cost by hand: weights from its modules, width from its config."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    c = model.config
    width = c.num_attention_heads * (
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    )
    return Cost(linear_weights(model), c.num_hidden_layers, width)


def _grid_overrides(tmp_path, model_dir: str) -> list[str]:
    return [
        f"run.dir={tmp_path}/run",
        "run.progress=false",
        "run.tensorboard=false",
        "run.export=false",
        *small_grid(tmp_path, model_dir),
        "rollout.n=2",
        "rollout.prompts_per_step=4",
        "train.steps=1",
        "eval.every=0",
        *ONE_PASS,
    ]


@pytest.mark.parametrize("mode", ["step", "concat"])
def test_a_grid_world_runs_step_against_the_hand_count(grid_model_dir, tmp_path, mode):
    # the demo's step mode (a row per turn) and concat (a row per episode: the map after
    # each move is spliced into the row)
    args = f"rollout.args={{env: gridworld, mode: {mode}, history: 0, max_turns: 4, max_turn_tokens: 2}}"
    cfg = load(Config, str(RECIPE), [*_grid_overrides(tmp_path, grid_model_dir), args])
    run = train(cfg)
    check_by_hand(run.path, {"main": _grid_cost(grid_model_dir)})
    _, rows = logged_step(run.path)
    generated = sum(r["generated_tokens"] for r in rows)
    response = sum(r["response_tokens"] for r in rows)
    if mode == "concat":  # the maps are in the rows, not in what the model generated
        assert generated < response


def test_a_gateway_runs_step_against_the_hand_count(grid_model_dir, tmp_path):
    cfg = load(
        Config, gateway_recipe(tmp_path, GRID_AGENT), _grid_overrides(tmp_path, grid_model_dir)
    )
    run = train(cfg)
    check_by_hand(run.path, {"main": _grid_cost(grid_model_dir)})
