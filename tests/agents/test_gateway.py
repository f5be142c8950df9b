"""The agent gateway: a real server, the real ``openai`` client, the real HF engine.

Agents below are what a user writes: functions that get a task row and an endpoint and
talk to it only through the ``openai`` package. The record is checked against what the
engine sampled (a spy around the real engine keeps its answers) and against the chat
template rendered independently.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.gateway import (
    GRID_AGENT,
    SpyEngine,
    by_episode,
    first,
    gateway_recipe,
    ids,
    rows,
    small_grid,
    spied_models,
)

RESULTS: dict = {}
HERE = "tests.agents.test_gateway"


@pytest.fixture(scope="module")
def models(grid_model_dir):
    return spied_models(grid_model_dir, SpyEngine)


@pytest.fixture
def gateway(models):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    made = []

    def make(agent, **args):
        policies, engines = models
        for e in engines.values():
            e.log.clear()
        wf = Gateway(Context(None, policies, engines), agent=f"{HERE}:{agent}", **args)
        made.append(wf)
        return wf

    yield make
    for wf in made:
        wf.close()


# --------------------------------------------------------------------------- agents


def chat_agent(row, ep):
    client = ep.openai()
    r = client.chat.completions.create(
        model=row["model"],
        messages=[{"role": "user", "content": row["prompt"]}],
        n=3,
        logprobs=True,
        max_tokens=5,
        seed=7,
    )
    RESULTS[("chat", ep.episode)] = r
    return {"reward": 0.25, "success": True}


def stop_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    full = client.chat.completions.create(model="main", messages=msgs, temperature=0, max_tokens=8)
    text = full.choices[0].message.content
    stop = text[2:4]
    cut = client.chat.completions.create(
        model="main", messages=msgs, temperature=0, max_tokens=8, stop=[stop]
    )
    RESULTS[("stop", ep.episode)] = (full, cut, stop)
    return 1.0


def error_agent(row, ep):
    seen = {}
    msgs = [{"role": "user", "content": row["prompt"]}]
    wrong = openai.OpenAI(base_url=ep.base_url, api_key="sk-wrong", max_retries=0)
    client = ep.openai()
    cases = {
        "wrong_key": lambda: wrong.chat.completions.create(model="main", messages=msgs),
        "unknown_model": lambda: client.chat.completions.create(model="gpt-4o", messages=msgs),
        "no_messages": lambda: client.chat.completions.create(model="main", messages=[]),
        "bad_role": lambda: client.chat.completions.create(
            model="main", messages=[{"role": "robot", "content": "hi"}]
        ),
        "hot": lambda: client.chat.completions.create(model="main", messages=msgs, temperature=7),
        "n0": lambda: client.chat.completions.create(model="main", messages=msgs, n=0),
        "long": lambda: client.chat.completions.create(
            model="main", messages=msgs, max_tokens=10_000
        ),
        "stream_options": lambda: client.chat.completions.create(
            model="main", messages=msgs, stream_options={"include_usage": True}
        ),
    }
    for name, call in cases.items():
        try:
            call()
            seen[name] = (200, "")
        except openai.APIStatusError as e:
            seen[name] = (e.status_code, str(e.message))
    raw = httpx.post(
        ep.base_url + "/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {ep.api_key}"},
    )
    seen["not_json"] = (raw.status_code, raw.json()["error"]["message"])
    listed = client.models.list()
    seen["models"] = sorted(m.id for m in listed.data)
    client.chat.completions.create(model="main", messages=msgs, max_tokens=2)
    RESULTS[("errors", ep.episode)] = seen
    return 1.0


async def concurrent_agent(row, ep):
    client = ep.async_openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    for t in range(2):
        r = await client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"again {t}"},
        ]
    await client.close()
    return float(row["k"])


def five_turn_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    for t in range(5):
        r = client.chat.completions.create(
            model="main", messages=msgs, max_tokens=6, temperature=1.0
        )
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"turn {t}"},
        ]
    return 0.5


def unruly_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    kind = row["kind"]
    if kind == "silent":
        return 1.0
    r = client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
    if kind == "fail":
        raise ValueError("the agent gave up")
    if kind == "slow":
        time.sleep(1.5)  # past the episode's timeout: the run has moved on
        try:
            client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
            RESULTS[("late", ep.episode)] = 200
        except openai.APIStatusError as e:
            RESULTS[("late", ep.episode)] = e.status_code
        return 1.0
    # "edit": the agent rewrites its own earlier reply before the next request
    msgs += [
        {"role": "assistant", "content": "EDITED " + r.choices[0].message.content},
        {"role": "user", "content": "next"},
    ]
    client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
    RESULTS[("edit", ep.episode)] = msgs
    return 1.0


async def async_slow_agent(row, ep):
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        RESULTS[("cancelled", ep.episode)] = True
        raise
    return 1.0


# --------------------------------------------------------------------------- tests


def test_chat_n_logprobs_and_two_models(gateway, models, items):
    policies, _ = models
    tok = policies["main"].tokenizer
    wf = gateway("chat_agent")
    data = rows("grid S.G", model="main") + rows("grid G.S", model="checker")
    rec = wf.rollout(items(data), SamplingParams(n=2, max_new_tokens=8))
    metas, policy = strings(rec, "meta"), strings(rec, "policy")
    episodes = by_episode(rec)
    assert len(episodes) == 4 and rec.batch_size[0] == 12
    assert rec["valid"].all()
    for e, idx in episodes.items():
        r = RESULTS[("chat", e)]
        row = metas[idx[0]]["row"]
        assert r.model == row["model"] and len(r.choices) == 3
        assert [metas[i]["choice"] for i in idx] == [0, 1, 2]
        prompt = first([{"role": "user", "content": row["prompt"]}], tok)
        assert r.usage.prompt_tokens == len(prompt)
        for i, choice in zip(idx, r.choices, strict=True):
            assert policy[i] == row["model"]
            assert ids(rec, "prompt_ids", i) == prompt
            resp = ids(rec, "response_ids", i)
            assert 1 <= len(resp) <= 5
            assert choice.message.content == tok.decode(resp, skip_special_tokens=True)
            lps = [c.logprob for c in choice.logprobs.content]
            assert "".join(c.token for c in choice.logprobs.content) == tok.decode(resp)
            assert torch.equal(
                torch.tensor(lps, dtype=torch.float32), rec["rollout_logprobs"][i][: len(resp)]
            )
            ended = resp[-1] == tok.eos_token_id
            assert choice.finish_reason == ("stop" if ended else "length")
            assert metas[i]["return"] == 0.25 and metas[i]["success"] is True
            assert metas[i]["turn_rewards"] == [0.25]
    # each model's requests went to its own engine
    _, engines = models
    served = {name: {tuple(p) for p, _ in e.log} for name, e in engines.items()}
    main_prompt = tuple(first([{"role": "user", "content": "grid S.G"}], tok))
    assert main_prompt in served["main"] and main_prompt not in served["checker"]


def seeded_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]

    def ask(seed):
        r = client.chat.completions.create(
            model="main", messages=msgs, n=2, max_tokens=8, logprobs=True, seed=seed
        )
        return [(c.message.content, [t.logprob for t in c.logprobs.content]) for c in r.choices]

    RESULTS[("seeded", ep.episode)] = (ask(11), ask(11), ask(12))
    return 1.0


def test_a_seeded_request_repeats_and_leaves_the_run_stream_alone(gateway, models, items):
    _, engines = models
    before = engines["main"].engine.state_dict()["rng"].clone()
    wf = gateway("seeded_agent")
    rec = wf.rollout(items(rows("grid S.G", "grid G.S")), SamplingParams(n=2, max_new_tokens=8))
    assert rec["valid"].all()
    runs = [RESULTS[("seeded", e)] for e in by_episode(rec)]
    assert len(runs) == 4
    for once, again, _ in runs:
        assert once == again  # same tokens, same log-probs
    assert any(once != other for once, _, other in runs)
    assert any(once[0] != once[1] for once, _, _ in runs)  # n choices: two draws, not one
    assert engines["main"].engine.state_dict()["rng"].equal(before)


def test_stop_sequences_cut_the_answer(gateway, items):
    wf = gateway("stop_agent")
    rec = wf.rollout(items(rows("grid S.G", "grid G.S")), SamplingParams(n=1, max_new_tokens=8))
    assert rec["valid"].all()
    for e, idx in by_episode(rec).items():
        full, cut, stop = RESULTS[("stop", e)]
        text = full.choices[0].message.content
        assert len(stop) == 2 and stop in text
        assert cut.choices[0].message.content == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"
        a, b = ids(rec, "response_ids", idx[0]), ids(rec, "response_ids", idx[1])
        assert len(b) < len(a) and a[: len(b)] == b  # greedy: the same tokens, cut sooner


def test_bad_requests_get_openai_errors(gateway, items):
    wf = gateway("error_agent")
    rec = wf.rollout(items(rows("grid S.G")), SamplingParams(n=1, max_new_tokens=8))
    assert rec["valid"].all() and rec.batch_size[0] == 1
    seen = RESULTS[("errors", 0 + by_episode(rec).popitem()[0])]
    assert seen["wrong_key"][0] == 401
    status, msg = seen["unknown_model"]
    assert status == 404 and "gpt-4o" in msg and "main" in msg and "checker" in msg
    for case, needle in (
        ("no_messages", "messages"),
        ("bad_role", "role"),
        ("hot", "temperature"),
        ("n0", "n must be"),
        ("long", "max_tokens"),
        ("stream_options", "stream: true"),
        ("not_json", "not valid JSON"),
    ):
        status, msg = seen[case]
        assert status == 400 and needle in msg, (case, status, msg)
    assert seen["models"] == ["checker", "main"]


def test_64_concurrent_async_episodes_share_engine_calls(gateway, items, models):
    _, engines = models
    wf = gateway("concurrent_agent", concurrency=64)
    data = [{"prompt": f"grid {k}", "k": k % 2} for k in range(16)]
    rec = wf.rollout(items(data), SamplingParams(n=4, max_new_tokens=4))
    metas = strings(rec, "meta")
    episodes = by_episode(rec)
    assert len(episodes) == 64 and rec.batch_size[0] == 128
    assert rec["valid"].all()
    for idx in episodes.values():
        assert [metas[i]["turn"] for i in idx] == [0, 1]
        assert [metas[i]["stitched"] for i in idx] == [False, True]
        assert metas[idx[0]]["return"] == float(metas[idx[0]]["row"]["k"])
    sizes = wf.server.batcher.sizes
    print("requests per engine call:", sizes)
    assert sum(sizes) == 128 and len(sizes) < 64 and max(sizes) >= 16
    assert len(engines["main"].log) == 128


def test_a_group_renders_its_shared_messages_once_and_exactly(gateway, models, items):
    """The samples of a group send the same messages: rendered once, reused, and every
    row's prompt is still the template's rendering (fresh) or the stitched splice."""
    policies, _ = models
    tok = policies["main"].tokenizer
    wf = gateway("concurrent_agent")
    data = [{"prompt": "grid S.G", "k": 1}, {"prompt": "grid .SG", "k": 0}]
    rec = wf.rollout(items(data), SamplingParams(n=4, max_new_tokens=4))
    assert rec["valid"].all() and rec.batch_size[0] == 16
    metas = strings(rec, "meta")
    for idx in by_episode(rec).values():
        question = [{"role": "user", "content": metas[idx[0]]["row"]["prompt"]}]
        assert ids(rec, "prompt_ids", idx[0]) == first(question, tok)
        before = ids(rec, "prompt_ids", idx[0]) + ids(rec, "response_ids", idx[0])
        close = "\n" if before[-1] == tok.eos_token_id else "<|im_end|>\n"
        joint = f"{close}<|im_start|>user\nagain 0<|im_end|>\n<|im_start|>assistant\n"
        assert ids(rec, "prompt_ids", idx[1]) == before + tok.encode(
            joint, add_special_tokens=False
        )
    kinds = [key[0] for key in wf.server._renders.data]
    # 16 requests: two first prompts, one "again 0" turn per way the reply ended
    assert kinds.count("first") == 2 and 1 <= kinds.count("turn") <= 2


def test_five_turns_are_token_exact(gateway, models, items):
    policies, engines = models
    tok = policies["main"].tokenizer
    wf = gateway("five_turn_agent")
    rec = wf.rollout(items(rows("grid S.G", "grid .SG")), SamplingParams(n=1, max_new_tokens=8))
    metas = strings(rec, "meta")
    assert rec["valid"].all() and rec.batch_size[0] == 10
    served = [(p, o.token_ids, o.logprobs) for p, o in engines["main"].log]
    for idx in by_episode(rec).values():
        assert [metas[i]["turn"] for i in idx] == [0, 1, 2, 3, 4]
        assert [metas[i]["stitched"] for i in idx] == [False, True, True, True, True]
        for t, i in enumerate(idx):
            prompt, resp = ids(rec, "prompt_ids", i), ids(rec, "response_ids", i)
            lps = rec["rollout_logprobs"][i][: len(resp)]
            # the row is exactly a (prompt, completion) the engine produced
            match = [s for s in served if s[0] == prompt and s[1] == resp]
            assert match, f"row {i} is not what the engine sampled"
            assert torch.equal(torch.tensor(match[0][2], dtype=torch.float32), lps)
            if t == 0:
                continue
            prev = idx[t - 1]
            before = ids(rec, "prompt_ids", prev) + ids(rec, "response_ids", prev)
            close = "\n" if before[-1] == tok.eos_token_id else "<|im_end|>\n"
            joint = f"{close}<|im_start|>user\nturn {t - 1}<|im_end|>\n<|im_start|>assistant\n"
            assert prompt == before + tok.encode(joint, add_special_tokens=False)
    recomputed, _ = policies["main"].logprobs(rec, 1.0)
    mask = rec["loss_mask"].bool()
    gap = (recomputed.detach() - rec["rollout_logprobs"])[mask].abs().max().item()
    print("max |trainer - engine| log-prob:", gap)
    assert gap < 1e-5


def test_failed_slow_silent_and_editing_agents(gateway, models, items):
    tok, engine = models[0]["main"].tokenizer, models[1]["main"]
    wf = gateway("unruly_agent", episode_timeout=0.8)
    data = [{"prompt": f"grid {k}", "kind": k} for k in ("edit", "fail", "slow", "silent")]
    rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=8))
    metas, errors = strings(rec, "meta"), strings(rec, "error")
    kind = [m["row"]["kind"] for m in metas]
    valid = rec["valid"].tolist()
    assert kind == ["edit", "edit", "fail", "slow", "silent"]
    assert valid == [True, True, False, False, False]
    assert "ValueError: the agent gave up" in errors[2]
    assert "episode_timeout=0.8" in errors[3]
    assert "without asking the gateway" in errors[4]
    assert all(metas[i]["episode_weight"] == 0.0 for i in (2, 3, 4))
    assert wf.failed_episodes == 3
    # the edited history is rendered afresh: exact for what the engine saw, not stitched
    assert metas[1]["stitched"] is False
    msgs = RESULTS[("edit", metas[1]["episode"])]
    assert ids(rec, "prompt_ids", 1) == first(msgs, tok)
    # the abandoned agent's later request is refused and never reaches the engine
    served = len(engine.log)
    for _ in range(400):
        if ("late", metas[3]["episode"]) in RESULTS:
            break
        time.sleep(0.01)
    assert RESULTS[("late", metas[3]["episode"])] == 404
    assert len(engine.log) == served


def test_an_async_agent_past_its_timeout_is_cancelled(gateway, items):
    wf = gateway("async_slow_agent", episode_timeout=0.3)
    rec = wf.rollout(items(rows("grid S.G")), SamplingParams(n=2, max_new_tokens=4))
    assert not rec["valid"].any()
    assert all(RESULTS.get(("cancelled", e)) for e in by_episode(rec))  # cancelled, not awaited
    assert all("episode_timeout" in e for e in strings(rec, "error"))


CALC = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


def tool_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    first_reply = client.chat.completions.create(model="main", messages=msgs, tools=[CALC])
    msg = first_reply.choices[0].message
    call = msg.tool_calls[0]
    args = __import__("json").loads(call.function.arguments)
    msgs += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    final = client.chat.completions.create(model="main", messages=msgs, tools=[CALC])
    RESULTS[("tools", ep.episode)] = (first_reply, final)
    return 1.0


def test_tool_calls_are_parsed_and_the_tool_turn_is_stitched(grid_tokenizer, items):
    """The tiny model never writes a tool call, so a scripted engine (conftest) answers
    with one; the server, the client and the record are the real ones."""
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context
    from tests.helpers.agents import FakePolicy, ScriptedEngine

    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    def script(text, call, i):
        return (call_text if "<|im_start|>tool" not in text else "it is 5"), True

    tok = grid_tokenizer
    engine = ScriptedEngine(tok, script)
    ctx = Context(None, {"main": FakePolicy(tok)}, {"main": engine})
    wf = Gateway(ctx, agent=f"{HERE}:tool_agent")
    try:
        rec = wf.rollout(items(rows("what is 2 + 3?")), SamplingParams(n=1, max_new_tokens=80))
    finally:
        wf.close()
    assert rec["valid"].all() and rec.batch_size[0] == 2
    first_reply, final = RESULTS[("tools", 0)]
    choice = first_reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("add", '{"a": 2, "b": 3}')
    ]
    assert final.choices[0].message.content == "it is 5"
    metas = strings(rec, "meta")
    assert [m["stitched"] for m in metas] == [False, True]
    before = ids(rec, "prompt_ids", 0) + ids(rec, "response_ids", 0)
    assert before[-1] == tok.eos_token_id  # the scripted call ends with the end token
    tool_turn = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert ids(rec, "prompt_ids", 1) == before + tok.encode(tool_turn, add_special_tokens=False)
    assert ids(rec, "response_ids", 0) == engine.calls[0][2][0].token_ids  # scripted, exact


def test_a_recipe_naming_a_missing_agent_fails_at_load(tmp_path):
    from polyrl.core.config import ConfigError, load
    from polyrl.core.recipe import Config

    with pytest.raises(ConfigError, match=r"rollout.args.agent=.*no_such_agent.*cannot be"):
        load(Config, gateway_recipe(tmp_path, f"{HERE}:no_such_agent"), [])


def test_the_core_loop_trains_on_gateway_episodes_with_gigpo(grid_model_dir, tmp_path):
    import json
    import math

    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        gateway_recipe(tmp_path, GRID_AGENT),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.save_every=0",
            "run.samples_per_step=1000",
            *small_grid(tmp_path, grid_model_dir),
            "rollout.n=4",
            "rollout.prompts_per_step=4",
            "train.steps=2",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "main/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["main/loss"]) and r["rollout/valid_frac"] == 1.0
        assert r["main/mismatch/logp_abs_max"] < 1e-5  # the trainer sees the engine's tokens
    assert any(r["main/grad_norm"] > 0 for r in steps)
    samples = [
        json.loads(x)
        for p in sorted((run.path / "samples").glob("train_step_*"))
        for x in p.read_text().splitlines()
    ]
    assert len(samples) == 2 * 4 * 4 * 2  # steps x prompts x samples x turns
    assert all(s["reward"] in (0.0, 0.5, 1.0) for s in samples)


def plain_agent(row, ep):
    r = ep.openai().chat.completions.create(
        model="main", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return float(bool(r.choices[0].message.content))


def test_an_engine_error_is_a_500_for_its_call_and_the_server_goes_on(grid_tokenizer, items):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context
    from tests.helpers.agents import FakePolicy, ScriptedEngine

    def script(text, call, i):
        if "boom" in text:
            raise RuntimeError("engine fell over")
        return "up", True

    engine = ScriptedEngine(grid_tokenizer, script)
    ctx = Context(None, {"main": FakePolicy(grid_tokenizer)}, {"main": engine})
    wf = Gateway(ctx, agent=f"{HERE}:plain_agent")
    params = SamplingParams(n=2, max_new_tokens=8)
    try:
        failed = wf.rollout(items(rows("boom")), params)
        fine = wf.rollout(items(rows("fine")), params)
    finally:
        wf.close()
    assert not failed["valid"].any()  # both episodes' requests were in the failing call
    for error in strings(failed, "error"):
        assert "InternalServerError" in error and "engine fell over" in error
    assert fine["valid"].all()
    assert [m["return"] for m in strings(fine, "meta")] == [1.0, 1.0]


def rewarding_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    r = client.chat.completions.create(model="main", messages=msgs, max_tokens=3)
    ep.reward(0.5)  # the latest completion: turn 0
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    client.chat.completions.create(model="main", messages=msgs, max_tokens=3)
    ep.reward(0.25, turn=0)  # adds up with the first post
    refused = {}
    for turn, value in ((5, 1.0), (None, "high")):
        try:
            ep.reward(value, turn=turn)
        except RuntimeError as e:
            refused[turn] = str(e)
    RESULTS[("posted", ep.episode)] = refused
    return row["ret"]


def test_rewards_posted_per_turn_add_to_the_return(gateway, items):
    from polyrl.agents.credit import _steps

    wf = gateway("rewarding_agent")
    data = [{"prompt": "grid S.G", "ret": 1.0}, {"prompt": "grid G.S", "ret": None}]
    rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=8))
    metas = strings(rec, "meta")
    assert rec["valid"].all() and rec.batch_size[0] == 4, strings(rec, "error")
    for idx in by_episode(rec).values():
        m = metas[idx[0]]
        ret = m["row"]["ret"]
        want = [0.75, 1.0] if ret == 1.0 else [0.75, 0.0]
        assert m["turn_rewards"] == want and m["return"] == sum(want)
        assert m["success"] is True
        refused = RESULTS[("posted", m["episode"])]
        assert "turn=5" in refused[5] and "2 completions" in refused[5]
        assert "must be a number" in refused[None]
    # per-turn credit sees the posted rewards: turn 0's return-to-go is its own reward
    # plus gamma times turn 1's
    rec.set("reward", torch.tensor([float(m["return"]) for m in metas]))
    rets = {(metas[s.row]["row"]["ret"], s.turn): s.ret for s in _steps(rec, 0.5)[0]}
    assert rets == {(1.0, 0): 0.75 + 0.5 * 1.0, (1.0, 1): 1.0, (None, 0): 0.75, (None, 1): 0.0}


def folding_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="main", messages=msgs, tools=[CALC])
    msg = reply.choices[0].message
    msgs += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"},
    ]
    client.chat.completions.create(model="checker", messages=msgs)
    return 1.0


def test_another_model_sees_earlier_tool_calls_as_hermes_text(grid_tokenizer, items):
    """The tiny chat template ignores ``tool_calls``; a conversation rendered afresh for
    another model gets them as the same ``<tool_call>`` text the first model wrote."""
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context
    from tests.helpers.agents import FakePolicy, ScriptedEngine

    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    tok = grid_tokenizer
    main = ScriptedEngine(tok, lambda text, call, i: (call_text, True))
    checker = ScriptedEngine(tok, lambda text, call, i: ("5", True))
    policies = {"main": FakePolicy(tok), "checker": FakePolicy(tok)}
    wf = Gateway(
        Context(None, policies, {"main": main, "checker": checker}), agent=f"{HERE}:folding_agent"
    )
    try:
        rec = wf.rollout(items(rows("what is 2 + 3?")), SamplingParams(n=1, max_new_tokens=80))
    finally:
        wf.close()
    assert rec["valid"].all() and strings(rec, "policy") == ["main", "checker"]
    assert [m["stitched"] for m in strings(rec, "meta")] == [False, False]
    want = [
        {"role": "user", "content": "what is 2 + 3?"},
        {"role": "assistant", "content": call_text},
        {"role": "tool", "content": "5"},
    ]
    assert ids(rec, "prompt_ids", 1) == first(want, tok)


def streaming_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    stream = client.chat.completions.create(
        model="main",
        messages=msgs,
        n=2,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    RESULTS[("stream", ep.episode)] = (texts, finish, usage)
    return 1.0


def test_streamed_answers_are_the_recorded_completions(gateway, items):
    wf = gateway("streaming_agent")
    rec = wf.rollout(items(rows("grid S.G")), SamplingParams(n=1, max_new_tokens=8))
    assert rec["valid"].all() and rec.batch_size[0] == 2
    texts, finish, usage = RESULTS[("stream", by_episode(rec).popitem()[0])]
    assert texts == {0: strings(rec, "response_text")[0], 1: strings(rec, "response_text")[1]}
    for i in (0, 1):
        ended = ids(rec, "response_ids", i)[-1] == wf.server.chats["main"].eos_id
        assert finish[i] == ("stop" if ended else "length")
    assert usage.completion_tokens == int(rec["loss_mask"].sum())


COMMAND_AGENT = """
import json, os, sys
import openai

