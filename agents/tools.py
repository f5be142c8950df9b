"""Tools: typed Python functions the policy calls from its output, and environments that use them.

A function with type hints and a docstring becomes a :class:`Tool` with a JSON schema
(the OpenAI / Qwen ``{"type": "function", "function": {...}}`` form, which chat templates
accept through ``apply_chat_template(..., tools=...)``)::

    @tool
    def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: the first number
            b: the second number
        '''
        return a + b

Tool calls are parsed from the model's text by a registered parser (``TOOL_PARSERS``);
``hermes`` reads the Hermes / Qwen format ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``. :class:`ToolEnv` is the base for tool-using environments: when the
policy's turn holds tool calls it runs them and answers with one ``role: "tool"`` message
per call; a turn without tool calls is the final answer, scored by ``finish``. A
malformed call (bad JSON, unknown tool, wrong arguments) or a tool that raises is answered
with an error message the model can read and fix, never a crash.

A tool may return images for a vision-language policy: a ``PIL.Image``, or a list of
strings and images (the tool message then carries them as content parts). A tool whose
return type names an image (``-> Image.Image``) and returns none, or returns an image part
that is no image, is answered with an error message and counted like any failed call.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polyrl.agents.env import (
    Environment,
    Message,
    StepResult,
    content_parts,
    is_image,
    maybe_await,
)
from polyrl.core.observe.timeline import span
from polyrl.core.registry import Registry

TOOL_PARSERS: Registry[Callable[[str], ParsedAction]] = Registry("tool-call parser")


class ToolArgumentError(ValueError):
    """A tool call's arguments do not match the tool's schema."""


# --------------------------------------------------------------------------- schemas


def json_schema(tp: Any) -> dict[str, Any]:
    """JSON schema of a Python type hint (str, int, float, bool, None, list, tuple, dict,
    Optional / unions, Literal, Enum; anything else accepts any value)."""
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is type(None) or tp is None:
        return {"type": "null"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [json_schema(a) for a in args]}
    if tp in (list, tuple, set) or origin in (list, tuple, set, frozenset):
        out: dict[str, Any] = {"type": "array"}
        if args and not (origin is tuple and len(args) != 2 and args[-1] is not Ellipsis):
            out["items"] = json_schema(args[0])
        return out
    if tp is dict or origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = json_schema(args[1])
        return out
    return {}


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section, current = "", None
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:", "params:"):
            section, current = "args", None
            continue
        if stripped.lower() in (
            "returns:",
            "return:",
            "raises:",
            "yields:",
            "examples:",
            "example:",
            "notes:",
        ):
            section, current = "other", None
            continue
        if section == "args":
            m = _ARG_LINE.match(line)
            if m and (len(line) - len(line.lstrip())) <= 4:
                current = m.group(1).lstrip("*")
                params[current] = m.group(3).strip()
            elif current and stripped:
                params[current] = (params[current] + " " + stripped).strip()
        elif section == "":
            desc.append(line)
    return "\n".join(desc).strip(), params


def _type_name(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_type_name(s) for s in schema["anyOf"])
    return schema.get("type", "any")


def check_value(value: Any, schema: dict, where: str) -> Any:
    """``value`` if it matches ``schema`` (ints are accepted as numbers), else raise."""
    if not schema:
        return value
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return check_value(value, option, where)
            except ToolArgumentError:
                continue
        raise ToolArgumentError(f"{where} must be {_type_name(schema)}, got {json.dumps(value)}")
    if "enum" in schema:
        if value not in schema["enum"]:
            raise ToolArgumentError(
                f"{where} must be {_type_name(schema)}, got {json.dumps(value)}"
            )
        return value
    kind = schema.get("type")
    ok = {
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }.get(kind, lambda v: True)
    if not ok(value):
        raise ToolArgumentError(f"{where} must be {kind}, got {json.dumps(value)[:60]}")
    if kind == "array" and "items" in schema:
        return [check_value(v, schema["items"], f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return {
            k: check_value(v, schema["additionalProperties"], f"{where}.{k}")
            for k, v in value.items()
        }
    return value


# --------------------------------------------------------------------------- tools


@dataclass
class Tool:
    """A callable the policy may invoke, with its JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    returns_image: bool = False  # its return type names an image: it must return one

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def signature_text(self) -> str:
        props = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", []))
        parts = [
            f"{k} ({_type_name(v)}{', required' if k in required else ''})"
            for k, v in props.items()
        ]
        return ", ".join(parts) or "no arguments"

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The arguments checked against the schema, or a ToolArgumentError saying why not."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"the arguments of {self.name!r} must be a JSON object, "
                f"got {json.dumps(arguments)[:60]}"
            )
        props = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ToolArgumentError(
                f"tool {self.name!r} got unexpected argument "
                f"{unknown[0]!r}; its parameters: {self.signature_text()}"
            )
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolArgumentError(
                f"tool {self.name!r} is missing required argument "
                f"{missing[0]!r}; its parameters: {self.signature_text()}"
            )
        return {k: check_value(v, props[k], f"argument {k!r}") for k, v in arguments.items()}

    async def acall(self, arguments: dict[str, Any]) -> Any:
        """Run the tool (sync functions on a worker thread, so episodes overlap)."""
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**arguments)
        return await maybe_await(await asyncio.to_thread(self.fn, **arguments))


