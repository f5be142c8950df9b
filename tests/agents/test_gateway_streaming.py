"""Token-by-token streaming through the gateway (issue 31): tokens reach the HTTP client
while the engine still decodes, on Chat Completions, Responses and Messages, with the real
``openai``, ``anthropic`` and ``httpx`` clients.

Order, not wall time, proves it: the HF engine's per-step hook (``set_refresh``, called
before every decoding step) holds the engine before its second token until the client has
read its first delta. Were the stream sent when the call ends, the client would wait for a
delta the engine cannot give, and the hook would time out (the test then fails).
"""

from __future__ import annotations

import threading

import anthropic
import httpx
import orjson
import pytest
import torch

from polyrl.core.interfaces import EngineCaps
from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.gateway import by_episode, ids, rows

HERE = "tests.agents.test_gateway_streaming"
RESULTS: dict = {}
SEED = {"seed": 5}


class Gate:
    """The engine's refresh hook: once armed, it holds the engine before its second
    decoding step (the first token sampled and handed to the stream) until ``release``."""

    def __init__(self) -> None:
        self.calls, self.armed = 0, False
        self.waiting, self.go = threading.Event(), threading.Event()
        self.timed_out = False

    def arm(self) -> None:
        self.calls, self.armed, self.timed_out = 0, True, False
        self.waiting.clear()
        self.go.clear()

    def __call__(self) -> int:  # on the engine's thread: 1 = prefill, 2 = before token 2
        self.calls += 1
        if self.armed and self.calls == 2:
            self.waiting.set()
            self.timed_out = not self.go.wait(20)
            self.armed = False
        return 0

    def release(self) -> bool:
        """Let the engine go on; True if it was held before token 2 (it waits 1 s at most
        for the engine to reach the hold, which it does right after handing token 1 on)."""
        if self.go.is_set():
            return True
        held = self.waiting.wait(1) and self.calls == 2
        self.go.set()
        return held


GATE = Gate()


@pytest.fixture(scope="module")
def models(grid_model_dir):
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policy = CausalLMPolicy(
        "main", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    engine = HFEngine(policy, seed=0)
    engine.set_refresh(GATE)
    return {"main": policy}, {"main": engine}


def run(ctx_models, agent, data, max_new_tokens=8):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    policies, engines = ctx_models
    wf = Gateway(Context(None, policies, engines), agent=f"{HERE}:{agent}")
    try:
        return wf.rollout(data, SamplingParams(n=1, max_new_tokens=max_new_tokens)), wf
    finally:
        wf.close()


def order_agent(row, ep):
    """Per API: a streamed request (the gate released at its first token's delta), then
    the same request not streamed (same seed, so the same sample)."""
    msgs = [{"role": "user", "content": row["prompt"]}]
    out = {}
    client = ep.openai()
    chunks, held = [], None
    GATE.arm()
    for chunk in client.chat.completions.create(
        model="main", messages=msgs, max_tokens=6, stream=True, logprobs=True, extra_body=SEED
    ):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:  # a sampled token's chunk
                held = GATE.release() if held is None else held
                chunks.append((c.delta.content, [e.logprob for e in c.logprobs.content]))
    out["chat"] = (held, GATE.timed_out, chunks)
    client.chat.completions.create(model="main", messages=msgs, max_tokens=6, extra_body=SEED)

    deltas, done, held = [], None, None
    GATE.arm()
    for ev in client.responses.create(
        model="main",
        input=row["prompt"],
        max_output_tokens=6,
        stream=True,
        include=["message.output_text.logprobs"],
        extra_body=SEED,
    ):
        if ev.type == "response.output_text.delta":
            held = GATE.release() if held is None else held
            deltas.append((ev.delta, [e.logprob for e in ev.logprobs]))
        elif ev.type in ("response.completed", "response.incomplete"):
            done = ev.response.output_text
    out["responses"] = (held, GATE.timed_out, deltas, done)
    client.responses.create(model="main", input=row["prompt"], max_output_tokens=6, extra_body=SEED)

    claude = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    texts, held = [], None
    GATE.arm()
    with claude.messages.stream(
        model="main", max_tokens=6, messages=msgs, extra_body=SEED | {"logprobs": True}
    ) as stream:
        for ev in stream:
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                held = GATE.release() if held is None else held
                texts.append((ev.delta.text, [e["logprob"] for e in ev.logprobs]))
        final = stream.get_final_message()
    out["messages"] = (held, GATE.timed_out, texts, final.content[0].text)
    claude.messages.create(model="main", max_tokens=6, messages=msgs, extra_body=SEED)
    RESULTS[("order", ep.episode)] = out
    return 1.0


def test_tokens_reach_the_client_while_the_engine_decodes(models, items):
    rec, _ = run(models, "order_agent", items(rows("grid S.G")))
    assert rec["valid"].all() and rec.batch_size[0] == 6, strings(rec, "error")
    out = RESULTS[("order", by_episode(rec).popitem()[0])]
    texts = strings(rec, "response_text")
    for k, api in enumerate(("chat", "responses", "messages")):
        held, timed_out, deltas = out[api][:3]
        # the first delta came while the engine was held before its second token
        assert held and not timed_out, api
        streamed, plain = 2 * k, 2 * k + 1  # the record's rows of this API's two requests
        resp = ids(rec, "response_ids", streamed)
        assert len(resp) > 1, "the engine stopped at its first token; pick another seed"
        # joined deltas are the final text; their log-probs are the record's, token by token
        assert "".join(d for d, _ in deltas) == texts[streamed], api
        lps = [lp for _, entries in deltas for lp in entries]
        want = rec["rollout_logprobs"][streamed][: len(resp)]
        assert torch.allclose(torch.tensor(lps), want, atol=1e-6), api
        # the streamed call's record is the non-streamed call's (same seed, same sample)
        assert resp == ids(rec, "response_ids", plain), api
        assert torch.equal(rec["rollout_logprobs"][streamed], rec["rollout_logprobs"][plain])
    assert out["responses"][3] == texts[2] and out["messages"][3] == texts[4]


def leaving_agent(row, ep):
    """Reads the first token's chunk with raw httpx and hangs up, then asks again."""
    body = {
        "model": "main",
        "messages": [{"role": "user", "content": row["prompt"]}],
        "max_tokens": 6,
        "stream": True,
        "logprobs": True,
    } | SEED
    auth = {"Authorization": f"Bearer {ep.api_key}"}
    GATE.arm()
    got = None
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", ep.base_url + "/chat/completions", json=body, headers=auth) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {") and orjson.loads(line[6:])["choices"][0].get("logprobs"):
                got = line
                break
    held = GATE.release()  # the engine goes on for a client that is gone
    again = ep.openai().chat.completions.create(
        model="main", messages=body["messages"], max_tokens=4
    )
    RESULTS[("leave", ep.episode)] = (got is not None, held, again.choices[0].message.content)
    return 1.0


