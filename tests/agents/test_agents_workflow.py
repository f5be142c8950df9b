"""The multi-turn workflow: exact ids, masks across turns, one engine call per round, limits,
environment errors, step-wise rows, async environments."""

from __future__ import annotations

import asyncio

import pytest
import torch

from polyrl.agents.env import Environment, StepResult, register_env
from polyrl.agents.tools import ToolEnv, tool
from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.agents import gw_rows

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)


def moves(*actions, stop=True):
    """A script answering turn t (= call index) with actions[t] (the last one repeats)."""
    return lambda text, call, i: (actions[min(call, len(actions) - 1)], stop)


def rows_by_round(record, n_rounds):
    """For each engine call, the record rows (episodes) that were active in it, in order."""
    turns = [m["turns"] for m in strings(record, "meta")]
    return [[r for r, t in enumerate(turns) if t > c] for c in range(n_rounds)]


def test_concat_rows_keep_sampled_ids_and_mask_exactly_the_policy_tokens(
    make_workflow, items, grid_tokenizer
):
    wf, engine = make_workflow(
        moves("right", "down", "down", "right"), env="gridworld", mode="concat", max_turns=6
    )
    rec = wf.rollout(items(gw_rows()), PARAMS)
    assert rec.batch_size[0] == 4  # 2 tasks x 2 episodes, one row each
    assert len(engine.calls) == 4  # one call per turn round
    active = rows_by_round(rec, len(engine.calls))
    eos = grid_tokenizer.eos_token_id
    for r in range(4):
        meta = strings(rec, "meta")[r]
        n = int(rec["response_mask"][r].sum())
        response = rec["response_ids"][r, :n].tolist()
        mask = rec["loss_mask"][r, :n].tolist()
        logps = rec["rollout_logprobs"][r, :n].tolist()
        prompt = rec["prompt_ids"][r][rec["prompt_mask"][r].bool()].tolist()
        sampled_ids, sampled_lp = [], []
        for t, start, end in meta["spans"]:
            out = engine.calls[t][2][active[t].index(r)]
            # the engine was given exactly the record's prefix up to this turn
            assert engine.calls[t][0][active[t].index(r)] == prompt + response[:start]
            assert response[start:end] == out.token_ids  # exact ids, not re-encoded
            assert logps[start:end] == pytest.approx(out.logprobs)
            sampled_ids += out.token_ids
            sampled_lp += out.logprobs
        # the loss mask covers exactly the sampled tokens, in order
        assert [i for i, m in zip(response, mask, strict=True) if m] == sampled_ids
        assert all(lp == 0.0 for lp, m in zip(logps, mask, strict=True) if not m)
        # the re-encoded action text differs from what was sampled: nothing was re-encoded
        action = grid_tokenizer.encode("right", add_special_tokens=False) + [eos]
        assert sampled_ids[: len(action)] != action
        # the env tokens between turns read as the chat template's next user turn
        t0_end, t1_start = meta["spans"][0][2], meta["spans"][1][1]
        env_text = grid_tokenizer.decode(response[t0_end:t1_start], skip_special_tokens=False)
        assert env_text == (
            "\n<|im_start|>user\n" + meta["anchors"][1] + "<|im_end|>\n<|im_start|>assistant\n"
        )
    # right, down, down, right from the top-left corner reaches G: success, reward 1
    meta = strings(rec, "meta")[0]
    assert meta["actions"] == ["right", "down", "down", "right"]
    assert meta["success"] and meta["return"] == 1.0 and meta["finish"] == "done"
    assert not bool(rec["truncated"].any())


def test_an_action_cut_by_the_turn_limit_gets_its_end_token_from_the_env(
    make_workflow, items, grid_tokenizer
):
    wf, engine = make_workflow(
        moves("down", stop=False), env="gridworld", mode="concat", max_turns=2
    )
    rec = wf.rollout(items(gw_rows(1)), SamplingParams(n=1, max_new_tokens=8))
    meta = strings(rec, "meta")[0]
    end0, start1 = meta["spans"][0][2], meta["spans"][1][1]
    env = grid_tokenizer.decode(
        rec["response_ids"][0, end0:start1].tolist(), skip_special_tokens=False
    )
    assert env.startswith("<|im_end|>\n<|im_start|>user\n")  # closed for the policy, masked
    assert rec["loss_mask"][0, end0:start1].sum() == 0


