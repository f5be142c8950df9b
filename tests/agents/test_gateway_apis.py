"""The gateway's other APIs (issue 31): OpenAI Responses and Anthropic Messages, token-level
streaming and ``top_logprobs``, with the real ``openai``, ``anthropic``, ``openai-agents``
and ``langgraph`` / ``langchain-openai`` packages, unmodified, pointed at the gateway.

Every API files its completions as the same record rows as Chat Completions: the rows are
checked against what the engine produced (a spy keeps its answers; the scripted engine of
conftest writes the tool calls the tiny model never would) and, on the real model, against
the trainer's own log-probs and an independent top-k of its logits.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
import torch

from polyrl.core.interfaces import EngineCaps
from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.gateway import SpyEngine, by_episode, first, ids, rows, spied_models

RESULTS: dict = {}
HERE = "tests.agents.test_gateway_apis"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class Spy(SpyEngine):
    # top_logprobs as the HF engine it wraps; calls each request's on_token as it decodes
    caps = EngineCaps(gives_top_logprobs=True, streams_tokens=True)


@pytest.fixture(scope="module")
def models(grid_model_dir):
    return spied_models(grid_model_dir, Spy)


def run(ctx_models, agent, data, max_new_tokens=8, **args):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    policies, engines = ctx_models
    for e in engines.values():
        if hasattr(e, "log"):
            e.log.clear()
    wf = Gateway(Context(None, policies, engines), agent=f"{HERE}:{agent}", **args)
    try:
        return wf.rollout(data, SamplingParams(n=1, max_new_tokens=max_new_tokens)), wf
    finally:
        wf.close()


def scripted(tok, names=("main",)):
    """Policies and scripted engines: a tool call first, then the sum once a tool spoke."""
    from tests.helpers.agents import FakePolicy, ScriptedEngine

    def script(text, call, i):
        return ("it is 5" if "<|im_start|>tool" in text else CALL), True

    return (
        {n: FakePolicy(tok) for n in names},
        {n: ScriptedEngine(tok, script) for n in names},
    )


def served(engine) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, ids, log-probs) of every completion a scripted engine gave."""
    out = []
    for prompts, _, comps in engine.calls:
        for c in comps:
            prompt = prompts[c.prompt_index]
            out.append((list(getattr(prompt, "prompt", prompt)), c.token_ids, c.logprobs))
    return out


def assert_rows_are_the_engines(rec, log):
    """Each row's prompt, ids and log-probs are one completion the engine produced."""
    for i in range(rec.batch_size[0]):
        prompt, resp = ids(rec, "prompt_ids", i), ids(rec, "response_ids", i)
        lps = rec["rollout_logprobs"][i][: len(resp)]
        match = [s for s in log if s[0] == prompt and list(s[1]) == resp]
        assert match, f"row {i} is not what the engine sampled"
        assert torch.allclose(torch.tensor(match[0][2], dtype=torch.float32), lps, atol=1e-5)


# --------------------------------------------------------------------------- Responses


def responses_agent(row, ep):
    """Three turns: a first request, a follow-up by previous_response_id (new items only),
    and one sending its whole history back as items (the Agents SDK's way)."""
    client = ep.openai()
    first_r = client.responses.create(
        model="main",
        instructions="Walk the grid.",
        input=row["prompt"],
        max_output_tokens=6,
        top_logprobs=5,
        include=["message.output_text.logprobs"],
    )
    second = client.responses.create(
        model="main",
        instructions="Walk the grid.",
        previous_response_id=first_r.id,
        input=[{"role": "user", "content": "go on"}],
        max_output_tokens=6,
    )
    history = [{"role": "user", "content": row["prompt"]}]
    history += [o.model_dump(exclude_none=True) for o in first_r.output]
    history += [{"role": "user", "content": "go on"}]
    history += [o.model_dump(exclude_none=True) for o in second.output]
    history += [{"role": "user", "content": "and again"}]
    third = client.responses.create(
        model="main", instructions="Walk the grid.", input=history, max_output_tokens=6
    )
    RESULTS[("responses", ep.episode)] = (first_r, second, third)
    return 1.0