def test_a_client_that_hangs_up_mid_stream_leaves_episode_and_server_going(models, items):
    rec, wf = run(models, "leaving_agent", items(rows("grid S.G")))
    assert rec["valid"].all() and rec.batch_size[0] == 2, strings(rec, "error")
    got, held, again = RESULTS[("leave", by_episode(rec).popitem()[0])]
    assert got and held
    # the abandoned completion went on past the hang-up and is filed like any other
    assert len(ids(rec, "response_ids", 0)) > 1
    assert again == strings(rec, "response_text")[1]


# --------------------------------------------------------------------------- what is shown

# The scripted replies (one byte-level symbol per token, so "é" and "中" span 2 and 3
# tokens) and, by hand, what each API must show of them.
SCRIPTS = {
    "stop": ("héllo 中文 wörld STOP tail", "héllo 中文 wörld "),  # cut at stop="STOP"
    "tail": ("ok 中 ST", "ok 中 ST"),  # ends on a prefix of the stop string: shown at the end
    "think": ("<think>plan é</think>answer 中", "answer 中"),  # reasoning "plan é"
    "tool": (
        'add 中 then <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>',
        "add 中 then",
    ),
}


class Streamed:
    """The scripted engine, handing each token it writes to the request's ``on_token``
    before it returns (``streams=False``: an engine that cannot stream)."""

    def __init__(self, engine, streams: bool) -> None:
        self.engine, self.caps = engine, EngineCaps(streams_tokens=streams)

    def generate(self, prompts, params):
        from polyrl.core.rollout.engine import as_requests

        outs = self.engine.generate(prompts, params)
        requests = as_requests(prompts)
        for o in outs:
            sink = requests[o.prompt_index].on_token
            for t, lp in zip(o.token_ids, o.logprobs, strict=True):
                if sink is not None:
                    sink(0, t, lp, None)
        return outs

    def sync(self):
        return None


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A tiny byte-level BPE holding all 256 bytes (any text round-trips)."""
    from polyrl.core.demo.tiny import build_tokenizer

    return build_tokenizer(["hello world, plan the answer"] * 4, vocab_size=300)


def scripted_models(tok, streams: bool):
    from tests.helpers.agents import FakePolicy, ScriptedEngine

    def script(text, call, i):
        case = next(c for c in SCRIPTS if f"case {c}" in text)
        return SCRIPTS[case][0], True

    return {"main": FakePolicy(tok)}, {"main": Streamed(ScriptedEngine(tok, script), streams)}


def shown_agent(row, ep):
    """Each case through one API, streamed; per case the deltas as they came and the
    final answer's text."""
    client = ep.openai()
    out = {}
    msgs = [{"role": "user", "content": "case stop"}]
    deltas, lps = [], []
    for chunk in client.chat.completions.create(
        model="main", messages=msgs, max_tokens=64, stream=True, stop=["STOP"], logprobs=True
    ):
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            lps += [e.logprob for e in (c.logprobs.content if c.logprobs else None) or []]
    out["stop"] = (deltas, lps, None)
    claude = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    for case, extra in (("tail", {"stop_sequences": ["STOP"]}), ("tool", {"tools": TOOLS})):
        with claude.messages.stream(
            model="main", max_tokens=120, messages=[{"role": "user", "content": f"case {case}"}],
            **extra,
        ) as stream:  # fmt: skip
            deltas = [
                ev.delta.text
                for ev in stream
                if ev.type == "content_block_delta" and ev.delta.type == "text_delta"
            ]
            final = stream.get_final_message()
        out[case] = (deltas, None, [b.model_dump() for b in final.content])
    deltas, kinds, done = [], [], None
    for ev in client.responses.create(model="main", input="case think", stream=True):
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type == "response.output_item.added":
            kinds.append(ev.item.type)
        elif ev.type == "response.completed":
            done = ev.response
    out["think"] = (deltas, kinds, [o.model_dump() for o in done.output])
    RESULTS[("shown", ep.episode)] = out
    return 1.0


