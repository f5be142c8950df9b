"""A mixture-of-experts policy's multi-turn and gateway rows carry the experts the engine
routed their tokens to, so routing replay works on them (issue 32, core/train/moe.py).

References independent of core/train/moe.py's hooks and layouts: each row's tokens forwarded
whole, unpadded, with routers that compute their top-k by hand or route as told
(tests/helpers/moe.py).
"""

from __future__ import annotations

import pytest

from polyrl.agents.env import Environment, StepResult, register_env
from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.rollout.workflow import Context
from polyrl.core.train.moe import MoeConfig
from tests.helpers.moe import check_replayed_rows
from tests.helpers.trainer import make_policy

HERE = "tests.agents.test_agents_moe"
E, K = 4, 2


@register_env("test_agents_moe_echo")
class EchoEnv(Environment):
    """Two turns; each reply names the turn."""

    def reset(self, task):
        self.t = 0
        return task["prompt"]

    def step(self, action):
        self.t += 1
        return StepResult(f"turn {self.t} seen, go on", 0.0, self.t >= 2, {})


def two_chats(row, ep):
    """A gateway agent: a chat completion, then another continuing the conversation."""
    client = ep.openai()
    messages = [{"role": "user", "content": row["prompt"]}]
    for follow in ("and then?", None):
        r = client.chat.completions.create(model=ep.model, messages=messages, max_tokens=4)
        if follow is None:
            return 1.0
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": follow},
        ]


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    path = tiny_qwen3_moe(tmp_path_factory.mktemp("models") / "moe", num_experts=E, num_layers=2)
    return make_policy(str(path), moe=MoeConfig(replay="rollout"))


@pytest.mark.parametrize("mode", ["step", "concat"])
def test_multi_turn_rows_carry_and_replay_the_engines_experts(moe_policy, items, mode, one_thread):
    from polyrl.agents.workflow import MultiTurn

    policy = moe_policy
    wf = MultiTurn(
        Context(None, {"main": policy}, {"main": HFEngine(policy, seed=0)}),
        env="test_agents_moe_echo",
        mode=mode,
        max_turns=2,
        max_turn_tokens=4,
    )
    rows = [{"prompt": "go 1"}, {"prompt": "go 23"}]
    rec = wf.rollout(items(rows), SamplingParams(n=2, max_new_tokens=4, stop_token_ids=[]))
    turns = rec["turn"].tolist()
    assert (max(turns) == 1) if mode == "step" else (rec.batch_size[0] == 4)
    if mode == "concat":  # observations spliced in: their tokens are out of the loss
        assert bool((rec["loss_mask"] < rec["response_mask"]).any())
    check_replayed_rows(policy, rec, E)


def test_gateway_rows_carry_and_replay_the_engines_experts(moe_policy, items, one_thread):
    from polyrl.agents.gateway import Gateway

    policy = moe_policy
    wf = Gateway(
        Context(None, {"main": policy}, {"main": HFEngine(policy, seed=0)}),
        agent=f"{HERE}:two_chats",
    )
    try:
        rec = wf.rollout(items([{"prompt": "go 1"}]), SamplingParams(n=2, max_new_tokens=4))
    finally:
        wf.close()
    assert rec.batch_size[0] == 4 and sorted(rec["turn"].tolist()) == [0, 0, 1, 1]
    check_replayed_rows(policy, rec, E)