def test_responses_turns_are_stitched_token_exact_with_top_logprobs(models, items):
    policies, engines = models
    tok = policies["main"].tokenizer
    rec, _ = run(models, "responses_agent", items(rows("grid S.G", "grid .SG")))
    assert rec["valid"].all() and rec.batch_size[0] == 6, strings(rec, "error")
    metas = strings(rec, "meta")
    log = [(p, o.token_ids, o.logprobs) for p, o in engines["main"].log]
    assert_rows_are_the_engines(rec, log)
    for e, idx in by_episode(rec).items():
        r1, r2, r3 = RESULTS[("responses", e)]
        assert [metas[i]["stitched"] for i in idx] == [False, True, True]
        system = {"role": "system", "content": "Walk the grid."}
        question = {"role": "user", "content": metas[idx[0]]["row"]["prompt"]}
        assert ids(rec, "prompt_ids", idx[0]) == first([system, question], tok)
        for t, r in enumerate((r1, r2, r3)):
            resp = ids(rec, "response_ids", idx[t])
            assert r.output_text == tok.decode(resp, skip_special_tokens=True)
            assert r.usage.output_tokens == len(resp)
            assert r.usage.input_tokens == len(ids(rec, "prompt_ids", idx[t]))
        for t in (1, 2):  # each turn continues the previous row's exact ids
            before = ids(rec, "prompt_ids", idx[t - 1]) + ids(rec, "response_ids", idx[t - 1])
            assert ids(rec, "prompt_ids", idx[t])[: len(before)] == before
        # top_logprobs: the sampled token's is the record's; the top 5 are the model's own
        logprobs = r1.output[0].content[0].logprobs
        resp = ids(rec, "response_ids", idx[0])
        assert len(logprobs) == len(resp)
        full = torch.tensor([ids(rec, "prompt_ids", idx[0]) + resp])
        with torch.no_grad():
            logits = policies["main"].model(full).logits[0].float()
        n_prompt = full.shape[1] - len(resp)
        want = torch.log_softmax(logits[n_prompt - 1 : -1], -1).topk(5, -1)
        for k, entry in enumerate(logprobs):
            assert abs(entry.logprob - float(rec["rollout_logprobs"][idx[0]][k])) < 1e-6
            assert len(entry.top_logprobs) == 5
            assert torch.allclose(
                torch.tensor([t.logprob for t in entry.top_logprobs]), want.values[k], atol=1e-5
            )
            if (want.values[k][:-1] - want.values[k][1:]).min() > 1e-4:  # no ties: same tokens
                got = [t.token for t in entry.top_logprobs]
                assert got == [tok.decode([i], skip_special_tokens=False) for i in want.indices[k]]
    recomputed, _ = policies["main"].logprobs(rec, 1.0)
    mask = rec["loss_mask"].bool()
    assert (recomputed.detach() - rec["rollout_logprobs"])[mask].abs().max().item() < 1e-5