def test_one_engine_call_per_round_batches_all_active_episodes(make_workflow, items):
    # Episode lengths differ: the first map is solved in 4 moves, the second one ends in
    # its hole after 2.
    wf, engine = make_workflow(
        moves("right", "down", "down", "right"), env="gridworld", mode="concat", max_turns=6
    )
    rows = gw_rows(2)
    rec = wf.rollout(items(rows), SamplingParams(n=3, max_new_tokens=8))
    turns = [m["turns"] for m in strings(rec, "meta")]
    assert len(engine.calls) == max(turns) == wf.generate_calls
    for c, (prompts, params, _) in enumerate(engine.calls):
        assert len(prompts) == sum(t > c for t in turns)  # every active episode, once
        assert params.n == 1
    assert rec.batch_size[0] == 6


def test_turn_limit_ends_the_episode_cleanly_as_truncated(make_workflow, items):
    wf, engine = make_workflow(moves("left"), env="gridworld", mode="concat", max_turns=3)
    rec = wf.rollout(items(gw_rows(1)), SamplingParams(n=2, max_new_tokens=8))
    for meta in strings(rec, "meta"):
        assert meta["turns"] == 3 and meta["finish"] == "max_turns"
        assert meta["return"] == 0.0 and not meta["success"]
    assert rec["truncated"].tolist() == [True, True]
    assert rec["valid"].tolist() == [True, True]
    assert len(engine.calls) == 3


def test_token_limit_cuts_the_last_action_and_ends_as_truncated(
    make_workflow, items, grid_tokenizer
):
    # "up" + eos is 3 sampled tokens (one per symbol); a budget of 7 allows two whole turns
    # and one token of the third, which is kept as sampled but not sent to the env.
    wf, engine = make_workflow(
        moves("up"), env="gridworld", mode="concat", max_turns=10, max_tokens=7
    )
    rec = wf.rollout(items(gw_rows(1)), SamplingParams(n=1, max_new_tokens=8))
    meta = strings(rec, "meta")[0]
    assert meta["finish"] == "max_tokens" and rec["truncated"].tolist() == [True]
    assert [e - s for _, s, e in meta["spans"]] == [3, 3, 1]
    assert int(rec["loss_mask"][0].sum()) == 7
    assert len(meta["turn_rewards"]) == 3 and len(meta["actions"]) == 3
    assert engine.calls[2][1].max_new_tokens == 1  # the call asked for the budget left
    # step mode: the same limit, one row per turn, all rows marked truncated
    wf, _ = make_workflow(moves("up"), env="gridworld", mode="step", max_turns=10, max_tokens=7)
    rec = wf.rollout(items(gw_rows(1)), SamplingParams(n=1, max_new_tokens=8))
    assert rec["turn"].tolist() == [0, 1, 2]
    assert rec["response_mask"].sum(1).tolist() == [3, 3, 1]
    assert rec["truncated"].tolist() == [True, True, True]


def test_context_limit_truncates_before_the_prompt_overflows(make_workflow, items):
    wf, _ = make_workflow(
        moves("left"), env="gridworld", mode="concat", max_turns=50, max_context=80
    )
    rec = wf.rollout(items(gw_rows(1)), SamplingParams(n=1, max_new_tokens=4))
    meta = strings(rec, "meta")[0]
    total = int(rec["prompt_mask"][0].sum() + rec["response_mask"][0].sum())
    assert meta["finish"] == "max_context" and total <= 80 and rec["truncated"].item()


@register_env("test_agents_flaky")
class FlakyEnv(Environment):
    """Raises in step for tasks marked ``boom`` (at turn 1) and in reset for ``boom_reset``."""

    def reset(self, task):
        if task.get("boom_reset"):
            raise OSError("the environment server is down")
        self.task, self.t = task, 0
        return "state 0"

    def step(self, action):
        self.t += 1
        if self.task.get("boom") and self.t == 2:
            raise RuntimeError("simulator crashed")
        return f"state {self.t}", 1.0 if self.t == 3 else 0.0, self.t == 3, {}


