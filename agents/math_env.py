"""A tool-using math environment: the policy may run Python in the sandbox, then answers.

Each episode is one question from the task row (``question``, else ``prompt``). A turn
with a ``<tool_call>`` runs the ``python`` tool (model-written code in the
:mod:`~polyrl.agents.sandbox`) and feeds its output back as a ``tool`` message; a turn
without one is the final answer, checked against the row's ``answer`` (the last
``<answer>...</answer>`` or ``\\boxed{}``, compared numerically when both are numbers).
Reward 1 for a correct answer, else 0; ``info["success"]`` says which.

The ``tool_math`` task writes arithmetic questions too large to do reliably in one's head
(``write_dataset``), a ``corpus`` covering the tool-call syntax for tiny tokenizers, and
``sft_rows`` that demonstrate the format (a tool call, or a direct answer).
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Iterable
from typing import Annotated, Any

from polyrl.agents.env import StepResult, register_env
from polyrl.agents.sandbox import Sandbox, SandboxLimits
from polyrl.agents.tools import ParsedAction, Tool, ToolEnv, tool
from polyrl.core.registry import TASKS
from polyrl.core.rollout.rewards import extract_answer, normalize_answer
from polyrl.core.tasks.common import Rows, Split, chat_text, split_task

INSTRUCTIONS = (
    "You may run Python with "
    '<tool_call>{"name": "python", "arguments": {"code": "print(...)"}}</tool_call> '
    "and then give the final answer as <answer>...</answer>."
)


def python_tool(sandbox: Sandbox | None = None, name: str = "python") -> Tool:
    """The sandboxed code-execution tool (its result is the program's output or error)."""
    box = sandbox or Sandbox()

    def python(code: str) -> tuple[str, bool]:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: the complete program; print the values you need
        """
        result = box.run(code)
        return result.as_text(), result.ok

    return tool(python, name=name)


def answers_match(pred: str, gold: Any) -> bool:
    """Numeric comparison when both parse as numbers, else normalised string equality."""
    p, g = normalize_answer(str(pred)), normalize_answer(str(gold))
    try:
        a, b = float(p.replace(",", "")), float(g.replace(",", ""))
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return p == g


@register_env("tool_math")
class ToolMathEnv(ToolEnv):
    """Math questions with an optional Python sandbox tool; reward 1 for a correct answer."""

    def __init__(
        self,
        sandbox: Annotated[
            SandboxLimits | None,
            "limits of the python tool's sandbox (SandboxLimits fields: cpu_seconds, "
            "wall_seconds, memory_mb, ...); null: SandboxLimits' defaults",
        ] = None,
        instructions: Annotated[bool, "append how to call the tool to each question"] = True,
        max_turns: Annotated[int | None, "turns per episode (null: the workflow's limit)"] = 4,
        require_answer_tag: Annotated[
            bool, "a final answer without <answer>...</answer> scores 0"
        ] = False,
    ) -> None:
        super().__init__([python_tool(Sandbox(sandbox or SandboxLimits()))])
        self.instructions = instructions
        self.max_turns = max_turns
        self.require_answer_tag = require_answer_tag
        self.answer: Any = None

    def reset(self, task: dict) -> str:
        question = task.get("question", task.get("prompt"))
        if not question:
            raise KeyError(f"tool_math needs a 'question' (or 'prompt') field; got {sorted(task)}")
        if "answer" not in task:
            raise KeyError("tool_math needs an 'answer' field in the task row")
        self.answer = task["answer"]
        return f"{question}\n{INSTRUCTIONS}" if self.instructions else str(question)

    def finish(self, text: str, parsed: ParsedAction) -> StepResult:
        if self.require_answer_tag and "<answer>" not in text:
            return StepResult("", 0.0, True, {"success": False, "no_answer": True})
        correct = answers_match(extract_answer(text), self.answer)
        return StepResult(
            "", float(correct), True, {"success": correct, "tool_calls_total": self.calls}
        )


# --------------------------------------------------------------------------- the task


def make_rows(n: int, seed: int, digits: int = 3, ops: str = "*+") -> list[dict]:
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        value = a * b if op == "*" else a + b if op == "+" else a - b
        rows.append(
            {
                "prompt": f"What is {a}{op}{b}?",
                "question": f"What is {a}{op}{b}?",
                "answer": str(value),
            }
        )
    return rows


@split_task(256, 64, "questions")
def write_dataset(
    split: Split,
    digits: Annotated[int, "digits of each operand"] = 3,
    ops: Annotated[str, "operators to draw from, among * + -"] = "*+",
) -> Rows:
    """train.jsonl and eval.jsonl of arithmetic questions under ``out_dir``."""
    if digits < 1 or not ops or set(ops) - set("*+-"):
        raise ValueError(
            f"tool_math: digits must be >= 1 and ops a string of * + -, got {digits}, {ops!r}"
        )
    train = make_rows(split.n_train, split.seed, digits, ops)
    return train, make_rows(split.n_eval, split.seed + 10_007, digits, ops)


def _call(code: str) -> str:
    return (
        "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    )


def sft_rows(rows: Iterable[dict]) -> list[dict]:
    """First-turn demonstrations: call the tool with the expression."""
    out = []
    for r in rows:
        expr = r["question"].removeprefix("What is ").removesuffix("?")
        out.append(
            {"prompt": f"{r['question']}\n{INSTRUCTIONS}", "response": _call(f"print({expr})")}
        )
    return out


def corpus() -> list[str]:
    texts = []
    for r in make_rows(300, 0):
        expr = r["question"].removeprefix("What is ").removesuffix("?")
        texts.append(
            chat_text(
                ("user", f"{r['question']}\n{INSTRUCTIONS}"),
                ("assistant", _call(f"print({expr})")),
                ("tool", r["answer"]),
                ("assistant", f"<answer>{r['answer']}</answer>"),
            )
        )
    texts.append("Error: unknown tool; the tool call is not valid JSON [error: time limit]")
    return texts


TASKS.register("tool_math", sys.modules[__name__])