row = json.loads(os.environ["POLYRL_TASK"])
if row.get("crash"):
    sys.exit("no luck today")
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the run
reply = client.chat.completions.create(
    model=os.environ["POLYRL_MODEL"],
    messages=[{"role": "user", "content": row["prompt"]}],
    max_tokens=4,
)
print("chatty output first")
print(json.dumps({"reward": len(reply.choices[0].message.content), "success": True}))
"""


def test_an_external_command_agent_talks_to_the_endpoint(models, items):
    import sys

    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    policies, engines = models
    wf = Gateway(Context(None, policies, engines), command=[sys.executable, "-c", COMMAND_AGENT])
    try:
        data = [{"prompt": "grid S.G"}, {"prompt": "grid G.S", "crash": True}]
        rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=8))
    finally:
        wf.close()
    assert rec["valid"].tolist() == [True, False]
    meta, text = strings(rec, "meta")[0], strings(rec, "response_text")[0]
    assert meta["return"] == float(len(text)) and meta["success"] is True
    assert 1 <= len(ids(rec, "response_ids", 0)) <= 4
    assert "exited with status 1: no luck today" in strings(rec, "error")[1]


def test_agent_and_command_are_exclusive(models):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.config import ConfigError
    from polyrl.core.rollout.workflow import Context

    ctx = Context(None, *models)
    with pytest.raises(ConfigError, match="exactly one of agent"):
        Gateway(ctx, agent=f"{HERE}:plain_agent", command=["true"])
    with pytest.raises(ConfigError, match="exactly one of agent"):
        Gateway(ctx)
