"""The gateway's limits (issue 33): what a request may carry, each refused with a 4xx the
real ``openai`` client reports, before it costs the run memory or engine time; the episode
goes on. The tiny grid model takes 512 positions (``core.demo.tiny``'s default)."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import openai
import pytest

from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.gateway import by_episode, first, ids, rows, spied_models

RESULTS: dict = {}
DONE = itertools.count()  # the order in which the crowd's requests came back
BIG_SENT = threading.Event()  # the crowd's big request is on its way
RELEASED = threading.Event()  # the held engine call of the timeout test returned
HERE = "tests.agents.test_gateway_limits"
CONTEXT = 512


@pytest.fixture(scope="module")
def models(grid_model_dir):
    return spied_models(grid_model_dir, names=("main",))


@pytest.fixture
def gateway(models):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    made = []

    def make(agent, **args):
        policies, engines = models
        engines["main"].log.clear()
        wf = Gateway(Context(None, policies, engines), agent=f"{HERE}:{agent}", **args)
        made.append(wf)
        return wf

    yield make
    for wf in made:
        wf.close()


def status(call) -> tuple[int, str]:
    try:
        call()
        return 200, ""
    except openai.APIStatusError as e:
        return e.status_code, str(e.message)


# --------------------------------------------------------------------------- agents


def oversize_agent(row, ep):
    client = ep.openai()
    big = [{"role": "user", "content": "x" * 8000}]
    seen = {"sized": status(lambda: client.chat.completions.create(model="main", messages=big))}

    def chunks():  # no Content-Length: the limit applies while the body arrives
        yield b'{"model": "main", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 1000
        yield b'"}]}'

    raw = httpx.post(
        ep.base_url + "/chat/completions",
        content=chunks(),
        headers={"Authorization": f"Bearer {ep.api_key}", "Content-Type": "application/json"},
    )
    seen["streamed"] = (raw.status_code, raw.json()["error"]["message"])
    msgs = [{"role": "user", "content": row["prompt"]}]
    seen["after"] = status(
        lambda: client.chat.completions.create(model="main", messages=msgs, max_tokens=2)
    )
    RESULTS[("oversize", ep.episode)] = seen
    return 1.0


def test_an_oversize_body_is_a_413_and_the_episode_goes_on(gateway, items):
    wf = gateway("oversize_agent", max_body_bytes=4096)
    rec = wf.rollout(items(rows("grid S.G")), SamplingParams(n=1, max_new_tokens=4))
    assert rec["valid"].all() and rec.batch_size[0] == 1  # only the small request was served
    seen = RESULTS[("oversize", by_episode(rec).popitem()[0])]
    for case in ("sized", "streamed"):
        code, msg = seen[case]
        assert code == 413 and "max_body_bytes=4096" in msg, (case, code, msg)
    assert seen["after"] == (200, "")


def long_prompt_agent(row, ep):
    client = ep.openai()
    seen = {}
    for name, words, max_tokens in (
        ("over", row["over"], None),  # the prompt alone is past the context
        ("explicit", row["fit"], 8),  # fits, but not with 8 more tokens
        ("default", row["fit"], None),  # fits: the default budget shrinks to the room
    ):
        msgs = [{"role": "user", "content": "go " * words}]
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        try:
            r = client.chat.completions.create(model="main", messages=msgs, **extra)
            seen[name] = (200, r.usage.prompt_tokens, r.usage.completion_tokens)
        except openai.APIStatusError as e:
            seen[name] = (e.status_code, str(e.message))
    RESULTS[("long", ep.episode)] = seen
    return 1.0


def test_a_prompt_past_the_context_is_a_400_naming_the_lengths(gateway, models, items):
    policies, engines = models
    tok = policies["main"].tokenizer

    def length(words):
        return len(first([{"role": "user", "content": "go " * words}], tok))

    fit = next(w for w in range(1, CONTEXT) if length(w) >= CONTEXT - 3)  # room for < 4 tokens
    over = 2 * fit
    assert length(fit) < CONTEXT < length(over)
    wf = gateway("long_prompt_agent")
    data = rows("grid S.G", fit=fit, over=over)
    rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=16))
    seen = RESULTS[("long", by_episode(rec).popitem()[0])]
    code, msg = seen["over"]
    assert code == 400 and f"prompt is {length(over)} tokens" in msg and f"{CONTEXT} tokens" in msg
    code, msg = seen["explicit"]
    assert code == 400 and f"{length(fit)} tokens + 8 completion tokens" in msg
    code, prompt, completion = seen["default"]
    assert code == 200 and prompt == length(fit) and 1 <= completion <= CONTEXT - length(fit)
    assert rec["valid"].all() and rec.batch_size[0] == 1
    assert all(len(p) < CONTEXT for p, _ in engines["main"].log)  # the others never ran


def stop_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    seen = {}
    for name, stop in (("many", ["a", "b", "c"]), ("long", ["z" * 1_000_000]), ("ok", ["zz"])):
        seen[name] = status(
            lambda stop=stop: client.chat.completions.create(
                model="main", messages=msgs, stop=stop, max_tokens=2
            )
        )
    RESULTS[("stop", ep.episode)] = seen
    return 1.0


def test_stop_strings_are_capped_in_number_and_length(gateway, items):
    wf = gateway("stop_agent", max_stop=2, max_stop_chars=16)
    rec = wf.rollout(items(rows("grid S.G")), SamplingParams(n=1, max_new_tokens=4))
    seen = RESULTS[("stop", by_episode(rec).popitem()[0])]
    code, msg = seen["many"]
    assert code == 400 and "at most 2" in msg and "max_stop" in msg
    code, msg = seen["long"]
    assert code == 400 and "1000000 characters" in msg and "max_stop_chars=16" in msg
    assert seen["ok"] == (200, "")
    assert rec["valid"].all() and rec.batch_size[0] == 1


def crowd_agent(row, ep):
    """Episode 0 sends a 10,000-message conversation; the others a short one."""
    client = ep.openai()
    if row["big"]:
        msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"m{k} " * 8}
                for k in range(10_000)]  # fmt: skip
        if row["raw"]:  # the openai client spends seconds building a 10,000-message body
            BIG_SENT.set()
            r = httpx.post(
                ep.base_url + "/chat/completions",
                json={"model": "main", "messages": msgs},
                headers={"Authorization": f"Bearer {ep.api_key}"},
                timeout=60,
            )
            RESULTS[("crowd", ep.episode)] = (r.status_code, r.json()["error"]["message"])
        else:
            BIG_SENT.set()
            RESULTS[("crowd", ep.episode)] = status(
                lambda: client.chat.completions.create(model="main", messages=msgs)
            )
        RESULTS[("crowd", ep.episode)] += (next(DONE),)
        client.chat.completions.create(model="main", messages=msgs[:1], max_tokens=2)
        return 1.0
    BIG_SENT.wait(30)
    time.sleep(0.5)  # the big request is being rendered now (seconds of templating)
    r = client.chat.completions.create(
        model="main", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    RESULTS[("crowd", ep.episode)] = (200, r.choices[0].message.content, next(DONE))
    return 1.0


@pytest.mark.parametrize("max_messages", [1024, 20_000])
def test_a_10000_message_request_never_reaches_the_engine(gateway, models, items, max_messages):
    """Refused by the message cap (default) or, with the cap raised, by the context check
    on its rendered text's bytes, before it is tokenised; either way before the engine.
    (That it never stalls the others: tests/agents/test_gateway_budgets.py.)"""
    _, engines = models
    BIG_SENT.clear()
    wf = gateway("crowd_agent", max_messages=max_messages)
    raw = max_messages > 10_000
    data = [{"prompt": "grid S.G", "big": True, "raw": raw}] + [
        {"prompt": f"grid {k}", "big": False, "raw": raw} for k in range(3)
    ]
    rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=4))
    assert rec["valid"].all() and rec.batch_size[0] == 4
    metas = strings(rec, "meta")
    order = {}
    for i, m in enumerate(metas):
        code, msg, order[m["row"]["big"], i] = RESULTS[("crowd", m["episode"])]
        if m["row"]["big"]:
            want = "10000 messages" if max_messages == 1024 else f"takes {CONTEXT} tokens"
            assert code == 400 and want in msg, msg
        else:
            assert code == 200 and len(ids(rec, "response_ids", i)) >= 1
    assert len(engines["main"].log) == 4
    assert all(len(p) < CONTEXT for p, _ in engines["main"].log)


class SlowEngine:
    """A real engine whose first call is held up (a long decode, as a big request makes)."""

    def __init__(self, engine, hold: float):
        self.engine, self.hold, self.calls = engine, hold, []

    def generate(self, prompts, params):
        self.calls.append((params.temperature, len(prompts)))
        if len(self.calls) == 1:
            time.sleep(self.hold)
        try:
            return self.engine.generate(prompts, params)
        finally:
            RELEASED.set()


def timeout_agent(row, ep):
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": row["prompt"]}]
    first_try = status(
        lambda: client.chat.completions.create(
            model="main", messages=msgs, max_tokens=2, temperature=row["t"]
        )
    )
    RELEASED.wait(30)  # the held call is over: the retry is served at once
    again = client.chat.completions.create(model="main", messages=msgs, max_tokens=2)
    RESULTS[("timeout", ep.episode)] = (first_try, again.choices[0].finish_reason)
    return 1.0


def test_a_request_that_timed_out_waiting_is_never_sent_to_the_engine(models, items):
    """Two requests flushed together with different temperatures are two engine calls in
    turn; the first is held past request_timeout, so both time out (504). The second,
    timed out while it waited, is dropped, not run for nobody; both episodes go on."""
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    policies, engines = models
    RELEASED.clear()
    slow = SlowEngine(engines["main"].engine, hold=2.0)
    wf = Gateway(
        Context(None, policies, {"main": slow}), agent=f"{HERE}:timeout_agent", request_timeout=0.8
    )
    try:
        data = [{"prompt": "grid S.G", "t": 0.5}, {"prompt": "grid G.S", "t": 0.9}]
        rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=4))
    finally:
        wf.close()
    assert rec["valid"].all() and rec.batch_size[0] == 2, (strings(rec, "error"), slow.calls)
    for e in by_episode(rec):
        (code, msg), _ = RESULTS[("timeout", e)]
        assert code == 504 and "0.8 s" in msg
    # the held call, then the two retries together: the timed-out group never ran
    assert [t for t, _ in slow.calls][1:] == [1.0] and slow.calls[1][1] == 2
    assert len(slow.calls) == 2