def tool(
    fn: Callable | None = None, *, name: str | None = None, description: str | None = None
) -> Any:
    """Make a :class:`Tool` from a typed function (usable bare or with arguments)."""

    def build(f: Callable) -> Tool:
        sig = inspect.signature(f)
        hints = typing.get_type_hints(f)
        doc, param_docs = parse_docstring(f.__doc__)
        props: dict[str, Any] = {}
        required = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(
                    f"tool {f.__name__}: *args/**kwargs cannot be described as a "
                    "JSON schema; name every parameter"
                )
            schema = json_schema(hints.get(p.name, inspect.Parameter.empty))
            if p.name in param_docs:
                schema["description"] = param_docs[p.name]
            if p.default is not p.empty:
                try:
                    json.dumps(p.default)
                    schema["default"] = p.default
                except TypeError:
                    pass
            else:
                required.append(p.name)
            props[p.name] = schema
        params = {"type": "object", "properties": props, "required": required}
        returns = hints.get("return")
        image = returns is not None and "Image" in getattr(returns, "__name__", str(returns))
        return Tool(name or f.__name__, description or doc or f.__name__, params, f, image)

    return build(fn) if fn is not None else build


# --------------------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedAction:
    """A policy turn split into its text, its well-formed calls and its malformed ones."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def register_parser(name: str) -> Callable:
    def add(fn: Callable[[str], ParsedAction]) -> Callable[[str], ParsedAction]:
        TOOL_PARSERS.register(name, fn)
        return fn

    return add


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
HERMES_HINT = (
    'write <tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON '
    "object>}}</tool_call>"
)


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedAction:
    """Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    calls, errors, outside, pos = [], [], [], 0
    for m in _HERMES.finditer(text):
        outside.append(text[pos : m.start()])
        pos = m.end()
        body = m.group(1).strip()
        if not m.group(2):
            errors.append(f"the tool call is not closed with </tool_call>; {HERMES_HINT}")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(
                f"the tool call is not valid JSON ({e.msg} at character {e.pos}); {HERMES_HINT}"
            )
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f'the tool call needs a string "name"; {HERMES_HINT}')
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                errors.append(
                    f"the arguments of {obj['name']!r} are not valid JSON ({e.msg}); {HERMES_HINT}"
                )
                continue
        if not isinstance(args, dict):
            errors.append(f"the arguments of {obj['name']!r} must be a JSON object; {HERMES_HINT}")
            continue
        calls.append(ToolCall(obj["name"], args))
    outside.append(text[pos:])
    return ParsedAction("".join(outside).strip(), calls, errors)