TOOLS = [{"name": "add", "description": "add", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("streams", [True, False], ids=["streams", "at_the_end"])
def test_deltas_are_whole_characters_and_never_text_the_answer_drops(
    byte_tokenizer, items, streams
):
    models = scripted_models(byte_tokenizer, streams)
    rec, _ = run(models, "shown_agent", items(rows("x")), max_new_tokens=128)
    assert rec["valid"].all() and rec.batch_size[0] == 4, strings(rec, "error")
    out = RESULTS[("shown", by_episode(rec).popitem()[0])]
    for case, (deltas, _, _) in out.items():
        # no delta carries half a character, and joined they are the answer: text once
        # shown is never taken back, so nothing a stop string or tool call cuts was shown
        assert not any("\ufffd" in d for d in deltas), case
        assert "".join(deltas) == SCRIPTS[case][1], case
    # Chat: one chunk per sampled token with its log-prob (the record's), "" mid-character
    deltas, lps, _ = out["stop"]
    assert lps == pytest.approx(rec["rollout_logprobs"][0][: len(lps)].tolist(), abs=1e-6)
    assert len(lps) == len(ids(rec, "response_ids", 0))
    tail_blocks, tool_blocks = out["tail"][2], out["tool"][2]
    assert [b["type"] for b in tail_blocks] == ["text"]
    assert [b["type"] for b in tool_blocks] == ["text", "tool_use"]
    assert tool_blocks[1]["name"] == "add" and tool_blocks[1]["input"] == {"a": 2}
    # Responses: the reasoning item (whole, once its block closed) before the message
    _, kinds, output = out["think"]
    assert kinds == ["reasoning", "message"] == [o["type"] for o in output]
    assert output[0]["content"][0]["text"] == "plan é"
    assert output[1]["content"][0]["text"] == "answer 中"


# --------------------------------------------------------------------------- the engine side


def test_each_request_gets_its_own_tokens_through_the_batcher(models):
    """Two episodes' requests in one engine call (different budgets; n=1 and n=2, so the
    batcher sends one prompt copy per sample): each ``on_token`` sees exactly its own
    completions' tokens and log-probs, sample by sample."""
    import asyncio

    from polyrl.core.rollout.batching import Batcher
    from polyrl.core.rollout.engine import HFEngine, Request

    policy = models[0]["main"]
    engine = HFEngine(policy, seed=3)
    seen: dict[str, list] = {"a": [], "b": []}
    got: dict[str, list] = {}

    async def episode(name, prompt, budget, n):
        def sink(sample, token, logprob, top):
            seen[name].append((sample, token, logprob, top))

        request = Request(prompt, max_new_tokens=budget, on_token=sink)
        got[name] = await batcher.generate("main", request, SamplingParams(n=n, max_new_tokens=8))

    batcher = Batcher({"main": engine})
    prompt = policy.tokenizer.encode("grid S.G")
    asyncio.run(batcher.drive([episode("a", prompt, 8, 1), episode("b", prompt[:-1], 5, 2)]))
    assert batcher.sizes == [2]  # one engine call served both
    for name in ("a", "b"):
        for sample, c in enumerate(got[name]):
            mine = [(t, lp) for s, t, lp, top in seen[name] if s == sample]
            assert [t for t, _ in mine] == c.token_ids
            assert [lp for _, lp in mine] == c.logprobs  # the same floats, not recomputed
        assert {s for s, *_ in seen[name]} == set(range(len(got[name])))
        assert all(top is None for *_, top in seen[name])  # no top_logprobs asked


class FailsMidCall(Streamed):
    """Every other call streams two tokens, then raises (an engine failing mid-call)."""

    calls = 0

    def generate(self, prompts, params):
        from polyrl.core.rollout.engine import as_requests

        self.calls += 1
        if self.calls % 2:
            sink = as_requests(prompts)[0].on_token
            for t in self.engine.char_ids("ok"):
                sink(0, t, -0.5, None)
            raise RuntimeError("out of memory")
        return super().generate(prompts, params)


def failing_agent(row, ep):
    """Per API a streamed request the engine fails after two tokens, then a plain one."""
    import openai

    msgs = [{"role": "user", "content": "case tail"}]
    client = ep.openai()
    claude = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    streams = {
        "chat": lambda: client.chat.completions.create(model="main", messages=msgs, stream=True),
        "responses": lambda: client.responses.create(model="main", input=msgs, stream=True),
        "messages": lambda: claude.messages.create(
            model="main", max_tokens=8, messages=msgs, stream=True
        ),
    }
    out = {}
    for api, streamed in streams.items():
        events = []
        try:
            for ev in streamed():
                events.append(ev)
        except (openai.APIError, anthropic.APIError) as e:
            out[api] = (len(events), str(e))
        client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
    RESULTS[("fail", ep.episode)] = out
    return 1.0


def test_an_engine_failing_mid_stream_is_the_apis_error_event(byte_tokenizer, items):
    policies, engines = scripted_models(byte_tokenizer, True)
    engines["main"] = FailsMidCall(engines["main"].engine, True)
    rec, _ = run((policies, engines), "failing_agent", items(rows("x")))
    assert rec["valid"].all() and rec.batch_size[0] == 3, strings(rec, "error")  # the plain ones
    out = RESULTS[("fail", by_episode(rec).popitem()[0])]
    assert sorted(out) == ["chat", "messages", "responses"]
    for api, (seen, message) in out.items():
        assert seen >= 2, api  # the stream had begun: headers and first events were sent
        assert "the engine failed: RuntimeError: out of memory" in message, api


def test_text_built_token_by_token_is_the_whole_decode(byte_tokenizer, grid_tokenizer):
    """The streamed text, built one token at a time, against decoding all the ids at once
    after every token: multi-byte text fed one byte-symbol per token, and random ids."""
    import random

    from polyrl.agents.gateway.stream import Reply
    from tests.helpers.agents import ScriptedEngine

    class Req:
        max_tokens, stop, tools = 10**6, None, None

    rng = random.Random(0)
    split = ScriptedEngine(byte_tokenizer, None).char_ids("héllo 中文 wörld 🙂 naïve")
    for tok in (byte_tokenizer, grid_tokenizer):
        end = tok.convert_tokens_to_ids("a")
        cases = [rng.choices(range(len(tok)), k=150) + [end] for _ in range(4)]
        for seq in cases + ([split + [end]] if tok is byte_tokenizer else []):
            reply = Reply(tok, Req, think=False)
            for k, t in enumerate(seq):
                reply.add(t)
                whole = tok.decode(seq[: k + 1], skip_special_tokens=True)
                # all of it, or all but a character still incomplete
                assert whole.startswith(reply.text)
                assert reply.text == whole or whole.endswith("\ufffd")
            assert reply.text == tok.decode(seq, skip_special_tokens=True)
