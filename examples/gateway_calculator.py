"""Gateway demo 1: an agent written only against the ``openai`` client learns to use a tool.

``solve`` is the agent, as a user writes it: it asks ``model="main"`` a multiplication
question, offering a ``calc`` tool; when the reply calls the tool it runs the calculator
and asks again with the result; a reply without a tool call is the answer. It returns 1
for a correct answer. The run (``gateway_calculator.yaml``) serves ``main`` through the
gateway and trains it on what the agent did.

``Calculator`` is the task the recipe names: two-digit products (held-out problems never
in train), a corpus for the tiny tokenizer, and a warm start that mostly answers directly
(a guess: a tiny model cannot multiply) and only sometimes calls the tool, so what RL has
to learn is when to reach for the calculator, and to copy the question into it and its
result back out.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Annotated

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate a*b, a+b or a-b for whole numbers a and b.",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string"}},
            "required": ["expr"],
        },
    },
}


def calculate(expr: str) -> str:
    """The tool: ``a op b`` on whole numbers, or an error message the model can read."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*", str(expr))
    if not m:
        return "error: write a*b, a+b or a-b"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


def solve(row, endpoint):
    """The agent: a loop that may call the calculator, then answers."""
    client = endpoint.openai()  # or openai.OpenAI(base_url=..., api_key=...)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="main", messages=messages, tools=[CALC])
        message = reply.choices[0].message
        if not message.tool_calls:
            correct = (message.content or "").strip() == row["answer"]
            return {"reward": float(correct), "success": correct}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments).get("expr", ""))
            except (json.JSONDecodeError, AttributeError):
                result = "error: arguments must be a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "success": False}


def solve_with_two_models(row, endpoint):
    """Demo 2's agent: ``planner`` reads the question and calls the calculator;
    ``answerer`` sees only the calculator's reading, never the question, and gives the
    answer. Success needs both, and one run trains both."""
    client = endpoint.openai()
    question = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="planner", messages=question, tools=[CALC])
    calls = reply.choices[0].message.tool_calls
    if not calls:  # the planner answered by itself
        answer = reply.choices[0].message.content or ""
    else:
        try:
            reading = calculate(json.loads(calls[0].function.arguments).get("expr", ""))
        except (json.JSONDecodeError, AttributeError):
            reading = "error: arguments must be a JSON object"
        note = [{"role": "user", "content": reading_note(reading)}]
        answer = client.chat.completions.create(model="answerer", messages=note)
        answer = answer.choices[0].message.content or ""
    correct = answer.strip() == row["answer"]
    return {"reward": float(correct), "success": correct}


def reading_note(reading: str) -> str:
    """What demo 2's answerer is shown: the calculator's reading alone."""
    return f"The calculator says {reading}."


# --------------------------------------------------------------------------- the task


def tool_call(expr: str) -> str:
    """The Hermes tool-call text the model writes (what the gateway parses)."""
    body = json.dumps({"name": "calc", "arguments": {"expr": expr}})
    return f"<tool_call>{body}</tool_call>"