# --------------------------------------------------------------------------- environments


def tool_message(name: str, content: str | list) -> Message:
    return {"role": "tool", "name": name, "content": content}


def _image_result(name: str, result: Any, expected: bool) -> tuple[Any, bool] | None:
    """A tool result with images as content parts, an error text when an image was
    expected and is missing or wrong, or None for a result without images."""
    items = result if isinstance(result, list) else [result]
    has_image = any(
        is_image(p) or (isinstance(p, dict) and p.get("type") == "image") for p in items
    )
    if not has_image:
        if expected:
            return (
                f"Error: tool {name!r} should return an image but returned a "
                f"{type(result).__name__}"
            ), False
        return None
    try:
        parts = content_parts(items, f"tool {name!r}")
    except TypeError as e:
        return f"Error: {e}", False
    for p in parts:
        if p["type"] == "image" and not is_image(p["image"]):
            return (
                f"Error: tool {name!r} returned an image part holding a "
                f"{type(p['image']).__name__}, not an image"
            ), False
    return parts, True


class ToolEnv(Environment):
    """Base for environments whose policy may call tools before answering.

    Subclasses set ``self.tools`` (a list of :class:`Tool`) and implement ``reset`` and
    ``finish(text, parsed) -> StepResult`` for the final answer. ``parser`` names the
    tool-call format; ``max_calls_per_turn`` bounds the calls run per turn.
    """

    parser: str = "hermes"
    max_calls_per_turn: int = 4

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self.tools: list[Tool] = list(tools or [])
        self.calls = 0
        self.tool_errors = 0

    def tool_schemas(self) -> list[dict]:
        """Schemas for the chat template's ``tools`` argument (rendered in the first prompt)."""
        return [t.schema() for t in self.tools]

    def finish(self, text: str, parsed: ParsedAction) -> StepResult:  # pragma: no cover
        raise NotImplementedError

    async def run_call(self, call: ToolCall) -> tuple[str | list, bool]:
        """(result text or content parts, ok) of one call; every failure becomes a readable
        error text."""
        by_name = {t.name: t for t in self.tools}
        t = by_name.get(call.name)
        if t is None:
            return (
                f"Error: unknown tool {call.name!r}; available tools: "
                f"{', '.join(by_name) or '(none)'}"
            ), False
        try:
            args = t.validate(call.arguments)
        except ToolArgumentError as e:
            return f"Error: {e}", False
        try:
            with span("tool_call", tool=call.name):  # on the calling episode's track
                result = await t.acall(args)
        except Exception as e:
            return f"Error: tool {call.name!r} raised {type(e).__name__}: {e}", False
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], bool):
            text, ok = result
            image = _image_result(call.name, text, t.returns_image) if ok else None
            return image if image is not None else (str(text), ok)
        image = _image_result(call.name, result, t.returns_image)
        if image is not None:
            return image
        return result if isinstance(result, str) else json.dumps(result, default=str), True

    async def step(self, action: str) -> StepResult:
        parsed = TOOL_PARSERS.get(self.parser)(action)
        if not parsed.calls and not parsed.errors:
            return await maybe_await(self.finish(action, parsed))
        messages: list[Message] = []
        errors = 0
        for err in parsed.errors:
            messages.append(tool_message("error", f"Error: {err}"))
            errors += 1
        run = parsed.calls[: self.max_calls_per_turn]
        results = await asyncio.gather(*(self.run_call(c) for c in run))
        for c, (text, ok) in zip(run, results, strict=True):
            messages.append(tool_message(c.name, text))
            errors += not ok
        for c in parsed.calls[self.max_calls_per_turn :]:
            messages.append(
                tool_message(
                    c.name,
                    f"Error: at most {self.max_calls_per_turn} "
                    "tool calls per turn; this one was not run",
                )
            )
            errors += 1
        self.calls += len(run)
        self.tool_errors += errors
        return StepResult(messages, 0.0, False, {"tool_calls": len(run), "tool_errors": errors})