@pytest.mark.parametrize("mode", ["concat", "step"])
def test_an_env_that_raises_ends_only_its_episode_with_the_error_recorded(
    make_workflow, items, mode
):
    wf, _ = make_workflow(moves("go"), env="test_agents_flaky", mode=mode, max_turns=5)
    rows = [{"prompt": "a"}, {"prompt": "b", "boom": True}, {"prompt": "c", "boom_reset": True}]
    rec = wf.rollout(items(rows), SamplingParams(n=1, max_new_tokens=4))
    metas, errors = strings(rec, "meta"), strings(rec, "error")
    by_task = {}
    for i, m in enumerate(metas):
        by_task.setdefault(m["row"]["prompt"], []).append(i)
    ok, boom, reset = by_task["a"], by_task["b"], by_task["c"]
    assert all(rec["valid"][i] for i in ok) and all(errors[i] == "" for i in ok)
    assert metas[ok[0]]["success"] and metas[ok[0]]["turns"] == 3
    for i in boom:
        assert not rec["valid"][i]
        assert "step (turn 1) raised RuntimeError: simulator crashed" in errors[i]
        assert metas[i]["finish"] == "error"
    assert len(reset) == 1 and not rec["valid"][reset[0]]
    assert "reset raised OSError: the environment server is down" in errors[reset[0]]
    assert rec["response_mask"][reset[0]].sum() == 0


def test_step_mode_rows_hold_one_turn_with_bounded_history(make_workflow, items, grid_tokenizer):
    from polyrl.agents.chat import ChatFormat

    chat = ChatFormat(grid_tokenizer)
    acts = moves("right", "down", "down", "right")
    rows = gw_rows(1)
    for history in (0, 1, None):
        wf, engine = make_workflow(acts, env="gridworld", mode="step", history=history, max_turns=6)
        rec = wf.rollout(items(rows), SamplingParams(n=1, max_new_tokens=8))
        meta = strings(rec, "meta")
        assert rec["turn"].tolist() == [0, 1, 2, 3]
        assert all(
            m["episode"] == 0 and m["spans"] == [[t, 0, int(rec["response_mask"][t].sum())]]
            for t, m in enumerate(meta)
        )
        outs = [c[2][0] for c in engine.calls]
        for t in range(4):
            prompt = rec["prompt_ids"][t][rec["prompt_mask"][t].bool()].tolist()
            assert prompt == engine.calls[t][0][0]
            assert rec["response_ids"][t][: len(outs[t].token_ids)].tolist() == outs[t].token_ids
            anchors = meta[t]["anchors"]
            if history == 0:  # only the current observation
                assert prompt == chat.first_prompt([{"role": "user", "content": anchors[t]}])
            elif history == 1 and t >= 1:  # previous observation, its action, the env reply
                first = chat.first_prompt([{"role": "user", "content": anchors[t - 1]}])
                assert prompt[: len(first)] == first
                assert (
                    prompt[len(first) : len(first) + len(outs[t - 1].token_ids)]
                    == outs[t - 1].token_ids
                )
                assert grid_tokenizer.decode(prompt).endswith(
                    anchors[t] + "\nassistant\n"
                ) or anchors[t] in grid_tokenizer.decode(prompt)
        if history is None:  # the whole conversation: turn 3's prompt holds every action
            prompt = rec["prompt_ids"][3][rec["prompt_mask"][3].bool()].tolist()
            for out in outs[:3]:
                assert any(
                    prompt[k : k + len(out.token_ids)] == out.token_ids for k in range(len(prompt))
                )


@register_env("test_agents_slow_async")
class SlowAsyncEnv(Environment):
    """An async environment whose steps yield to the event loop while they run, counting
    how many steps are in flight at once (across all instances)."""

    in_flight = 0
    most_in_flight = 0

    async def reset(self, task):
        await asyncio.sleep(0)
        return "ready"

    async def step(self, action):
        cls = type(self)
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            await asyncio.sleep(0.01)
        finally:
            cls.in_flight -= 1
        return StepResult("done", 1.0, True, {"success": True})


def test_async_environments_step_concurrently(make_workflow, items):
    wf, engine = make_workflow(moves("go"), env="test_agents_slow_async", mode="concat")
    SlowAsyncEnv.most_in_flight = 0
    rec = wf.rollout(items([{"prompt": "x"}] * 4), SamplingParams(n=4, max_new_tokens=4))
    # one engine call for the round, then all 16 episodes' steps awaited together
    assert len(engine.calls) == 1 and SlowAsyncEnv.most_in_flight == 16
    assert rec.batch_size[0] == 16 and all(m["success"] for m in strings(rec, "meta"))


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


@register_env("test_agents_add")
class AddEnv(ToolEnv):
    def __init__(self):
        super().__init__([add])

    def reset(self, task):
        return "What is 2+3?"

    def finish(self, text, parsed):
        ok = "5" in text
        return StepResult("", float(ok), True, {"success": ok})


