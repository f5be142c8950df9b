"""The environment API and the grid world (env and task)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from polyrl.agents import gridworld as gw
from polyrl.agents.env import (
    Environment,
    StepResult,
    as_messages,
    as_step_result,
    env_options,
    make_env_factory,
    observation_text,
    register_env,
)
from polyrl.core.config import ConfigError, doc
from polyrl.core.options import Options
from polyrl.core.registry import ENVIRONMENTS, TASKS, UnknownNameError

GRID = ["S.H", "...", "H.G"]


@register_env("test_agents_counter")
class Counter(Environment):
    def __init__(self, target: int = 2):
        self.target = target

    def reset(self, task):
        self.n = int(task.get("start", 0))
        return f"n={self.n}"

    def step(self, action):
        self.n += action.strip() == "inc"
        return f"n={self.n}", float(self.n == self.target), self.n == self.target, {}


def test_registry_names_and_import_paths_build_fresh_instances():
    make = make_env_factory("test_agents_counter", {"target": 3})
    a, b = make(), make()
    assert a is not b and a.target == 3  # state lives on each instance
    a.reset({"start": 1})
    b.reset({})
    assert a.step("inc")[0] == "n=2" and b.n == 0
    by_path = make_env_factory("polyrl.agents.gridworld:GridWorld")()
    assert isinstance(by_path, gw.GridWorld)
    assert ENVIRONMENTS.get("gridworld") is gw.GridWorld


def test_bad_names_and_arguments_fail_with_a_hint():
    with pytest.raises(UnknownNameError, match="did you mean 'gridworld'"):
        make_env_factory("gridwold")
    with pytest.raises(ConfigError, match="environment 'gridworld' has no option 'size'"):
        make_env_factory("gridworld", {"size": 3})
    with pytest.raises(ConfigError, match="invalid='fall' .* is not one of"):
        make_env_factory("gridworld", {"invalid": "fall"})
    with pytest.raises(ConfigError, match="target .* must be an integer"):
        make_env_factory("test_agents_counter", {"target": "three"})


class NoInit:
    """An environment class that defines no ``__init__`` (and no base class)."""

    def reset(self, task):
        return "x"


class TakesKwargs(Environment):
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@dataclass
class KwargsOptions(Options):
    depth: int = doc(1, "how deep")


register_env("test_agents_kwargs_declared", options=KwargsOptions)(TakesKwargs)


class TakesKwargsUndeclared(TakesKwargs):
    pass


def test_environment_options_are_declared_by_the_constructor_or_registration():
    assert not env_options(f"{__name__}:NoInit").keys()
    assert isinstance(make_env_factory(f"{__name__}:NoInit")(), NoInit)
    with pytest.raises(ConfigError, match="it takes no options"):
        env_options(f"{__name__}:NoInit", {"x": 1})
    grid = env_options("gridworld", {"hint": "safe"})
    assert grid.hint == "safe" and grid.invalid == "stay"  # typed, with the defaults
    made = make_env_factory("test_agents_kwargs_declared", {"depth": 3})()
    assert made.kwargs == {"depth": 3}
    with pytest.raises(TypeError, match="takes \\*\\*kwargs"):  # undeclared: cannot be checked
        env_options(f"{__name__}:TakesKwargsUndeclared")


def test_step_results_and_observations_are_normalised():
    r = as_step_result(("obs", 1, 0, None))
    assert r == StepResult("obs", 1.0, False, {})
    assert as_step_result(("obs", 0.5, True)).done is True
    with pytest.raises(TypeError, match="must return"):
        as_step_result("obs")
    with pytest.raises(ValueError, match="NaN"):
        as_step_result(("obs", float("nan"), False, {}))
    with pytest.raises(TypeError, match="non-numeric reward"):
        as_step_result(("obs", "high", False, {}))
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    tool = {"role": "tool", "content": "42"}
    assert as_messages(tool) == [tool] and as_messages([tool, tool]) == [tool, tool]
    assert observation_text([tool, {"role": "user", "content": "go"}]) == "42\ngo"
    with pytest.raises(TypeError, match="observation must be"):
        as_messages(3)


def test_gridworld_moves_walls_holes_goal_and_invalid_actions():
    env = gw.GridWorld()
    obs = env.reset({"grid": GRID})
    assert obs == "P F H\nF F F\nH F G"
    assert env.step("up").observation == obs  # the edge: stay
    r = env.step(" Right ")
    assert r.observation == "F P H\nF F F\nH F G" and not r.done and r.reward == 0
    r = env.step("jump")
    assert r.info == {"invalid": True} and not r.done
    r = env.step("right")  # into the hole
    assert r.done and r.reward == 0 and r.info["success"] is False and r.info["hole"]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("down")
    env.reset({"grid": GRID})
    for a in ("down", "right", "down", "right"):
        r = env.step(a)
    assert r.done and r.reward == 1.0 and r.info == {"success": True}


def test_hints_list_admissible_moves():
    assert gw.render(GRID, (0, 0), "exits").endswith("\nmoves: down right")
    assert gw.render(GRID, (1, 1), "safe").endswith("\nmoves: up down left right")
    assert gw.render(GRID, (0, 1), "safe").endswith("\nmoves: down left")
    env = gw.GridWorld()
    assert env.reset({"grid": GRID, "hint": "safe"}).endswith("moves: down right")
    assert gw.GridWorld(hint="none").reset({"grid": GRID, "hint": "safe"}) == "P F H\nF F F\nH F G"


def test_maps_are_solvable_and_respect_the_layout():
    import random

    rng = random.Random(0)
    for _ in range(50):
        g = gw.random_grid(rng, 4, 3, min_dist=3, fixed_goal=True)
        assert g[3][3] == "G" and gw.shortest_path(g) >= 3
        assert sum(row.count("H") for row in g) == 3
    with pytest.raises(ValueError, match="cannot place"):
        gw.random_grid(rng, 2, 5)


def test_task_writes_disjoint_train_and_eval_rows(tmp_path):
    task = TASKS.get("gridworld")
    train, eval_ = task.write_dataset(
        tmp_path, seed=3, n_train=40, n_eval=20, size=4, holes=2, fixed_goal=True, hint="exits"
    )
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    held = [json.loads(x) for x in eval_.read_text().splitlines()]
    assert len(rows) == 40 and len(held) == 20
    assert not {r["uid"] for r in rows} & {r["uid"] for r in held}
    env = gw.GridWorld()
    for r in rows[:5]:
        assert env.reset(r) == r["prompt"] and r["hint"] == "exits"
        assert int(r["answer"]) == gw.shortest_path(r["grid"])
    with pytest.raises(ValueError, match="distinct"):
        task.make_rows(500, 0, size=2, holes=0)


def test_sft_rows_teach_only_the_format(tmp_path):
    rows = gw.make_rows(30, 0, size=3, holes=1, hint="exits")
    sft = gw.sft_rows(rows)
    assert len(sft) >= 30
    for r in sft:
        listed = r["prompt"].rsplit("moves: ", 1)[1].split()
        assert r["response"] in listed  # one of the listed moves, chosen at random
    plain = gw.sft_rows(gw.make_rows(30, 0, size=3, holes=1))
    assert {r["response"] for r in plain} == set(gw.ACTIONS)


def test_corpus_covers_every_string_the_game_uses(grid_tokenizer):
    texts = " ".join(gw.corpus())
    for word in (*gw.ACTIONS, "moves:", "P", "F", "H", "G"):
        assert word in texts
    for action in gw.ACTIONS:  # each action is one token, so one sampled id is one move
        assert len(grid_tokenizer.encode(action, add_special_tokens=False)) == 1