def streaming_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    deltas, done = [], None
    for ev in client.responses.create(
        model="main", input=msgs, max_output_tokens=6, stream=True, top_logprobs=2
    ):
        if ev.type == "response.output_text.delta":
            deltas.append((ev.delta, ev.logprobs))
        elif ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    chunks = []
    for chunk in ep.openai().chat.completions.create(
        model="main", messages=msgs, max_tokens=6, stream=True, logprobs=True, top_logprobs=3
    ):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                chunks.append((c.delta.content, c.logprobs.content))
    client2 = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    with client2.messages.stream(
        model="main", max_tokens=6, messages=[{"role": "user", "content": row["prompt"]}]
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    RESULTS[("stream", ep.episode)] = (deltas, done, chunks, texts, final)
    return 1.0


def test_every_api_streams_token_by_token(models, items):
    rec, _ = run(models, "streaming_agent", items(rows("grid S.G")))
    assert rec["valid"].all() and rec.batch_size[0] == 3, strings(rec, "error")
    deltas, done, chunks, texts, final = RESULTS[("stream", by_episode(rec).popitem()[0])]
    text = strings(rec, "response_text")
    responses_ids, chat_ids, messages_ids = (ids(rec, "response_ids", i) for i in range(3))
    # Responses: one delta per sampled token, with that token's log-prob and 2 alternatives
    assert len(deltas) == len(responses_ids) and "".join(d for d, _ in deltas) == text[0]
    assert done.output_text == text[0]
    for k, (_, lp) in enumerate(deltas):
        assert abs(lp[0].logprob - float(rec["rollout_logprobs"][0][k])) < 1e-6
        assert len(lp[0].top_logprobs) == 2
        assert lp[0].top_logprobs[0].logprob >= lp[0].top_logprobs[1].logprob
    # Chat Completions: one chunk per token, log-probs with 3 alternatives each
    assert len(chunks) == len(chat_ids) and "".join(c or "" for c, _ in chunks) == text[1]
    assert all(len(lp[0].top_logprobs) == 3 for _, lp in chunks)
    # Messages: one text delta per token (the client's text_stream skips none here)
    assert "".join(texts) == text[2] and final.content[0].text == text[2]
    assert final.usage.output_tokens == len(messages_ids)


# --------------------------------------------------------------------------- real agents


async def sdk_agent(row, ep):
    """An OpenAI Agents SDK agent, as its documentation writes one."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agent = Agent(
        name="calculator",
        instructions="Use the add tool.",
        tools=[add],
        model=OpenAIResponsesModel(model="main", openai_client=ep.async_openai()),
    )
    result = await Runner.run(agent, row["prompt"])
    RESULTS[("sdk", ep.episode)] = result.final_output
    return float(result.final_output == "it is 5")


def anthropic_agent(row, ep):
    """A tool loop with the ``anthropic`` client, as its documentation writes one."""
    client = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    tools = [
        {
            "name": "add",
            "description": "a + b",
            "input_schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        }
    ]
    messages = [{"role": "user", "content": row["prompt"]}]
    replies = []
    for _ in range(3):
        reply = client.messages.create(
            model="main", max_tokens=80, system="Use the add tool.", tools=tools, messages=messages
        )
        replies.append(reply)
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "assistant", "content": reply.content})
        results = [
            {
                "type": "tool_result",
                "tool_use_id": b.id,
                "content": str(b.input["a"] + b.input["b"]),
            }
            for b in reply.content
            if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    RESULTS[("anthropic", ep.episode)] = replies
    return float(replies[-1].content[0].text == "it is 5")


def langgraph_agent(row, ep):
    """A LangGraph tool-calling graph over ``langchain-openai``'s ChatOpenAI, as the
    LangGraph tutorials build one."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model="main", base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    llm = llm.bind_tools([add])

    def agent(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    out = graph.compile().invoke({"messages": [("user", row["prompt"])]})
    RESULTS[("langgraph", ep.episode)] = out["messages"]
    return float(out["messages"][-1].content == "it is 5")


@pytest.mark.parametrize("agent", ["sdk_agent", "anthropic_agent", "langgraph_agent"])
def test_a_real_agent_framework_calls_a_tool_over_two_turns(grid_tokenizer, items, agent):
    """Each framework, unchanged but for its base URL and key: the model calls ``add``,
    the framework runs it and sends the result, the model answers; two rows, the second
    stitched onto the first's sampled ids, both exactly the engine's."""
    tok = grid_tokenizer
    policies, engines = scripted(tok)
    rec, _ = run((policies, engines), agent, items(rows("what is 2 + 3?")), max_new_tokens=80)
    assert rec["valid"].all() and rec.batch_size[0] == 2, strings(rec, "error")
    metas = strings(rec, "meta")
    assert metas[0]["return"] == 1.0  # the framework got the final answer
    assert [m["stitched"] for m in metas] == [False, True]
    assert [m["completion_finish"] for m in metas] == ["tool_calls", "stop"]
    assert_rows_are_the_engines(rec, served(engines["main"]))
    before = ids(rec, "prompt_ids", 0) + ids(rec, "response_ids", 0)
    tool_turn = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert ids(rec, "prompt_ids", 1) == before + tok.encode(tool_turn, add_special_tokens=False)
    if agent == "anthropic_agent":  # the call as Anthropic's tool_use block, input an object
        replies = RESULTS[("anthropic", metas[0]["episode"])]
        use = replies[0].content[0]
        assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
        assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]


# --------------------------------------------------------------------------- errors


def bad_agent(row, ep):
    """Each bad request on each new API gets that API's 4xx; then good ones still work,
    one per API, on two models."""
    seen = {}
    oa = ep.openai()
    wrong = openai.OpenAI(base_url=ep.base_url, api_key="sk-wrong", max_retries=0)
    an = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    an_wrong = anthropic.Anthropic(base_url=ep.base_url, api_key="sk-wrong", max_retries=0)
    user = [{"role": "user", "content": "grid S.G"}]
    orphan = [*user, {"type": "function_call_output", "call_id": "call_x", "output": "5"}]
    cases = {
        "r_model": lambda: oa.responses.create(model="gpt-5", input="hi"),
        "r_key": lambda: wrong.responses.create(model="main", input="hi"),
        "r_items": lambda: oa.responses.create(model="main", input=[{"type": "web_search_call"}]),
        "r_prev": lambda: oa.responses.create(
            model="main", input="hi", previous_response_id="resp_nope"
        ),
        "r_big": lambda: oa.responses.create(model="main", input="x" * 5000),
        "r_orphan": lambda: oa.responses.create(model="main", input=orphan),
        "m_model": lambda: an.messages.create(model="claude-x", max_tokens=4, messages=user),
        "m_key": lambda: an_wrong.messages.create(model="main", max_tokens=4, messages=user),
        "m_items": lambda: an.messages.create(
            model="main", max_tokens=4, messages=[{"role": "robot", "content": "hi"}]
        ),
        "m_big": lambda: an.messages.create(
            model="main", max_tokens=4, messages=[{"role": "user", "content": "x" * 5000}]
        ),
        "m_orphan": lambda: an.messages.create(
            model="main",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "5"}],
                }
            ],
        ),
    }
    for name, call in cases.items():
        try:
            call()
            seen[name] = (200, None)
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            seen[name] = (e.status_code, e.response.json())
    oa.responses.create(model="main", input="grid S.G", max_output_tokens=2)
    an.messages.create(model="checker", max_tokens=2, messages=user)
    RESULTS[("bad", ep.episode)] = seen
    return 1.0