class Calculator:
    """The task: ``What is a*b?`` with two-digit operands."""

    @staticmethod
    def make_rows(n: int, seed: int, lo: int = 10, hi: int = 49, exclude=()) -> list[dict]:
        pool = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        pool = [p for p in pool if f"{p[0]}*{p[1]}" not in set(exclude)]
        random.Random(seed).shuffle(pool)
        if n > len(pool):
            raise ValueError(f"only {len(pool)} problems with operands {lo}..{hi}; asked {n}")
        return [
            {"prompt": f"What is {a}*{b}?", "answer": str(a * b), "uid": f"{a}*{b}"}
            for a, b in pool[:n]
        ]

    @staticmethod
    def write_dataset(
        out_dir: str | Path,
        seed: int,
        n_train: Annotated[int, "training problems"] = 512,
        n_eval: Annotated[int, "held-out problems, never in train"] = 64,
        lo: Annotated[int, "smallest operand"] = 10,
        hi: Annotated[int, "largest operand"] = 49,
        tool_share: Annotated[
            float, "share of warm-start problems shown solved with the tool (the rest guessed)"
        ] = 0.25,
        read_share: Annotated[
            float, "share of warm-start tool readings copied into the answer (the rest ignored)"
        ] = 1.0,
    ) -> tuple[Path, Path]:
        if not 0 <= lo <= hi:
            raise ValueError(f"task.args: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
        for key, share in (("tool_share", tool_share), ("read_share", read_share)):
            if not 0 <= share <= 1:
                raise ValueError(f"task.args.{key} must be in [0, 1], got {share}")
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        held = Calculator.make_rows(n_eval, seed + 1, lo, hi)
        train = Calculator.make_rows(n_train, seed, lo, hi, exclude={r["uid"] for r in held})
        rng = random.Random(seed + 2)
        for r in train:
            r["warm_start"] = "tool" if rng.random() < tool_share else "direct"
            r["reads"] = rng.random() < read_share
        for name, rows in (("train", train), ("eval", held)):
            (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return out / "train.jsonl", out / "eval.jsonl"

    @staticmethod
    def sft_rows(rows) -> list[dict]:
        """The warm start, two rows per problem. The first turn: the tool call, or a
        direct answer, as the row's ``warm_start`` says. After the tool's reading: the
        reading copied out, or (``reads`` false) another problem's product: a habit of
        ignoring the tool (``read_share`` below 1; demo 1 keeps 1)."""
        rows = list(rows)
        out = []
        for k, r in enumerate(rows):
            expr = r["prompt"].removeprefix("What is ").removesuffix("?")
            call = tool_call(expr)
            first = call if r["warm_start"] == "tool" else r["answer"]
            out.append({"prompt": r["prompt"], "response": first})
            turn = [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": calculate(expr)},
            ]
            other = rows[(k + 1) % len(rows)]["answer"]
            out.append({"prompt": turn, "response": r["answer"] if r["reads"] else other})
        return out

    @staticmethod
    def corpus() -> list[str]:
        texts = []
        for r in Calculator.make_rows(400, 0, 0, 99):
            expr = r["prompt"].removeprefix("What is ").removesuffix("?")
            texts.append(
                f"<|im_start|>user\n{r['prompt']}<|im_end|>\n"
                f"<|im_start|>assistant\n{tool_call(expr)}<|im_end|>\n"
                f"<|im_start|>tool\n{r['answer']}<|im_end|>\n"
                f"<|im_start|>assistant\n{r['answer']}<|im_end|>\n"
            )
        texts.append(calculate("x") + " error: arguments must be a JSON object")
        return texts


class PlanAndRead(Calculator):
    """Demo 2's task: the same problems, with a warm start that gives each role a habit.

    The planner's warm start calls the calculator but writes ``a+b`` for ``a*b`` on
    ``1 - times_share`` of its problems; the answerer's (it sees only the reading) hedges
    ``about N`` instead of ``N`` on ``1 - read_share`` of its readings. Below one half
    each, greedy decoding follows the habit, so the warm pair fails and RL has to move
    both models' choice over the line.
    """

    @staticmethod
    def write_dataset(
        out_dir: str | Path,
        seed: int,
        n_train: Annotated[int, "training problems"] = 512,
        n_eval: Annotated[int, "held-out problems, never in train"] = 64,
        lo: Annotated[int, "smallest operand"] = 10,
        hi: Annotated[int, "largest operand"] = 49,
        times_share: Annotated[
            float, "share of the planner's warm-start calls written a*b (the rest a+b)"
        ] = 0.4,
        read_share: Annotated[
            float, "share of the answerer's warm-start answers that are the bare reading"
        ] = 0.4,
    ) -> tuple[Path, Path]:
        if not 0 <= lo <= hi:
            raise ValueError(f"task.args: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
        for key, share in (("times_share", times_share), ("read_share", read_share)):
            if not 0 <= share <= 1:
                raise ValueError(f"task.args.{key} must be in [0, 1], got {share}")
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        held = Calculator.make_rows(n_eval, seed + 1, lo, hi)
        train = Calculator.make_rows(n_train, seed, lo, hi, exclude={r["uid"] for r in held})
        rng = random.Random(seed + 2)
        for r in train:
            r["times"] = rng.random() < times_share
            r["reads"] = rng.random() < read_share
        for name, rows in (("train", train), ("eval", held)):
            (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return out / "train.jsonl", out / "eval.jsonl"

    @staticmethod
    def sft_rows(rows) -> list[dict]:
        """Two rows per problem, one per role (both models start from this one warm
        start; the prompts tell the roles apart)."""
        out = []
        for r in rows:
            a, b = r["prompt"].removeprefix("What is ").removesuffix("?").split("*")
            expr = f"{a}*{b}" if r["times"] else f"{a}+{b}"
            out.append({"prompt": r["prompt"], "response": tool_call(expr)})
            reading = calculate(expr)
            answer = reading if r["reads"] else f"about {reading}"
            out.append({"prompt": reading_note(reading), "response": answer})
        return out

    @staticmethod
    def corpus() -> list[str]:
        texts = []
        for k, r in enumerate(Calculator.make_rows(400, 0, 0, 99)):
            expr = r["prompt"].removeprefix("What is ").removesuffix("?")
            reading = calculate(expr if k % 2 else expr.replace("*", "+"))
            texts.append(
                f"<|im_start|>user\n{r['prompt']}<|im_end|>\n"
                f"<|im_start|>assistant\n{tool_call(expr)}<|im_end|>\n"
                f"<|im_start|>user\n{reading_note(reading)}<|im_end|>\n"
                f"<|im_start|>assistant\nabout {reading}<|im_end|>\n"
            )
        texts.append(calculate("x") + " error: arguments must be a JSON object")
        return texts