# "left" has a merged token in the grid tokenizer, so re-encoding would change the ids.
CALL = 'left <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
BAD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": }}</tool_call>'


def test_ids_stay_exact_around_tool_calls_and_results_are_masked(
    make_workflow, items, grid_tokenizer
):
    script = moves(CALL, BAD_CALL, "<answer>5</answer>")
    wf, engine = make_workflow(
        script, env="test_agents_add", mode="concat", max_turns=4, max_turn_tokens=120
    )
    rec = wf.rollout(items([{"prompt": "q"}]), SamplingParams(n=1, max_new_tokens=120))
    meta = strings(rec, "meta")[0]
    response = rec["response_ids"][0].tolist()
    assert len(meta["spans"]) == 3 and meta["success"]
    for (_t, s, e), (_, _, outs) in zip(meta["spans"], engine.calls, strict=True):
        assert response[s:e] == outs[0].token_ids  # the tool call's ids, as sampled
        assert rec["loss_mask"][0, s:e].tolist() == [1] * (e - s)
    canonical = grid_tokenizer.encode(CALL, add_special_tokens=False)
    assert engine.calls[0][2][0].token_ids[:-1] != canonical  # would differ if re-encoded
    env1 = grid_tokenizer.decode(response[meta["spans"][0][2] : meta["spans"][1][1]])
    env2 = grid_tokenizer.decode(response[meta["spans"][1][2] : meta["spans"][2][1]])
    assert "tool\n5" in env1  # the tool result, fed back as a tool message
    assert "Error: the tool call is not valid JSON" in env2  # told, not crashed
    assert rec["loss_mask"][0, meta["spans"][0][2] : meta["spans"][1][1]].sum() == 0


def test_real_engine_ids_and_logprobs_land_in_the_record(grid_model_dir, items):
    """With the HF engine and a tiny model: the record holds exactly what generate returned."""
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policy = CausalLMPolicy(
        "main", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    engine = HFEngine(policy, seed=0)
    seen = []
    real = engine.generate

    def recording(prompts, params):
        outs = real(prompts, params)
        seen.append((list(prompts), outs))
        return outs

    engine.generate = recording
    wf = MultiTurn(
        Context(None, {"main": policy}, {"main": engine}),
        env="gridworld",
        mode="concat",
        max_turns=3,
        max_turn_tokens=3,
    )
    rec = wf.rollout(items(gw_rows(2)), SamplingParams(n=2, max_new_tokens=3))
    active = rows_by_round(rec, len(seen))
    for r, meta in enumerate(strings(rec, "meta")):
        for t, s, e in meta["spans"]:
            out = seen[t][1][active[t].index(r)]
            assert rec["response_ids"][r, s:e].tolist() == out.token_ids
            assert torch.allclose(rec["rollout_logprobs"][r, s:e], torch.tensor(out.logprobs))
        mask = rec["loss_mask"][r].bool()
        assert int(mask.sum()) == sum(e - s for _, s, e in meta["spans"])


def test_recipe_arguments_are_checked_at_config_time(make_config):
    from polyrl.core.config import ConfigError

    with pytest.raises(ConfigError, match="did you mean rollout.args.max_turns"):
        make_config("rollout.workflow=multi_turn", "rollout.args={max_turn: 3}")
    with pytest.raises(ConfigError, match="mode"):
        make_config("rollout.workflow=multi_turn", "rollout.args={mode: tree}")
    with pytest.raises(ConfigError, match="max_turns must be >= 1"):
        make_config("rollout.workflow=multi_turn", "rollout.args={max_turns: 0}")
    with pytest.raises(ConfigError, match="rollout.args.policy='critic' is not one of"):
        make_config("rollout.workflow=multi_turn", "rollout.args={policy: critic}")
    with pytest.raises(ConfigError, match="unknown environment 'gridwrld'; did you mean"):
        make_config("rollout.workflow=multi_turn", "rollout.args={env: gridwrld}")
    # the environment's own options are checked against the environment, and typed
    with pytest.raises(
        ConfigError, match=r"rollout.args.env_args.goal in .*did you mean rollout.args.env_args"
    ):
        make_config("rollout.workflow=multi_turn", "rollout.args={env_args: {goal: 2.0}}")
    cfg = make_config(
        "rollout.workflow=multi_turn", "rollout.args={env_args: {goal_reward: 2, hint: safe}}"
    )
    env_args = cfg.rollout.args.env_args
    assert env_args.goal_reward == 2.0 and env_args.hint == "safe" and env_args.invalid == "stay"