def test_bad_requests_get_each_apis_own_4xx_and_the_episode_goes_on(models, items):
    rec, _ = run(models, "bad_agent", items(rows("grid S.G")), max_body_bytes=4096)
    assert rec["valid"].all() and rec.batch_size[0] == 2, strings(rec, "error")
    assert strings(rec, "policy") == ["main", "checker"]  # two models, two APIs, one episode
    seen = RESULTS[("bad", by_episode(rec).popitem()[0])]
    want = {
        "r_model": (404, "gpt-5"),
        "r_key": (401, "API key"),
        "r_items": (400, "web_search_call"),
        "r_prev": (400, "resp_nope"),
        "r_big": (413, "max_body_bytes"),
        "r_orphan": (400, "call_x"),
        "m_model": (404, "claude-x"),
        "m_key": (401, "API key"),
        "m_items": (400, "robot"),
        "m_big": (413, "max_body_bytes"),
        "m_orphan": (400, "toolu_x"),
    }
    anthropic_kinds = {400: "invalid_request_error", 401: "authentication_error",
                       404: "not_found_error", 413: "request_too_large"}  # fmt: skip
    for name, (code, needle) in want.items():
        status, body = seen[name]
        assert status == code, (name, status, body)
        if name.startswith("r_"):  # OpenAI's shape
            assert needle in body["error"]["message"] and "type" in body["error"], (name, body)
        else:  # Anthropic's shape
            assert body["type"] == "error" and body["error"]["type"] == anthropic_kinds[code]
            assert needle in body["error"]["message"], (name, body)


