"""Gateway demo 1's agent written against the other APIs the gateway serves.

Same task, tool and rule as ``gateway_calculator.py:solve`` (ask the question offering a
``calc`` tool, run the calculator when the reply calls it, the first reply without a call
is the answer, at most 3 requests), as users of two other frameworks write it:

- ``solve_agents_sdk``: an OpenAI Agents SDK agent (Responses API) with a function tool;
  ``Runner.run`` makes the requests and runs the tool.
- ``solve_messages``: a tool loop with the ``anthropic`` client (Messages API).

Train either with ``gateway_calculator.yaml`` and ``rollout.args.agent`` set to it, e.g.
``polyrl train examples/gateway_calculator.yaml
rollout.args.agent=./gateway_calculator_apis.py:solve_messages``.
"""

from __future__ import annotations

import json
import re

DESCRIPTION = "Evaluate a*b, a+b or a-b for whole numbers a and b."
PARAMETERS = {
    "type": "object",
    "properties": {"expr": {"type": "string"}},
    "required": ["expr"],
}
MAX_TOKENS = 24  # the recipe's rollout.max_new_tokens (a Messages request must give one)


def calculate(expr: str) -> str:
    """The tool (as ``gateway_calculator.calculate``): ``a op b`` on whole numbers."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*", str(expr))
    if not m:
        return "error: write a*b, a+b or a-b"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


async def solve_agents_sdk(row, endpoint):
    """An Agents SDK agent: the model may call ``calc``; its final output is the answer."""
    from agents import (
        Agent,
        AgentsException,
        FunctionTool,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers

    async def run_calc(ctx, arguments: str) -> str:
        try:
            return calculate(json.loads(arguments).get("expr", ""))
        except (json.JSONDecodeError, AttributeError):
            return "error: arguments must be a JSON object"

    calc = FunctionTool(
        name="calc",
        description=DESCRIPTION,
        params_json_schema=PARAMETERS,
        on_invoke_tool=run_calc,
        strict_json_schema=False,
    )
    client = endpoint.async_openai()
    agent = Agent(
        name="calculator",
        tools=[calc],
        model=OpenAIResponsesModel(model="main", openai_client=client),
    )
    try:
        result = await Runner.run(agent, row["prompt"], max_turns=3)
        answer = str(result.final_output or "")
    except AgentsException:  # past max_turns, or a reply cut at max_output_tokens
        answer = ""
    finally:
        await client.close()
    correct = answer.strip() == row["answer"]
    return {"reward": float(correct), "success": correct}


def solve_messages(row, endpoint):
    """A Messages API tool loop with the ``anthropic`` client."""
    import anthropic

    client = anthropic.Anthropic(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    )
    tools = [{"name": "calc", "description": DESCRIPTION, "input_schema": PARAMETERS}]
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.messages.create(
            model="main", max_tokens=MAX_TOKENS, tools=tools, messages=messages
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            answer = "".join(b.text for b in reply.content if b.type == "text")
            correct = answer.strip() == row["answer"]
            return {"reward": float(correct), "success": correct}
        messages.append({"role": "assistant", "content": reply.content})
        results = []
        for use in uses:
            expr = use.input.get("expr", "") if isinstance(use.input, dict) else ""
            results.append(
                {"type": "tool_result", "tool_use_id": use.id, "content": calculate(expr)}
            )
        messages.append({"role": "user", "content": results})
    return {"reward": 0.0, "success": False}
