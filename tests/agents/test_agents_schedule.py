"""``schedule: episode``: each episode goes back to the engine when its own step is done.

With environments that step inline it is the lock-step round, bitwise; with environments
that take time, a fast episode's next turn is served while a slow step is still running.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from polyrl.agents.env import Environment, StepResult, register_env
from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.agents import gw_rows


def _real_workflow(grid_model_dir, **args):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policy = CausalLMPolicy(
        "main", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    engine = HFEngine(policy, seed=0)
    return MultiTurn(Context(None, {"main": policy}, {"main": engine}), **args)


@register_env("test_agents_counted")
class CountedEnv(Environment):
    """A sync environment (steps inline) that ends after the task row's ``turns``."""

    def reset(self, task):
        self.turns, self.t = task["turns"], 0
        return task["prompt"]

    def step(self, action):
        self.t += 1
        return StepResult(f"again {self.t}", 0.0, self.t >= self.turns, {})


@pytest.mark.parametrize("mode", ["concat", "step"])
def test_with_inline_environments_episode_schedule_is_the_round_bitwise(
    grid_model_dir, items, mode
):
    args = dict(env="test_agents_counted", mode=mode, max_turns=6, max_turn_tokens=4)
    params = SamplingParams(n=3, max_new_tokens=4)
    rows = [dict(row, turns=t) for row, t in zip(gw_rows(3), (1, 4, 2), strict=True)]
    records, calls = {}, {}
    for schedule in ("round", "episode"):
        wf = _real_workflow(grid_model_dir, schedule=schedule, **args)
        records[schedule] = wf.rollout(items(rows), params)
        calls[schedule] = wf.generate_calls
    a, b = records["round"], records["episode"]
    assert calls["round"] == calls["episode"] > 1
    assert set(a.keys()) == set(b.keys())
    for key in sorted(a.keys()):
        if isinstance(a[key], torch.Tensor):  # reward is nan until scored
            assert torch.equal(a[key].nan_to_num(7.0), b[key].nan_to_num(7.0)), key
        else:
            assert strings(a, key) == strings(b, key), key
    turns = [m["turns"] for m in strings(a, "meta")]
    print("turns per episode:", turns)
    assert len(set(turns)) > 1  # episodes of different lengths: the rounds shrank


LOG: list[tuple[str, int, int]] = []


@register_env("test_agents_uneven_latency")
class UnevenLatencyEnv(Environment):
    """Task row ``delay`` seconds per step (an async tool call) and ``turns`` turns."""

    def __init__(self):
        self.t = 0

    async def reset(self, task):
        self.delay, self.turns, self.name = task["delay"], task["turns"], task["name"]
        return f"go {self.name}"

    async def step(self, action):
        LOG.append(("start", self.name, self.t))
        await asyncio.sleep(self.delay)
        self.t += 1
        LOG.append(("end", self.name, self.t))
        done = self.t >= self.turns
        return StepResult(f"turn {self.t}", 1.0 if done else 0.0, done, {"success": done})


def test_a_fast_episode_does_not_wait_for_a_slow_step(make_workflow, items):
    rows = [
        {"prompt": "slow", "name": 0, "delay": 0.5, "turns": 1},
        {"prompt": "fast", "name": 1, "delay": 0.0, "turns": 4},
    ]
    per_schedule = {}
    for schedule in ("round", "episode"):
        LOG.clear()
        wf, engine = make_workflow(
            lambda text, call, i: ("up", True),
            env="test_agents_uneven_latency",
            mode="concat",
            schedule=schedule,
            max_turns=6,
        )
        rec = wf.rollout(items(rows), SamplingParams(n=1, max_new_tokens=4))
        metas = strings(rec, "meta")
        assert [m["turns"] for m in metas] == [1, 4]
        assert all(m["success"] for m in metas)
        slow_end = LOG.index(("end", 0, 1))
        fast_steps_before = sum(1 for e in LOG[:slow_end] if e[0] == "end" and e[1] == 1)
        per_schedule[schedule] = (fast_steps_before, [len(c[0]) for c in engine.calls])
    # lock-step: the fast episode's second turn waits for the slow step of round one
    assert per_schedule["round"] == (1, [2, 1, 1, 1])
    # per episode: all of the fast episode's turns run while the slow step sleeps; the
    # first call still serves both (they were both waiting), the rest only the fast one
    assert per_schedule["episode"] == (4, [2, 1, 1, 1])


def test_an_engine_error_reaches_the_caller(make_workflow, items):
    def broken(text, call, i):
        if call == 1:
            raise RuntimeError("engine fell over")
        return "up", True

    wf, _ = make_workflow(
        broken, env="test_agents_uneven_latency", mode="concat", schedule="episode", max_turns=4
    )
    rows = [{"prompt": "x", "name": 0, "delay": 0.0, "turns": 3}]
    with pytest.raises(RuntimeError, match="engine fell over"):
        wf.rollout(items(rows), SamplingParams(n=2, max_new_tokens=4))
