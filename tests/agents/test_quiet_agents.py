"""Agent frameworks' async clients stay quiet across rollout steps (issue 44).

langchain-openai caches one ``httpx`` client per base URL (an LRU of 128); a gateway
episode has a base URL of its own, so a run of more than 128 episodes drops cached clients,
and a dropped client closes itself by scheduling ``aclose()`` on the loop running then.
With a loop per step, a client made in step 1 and dropped in step 2 closes connections of
a closed loop: ``Task exception was never retrieved ... Event loop is closed``, once per
client (thousands of lines in a 30-step run). Here step 2's agents empty the cache, as the
LRU does after 128 episodes, and the log must stay clean.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging

import pytest

from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers.agents import FakePolicy, ScriptedEngine

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
NOISE = ("Event loop is closed", "Task exception was never retrieved", "no running event loop")


async def langgraph_agent(row, ep):
    """An async LangGraph tool graph over ChatOpenAI, as the LangGraph docs write one (no
    client closed); with ``row["evict"]`` it then empties langchain-openai's client cache."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langchain_openai.chat_models import _client_utils
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model="main", base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    llm = llm.bind_tools([add])

    async def agent(state: MessagesState):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    out = await graph.compile().ainvoke({"messages": [("user", row["prompt"])]})
    if row.get("evict"):
        _client_utils._cached_async_httpx_client.cache_clear()  # what the LRU does at 129
        gc.collect()
        await asyncio.sleep(0.05)  # the dropped clients' aclose() tasks run
    return float(out["messages"][-1].content == "it is 5")


def test_a_langgraph_agent_over_two_steps_leaves_no_closed_loop_errors(
    grid_tokenizer, items, caplog
):
    pytest.importorskip("langgraph")
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    def script(text, call, i):
        return ("it is 5" if "<|im_start|>tool" in text else CALL), True

    tok = grid_tokenizer
    ctx = Context(None, {"main": FakePolicy(tok)}, {"main": ScriptedEngine(tok, script)})
    wf = Gateway(ctx, agent=langgraph_agent)
    params = SamplingParams(n=2, max_new_tokens=80)
    caplog.set_level(logging.ERROR)
    try:
        for evict in (False, True):  # step 1 fills the cache, step 2 drops step 1's clients
            rec = wf.rollout(items([{"prompt": "what is 2 + 3?", "evict": evict}]), params)
            assert rec["valid"].all(), strings(rec, "error")
            assert [m["return"] for m in strings(rec, "meta")] == [1.0] * 4  # 2 rows/episode
    finally:
        wf.close()
    gc.collect()
    noise = [r.getMessage() + str(r.exc_info) for r in caplog.records]
    assert not [n for n in noise if any(s in n for s in NOISE)], noise[:3]


def test_agent_loop_runs_in_the_callers_context_and_lets_errors_through():
    from polyrl.agents.agent_loop import AgentLoop

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def read():
        return var.get(), asyncio.get_running_loop()

    async def boom():
        raise KeyError("from the agent")

    loop = AgentLoop()
    try:
        var.set("step 3")
        first, loop_a = loop.run(read())
        var.set("step 4")
        second, loop_b = loop.run(read())
        assert (first, second) == ("step 3", "step 4")
        assert loop_a is loop_b and not loop_a.is_closed()  # one loop for every run
        with pytest.raises(KeyError, match="from the agent"):
            loop.run(boom())
    finally:
        loop.close()
    assert loop_a.is_closed()


def test_agent_loop_close_lets_dropped_clients_finish_closing():
    """A client dropped in a reference cycle closes only when collected; close() collects
    it while the loop still runs, so its aclose() completes there."""
    from polyrl.agents.agent_loop import AgentLoop

    closed: list[str] = []

    class Client:  # closes itself like openai's AsyncHttpxClientWrapper.__del__
        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

        async def aclose(self):
            await asyncio.sleep(0.01)
            closed.append("closed")

        def __del__(self):
            asyncio.get_running_loop().create_task(self.aclose())

    async def make():
        Client()

    loop = AgentLoop()
    gc.disable()  # the collector must not run before close() does
    try:
        loop.run(make())
        assert closed == []
        loop.close()
    finally:
        gc.enable()
    assert closed == ["closed"]


def tool_agent(row, ep):
    """One Chat Completions call with a tool, as an agent framework makes it."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            },
        }
    ]
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = ep.openai().chat.completions.create(model="main", messages=messages, tools=tools)
    return float(bool(reply.choices[0].message.tool_calls))


@pytest.mark.parametrize("max_new_tokens", [20, 80])
def test_a_tool_call_cut_at_max_new_tokens_is_counted_and_warned_once(
    grid_tokenizer, items, caplog, max_new_tokens
):
    """The scripted call is ~60 tokens: at 20 every completion ends inside it (counted in
    rollout/tool_call_cut, one warning over two rollouts); at 80 it closes (no warning)."""
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    tok = grid_tokenizer
    engine = ScriptedEngine(tok, lambda text, call, i: (CALL, True))
    wf = Gateway(Context(None, {"main": FakePolicy(tok)}, {"main": engine}), agent=tool_agent)
    params = SamplingParams(n=2, max_new_tokens=max_new_tokens)
    caplog.set_level(logging.WARNING, logger="polyrl.agents.gateway")
    cut = []
    try:
        for _ in range(2):
            rec = wf.rollout(items([{"prompt": "what is 2 + 3?"}]), params)
            cut.append(wf.rollout_metrics()["rollout/tool_call_cut"])
    finally:
        wf.close()
    warned = [r.getMessage() for r in caplog.records if "inside a tool call" in r.getMessage()]
    full = len(engine.char_ids(CALL)) + 1  # the call, then eos
    if max_new_tokens < full:
        assert cut == [2.0, 2.0] and rec["truncated"].all()
        assert [m["return"] for m in strings(rec, "meta")] == [0.0, 0.0]  # no call seen
        assert len(warned) == 1, warned
        assert "2 of 2 completions" in warned[0] and "cut at 20 tokens" in warned[0]
        assert "rollout.max_new_tokens=20" in warned[0]
    else:
        assert cut == [0.0, 0.0] and not rec["truncated"].any() and warned == []
        assert [m["return"] for m in strings(rec, "meta")] == [1.0, 1.0]
