"""Tools: schemas from type hints, the Hermes parser, errors fed back to the model, and the
tool-using math environment end to end (through the workflow and the real sandbox)."""

from __future__ import annotations

import asyncio
import enum
from typing import Literal

import pytest

from polyrl.agents.math_env import ToolMathEnv, answers_match
from polyrl.agents.tools import (
    TOOL_PARSERS,
    ToolArgumentError,
    ToolEnv,
    parse_hermes,
    tool,
)
from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


@tool
def weather(
    city: str,
    days: int = 1,
    unit: Unit = Unit.C,
    hourly: bool | None = None,
    tags: list[str] | None = None,
    mode: Literal["fast", "exact"] = "fast",
) -> str:
    """Forecast for a city.

    Args:
        city: the city's name
        days: how many days
            ahead (1-7)
        unit: temperature unit
    """
    return f"{city}: sunny for {days} days"


def test_schema_from_type_hints_and_docstring():
    s = weather.schema()
    assert s["type"] == "function" and s["function"]["name"] == "weather"
    assert s["function"]["description"] == "Forecast for a city."
    p = s["function"]["parameters"]
    assert p["required"] == ["city"]
    assert p["properties"]["city"] == {"type": "string", "description": "the city's name"}
    assert p["properties"]["days"] == {
        "type": "integer",
        "description": "how many days ahead (1-7)",
        "default": 1,
    }
    assert p["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert p["properties"]["hourly"] == {
        "anyOf": [{"type": "boolean"}, {"type": "null"}],
        "default": None,
    }
    assert p["properties"]["tags"]["anyOf"][0] == {"type": "array", "items": {"type": "string"}}
    assert p["properties"]["mode"] == {"enum": ["fast", "exact"], "default": "fast"}


def test_arguments_are_validated_with_readable_errors():
    assert weather.validate({"city": "Oslo", "days": 3}) == {"city": "Oslo", "days": 3}
    with pytest.raises(ToolArgumentError, match="missing required argument 'city'"):
        weather.validate({"days": 3})
    with pytest.raises(ToolArgumentError, match="unexpected argument 'citty'.*city \\(string"):
        weather.validate({"citty": "Oslo"})
    with pytest.raises(ToolArgumentError, match="argument 'days' must be integer"):
        weather.validate({"city": "Oslo", "days": "3"})
    with pytest.raises(ToolArgumentError, match="must be one of"):
        weather.validate({"city": "Oslo", "mode": "slow"})
    with pytest.raises(ToolArgumentError, match="must be a JSON object"):
        weather.validate(["Oslo"])


def test_hermes_parser_reads_calls_and_reports_malformed_ones():
    text = (
        'Let me check. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
        '</tool_call>\n<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
        "</tool_call>"
    )
    parsed = TOOL_PARSERS.get("hermes")(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("weather", {"city": "Oslo"}),
        ("weather", {"city": "Rome"}),
    ]
    assert parsed.text == "Let me check." and parsed.errors == []
    bad = parse_hermes('<tool_call>{"name": "weather", "arguments": {"city": }}</tool_call>')
    assert not bad.calls and "not valid JSON" in bad.errors[0] and "<tool_call>" in bad.errors[0]
    assert 'needs a string "name"' in parse_hermes("<tool_call>[1, 2]</tool_call>").errors[0]
    assert "not closed" in parse_hermes('<tool_call>{"name": "x"').errors[0]
    assert (
        "must be a JSON object"
        in parse_hermes('<tool_call>{"name": "x", "arguments": [1]}</tool_call>').errors[0]
    )
    plain = parse_hermes("The answer is 4.")
    assert plain.calls == [] and plain.errors == [] and plain.text == "The answer is 4."


def test_tool_env_answers_every_problem_with_a_tool_message_not_a_crash():
    @tool
    def boom(x: int) -> int:
        """Always fails."""
        raise ZeroDivisionError("no")

    env = ToolEnv([weather, boom])
    calls = (
        '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
        '<tool_call>{"name": "wether", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "weather", "arguments": {"days": 2}}</tool_call>'
        '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "weather" "arguments": {}}</tool_call>'
    )
    result = asyncio.run(env.step(calls))
    texts = [m["content"] for m in result.observation]
    assert all(m["role"] == "tool" for m in result.observation)
    assert texts[0].startswith("Error: the tool call is not valid JSON")
    assert texts[1] == "Oslo: sunny for 1 days"
    assert texts[2] == "Error: unknown tool 'wether'; available tools: weather, boom"
    assert texts[3].startswith("Error: tool 'weather' is missing required argument 'city'")
    assert texts[4] == "Error: tool 'boom' raised ZeroDivisionError: no"
    assert result.done is False and result.info == {"tool_calls": 4, "tool_errors": 4}


def test_answers_are_compared_numerically():
    assert answers_match("1,234", "1234") and answers_match(" 5.0 ", "5")
    assert not answers_match("5.1", "5") and answers_match("abc.", "abc")


CODE = "print(417 * 923)"


def tool_math_script(text, call, i):
    """Turn 0: a Python call (one episode writes broken code); turn 1: the answer."""
    if call == 0:
        code = CODE if i == 0 else "print(417 * )"
        return (
            '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>',
            True,
        )
    return ("<answer>384891</answer>" if i == 0 else "<answer>1</answer>"), True


def test_tool_math_episode_through_the_workflow_and_the_sandbox(make_workflow, items):
    wf, engine = make_workflow(
        tool_math_script,
        env="tool_math",
        mode="concat",
        max_turns=3,
        max_turn_tokens=200,
        env_workers=1,
    )
    rows = [{"question": "What is 417*923?", "answer": "384891"}]
    rec = wf.rollout(items(rows), SamplingParams(n=2, max_new_tokens=200))
    metas = strings(rec, "meta")
    texts = strings(rec, "response_text")
    assert metas[0]["success"] and metas[0]["return"] == 1.0
    assert "tool\n384891" in texts[0]  # the sandbox's output came back as a tool message
    assert not metas[1]["success"]
    assert "SyntaxError" in texts[1] and "[error: the code raised an exception]" in texts[1]
    assert rec["valid"].all()


def test_tool_math_env_scores_direct_answers_and_lists_its_tool():
    env = ToolMathEnv()
    assert "What is 2+2?" in env.reset({"question": "What is 2+2?", "answer": "4"})
    assert env.tool_schemas()[0]["function"]["name"] == "python"
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["code"]
    done = asyncio.run(env.step("It is <answer>4</answer>"))
    assert done.done and done.reward == 1.0 and done.info["success"]
    with pytest.raises(KeyError, match="answer"):
        env.reset({"question": "x"})