def reasoning_agent(row, ep):
    client = ep.openai()
    r1 = client.responses.create(model="main", input=row["prompt"])
    items_back = [o.model_dump(exclude_none=True) for o in r1.output]
    r2 = client.responses.create(
        model="main", input=[{"role": "user", "content": row["prompt"]}, *items_back,
                             {"role": "user", "content": "sure?"}]
    )  # fmt: skip
    RESULTS[("reasoning", ep.episode)] = (r1, r2)
    return 1.0


def test_a_thinking_reply_is_a_reasoning_item_and_comes_back_stitched(grid_tokenizer, items):
    from tests.helpers.agents import FakePolicy, ScriptedEngine

    tok = grid_tokenizer
    engine = ScriptedEngine(tok, lambda text, call, i: ("<think>hm</think>yes", True))
    rec, _ = run(({"main": FakePolicy(tok)}, {"main": engine}), "reasoning_agent",
                 items(rows("grid S.G")), max_new_tokens=80)  # fmt: skip
    assert rec["valid"].all() and rec.batch_size[0] == 2, strings(rec, "error")
    r1, _ = RESULTS[("reasoning", 0)]
    kinds = [o.type for o in r1.output]
    assert kinds == ["reasoning", "message"]
    assert r1.output[0].content[0].text == "hm" and r1.output_text == "yes"
    assert [m["stitched"] for m in strings(rec, "meta")] == [False, True]
    assert_rows_are_the_engines(rec, served(engine))


def extras_agent(row, ep):
    an = anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    user = [{"role": "user", "content": row["prompt"]}]
    greedy = {"temperature": 0, "top_logprobs": 2}  # not keywords of this anthropic client
    full = an.messages.create(model="main", max_tokens=8, messages=user, extra_body=greedy)
    text = full.content[0].text
    cut = an.messages.create(
        model="main", max_tokens=8, messages=user, stop_sequences=[text[2:4]], extra_body=greedy
    )
    oa = ep.openai()
    kept = oa.responses.create(model="main", input=row["prompt"], max_output_tokens=2, store=False)
    try:
        oa.responses.create(model="main", input="more", previous_response_id=kept.id)
        later = 200
    except openai.APIStatusError as e:
        later = e.status_code
    RESULTS[("extras", ep.episode)] = (full, cut, text[2:4], later)
    return 1.0


def test_messages_stop_sequences_logprobs_and_unstored_responses(models, items):
    rec, _ = run(models, "extras_agent", items(rows("grid S.G")))
    assert rec["valid"].all() and rec.batch_size[0] == 3, strings(rec, "error")
    full, cut, stop, later = RESULTS[("extras", by_episode(rec).popitem()[0])]
    text = full.content[0].text
    assert len(stop) == 2 and stop in text
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    entries = full.model_extra["logprobs"]["content"]  # the extension field
    resp = ids(rec, "response_ids", 0)
    assert len(entries) == len(resp) == full.usage.output_tokens
    for k, e in enumerate(entries):
        assert abs(e["logprob"] - float(rec["rollout_logprobs"][0][k])) < 1e-6
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
    assert later == 400  # store: false keeps nothing to continue from
