"""Rewards that read what the environment reported (rows from the multi-turn workflow).

- ``env_return``: the episode's undiscounted sum of environment rewards.
- ``env_success``: 1.0 if the episode succeeded (the env's ``info["success"]``, else
  return > 0), per row.
- ``success_rate``: the same success, weighted so that the *row mean* is the success rate
  over episodes even in ``step`` mode, where long episodes have more rows. Use it with
  weight 0 as a metric (``eval.accuracy_term: success_rate``), not as a training reward.
- ``unit_tests``: 1.0 when the response's Python passes the row's tests (HumanEval/
  MBPP-style rows; the marl CoopHumanEval recipe scores two agents' joined code with
  it). The code and the tests run in two separate sandboxed processes: the code only
  answers calls with plain data, and passing is said by the tests' process alone (see
  ``Sandbox.run_tests`` and agents/SANDBOX.md).
"""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

from polyrl.agents.sandbox import Sandbox, SandboxLimits
from polyrl.core.rollout.rewards import Sample, register_reward


def _meta(sample: Sample, key: str, reward: str):
    if key not in sample.meta:
        raise ValueError(
            f"{reward} needs meta[{key!r}] from the multi_turn workflow; this row "
            f"has meta keys {sorted(sample.meta)}"
        )
    return sample.meta[key]


@register_reward("env_return")
def env_return(sample: Sample, scale: float = 1.0) -> float:
    """The episode's summed environment reward, times ``scale``."""
    return scale * float(_meta(sample, "return", "env_return"))


@register_reward("env_success")
def env_success(sample: Sample) -> float:
    """1.0 when the episode succeeded, else 0.0."""
    return float(bool(_meta(sample, "success", "env_success")))


@register_reward("success_rate")
def success_rate(sample: Sample) -> float:
    """Success weighted per row so that the mean over rows is the per-episode success rate."""
    weight = float(sample.meta.get("episode_weight", 1.0))
    return weight * float(bool(_meta(sample, "success", "success_rate")))


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_IMPORT = re.compile(r"^(?:from\s+\S+\s+import\s+.+|import\s+.+)$", re.M)


def extract_code(text: str) -> str:
    """The Python in a response: its fenced blocks joined in order (an unclosed last fence
    runs to the end), or the whole text when it has no fence."""
    blocks = _FENCE.findall(text)
    return "\n\n".join(b.strip("\n") for b in blocks) if blocks else text


@dataclass
class Program:
    """What ``unit_tests`` runs for one row, split between two processes: ``preamble`` +
    ``code`` (the response's) in the sandboxed candidate process; ``preamble`` +
    ``checks`` (the row's tests), then ``check(<entry_point>)`` when the row names one,
    in the checker process, which the response's code never enters."""

    preamble: str
    code: str
    checks: str
    entry_point: str


def _is_stub(node: ast.AST) -> bool:
    """A definition the response is asked to write: only a docstring, ``pass`` or ``...``."""
    body = getattr(node, "body", [])
    return all(
        isinstance(b, ast.Pass) or (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))
        for b in body
    )


def prompt_preamble(prompt: str, entry_point: str = "") -> str:
    """What of the prompt both processes run first: its imports and the helpers it
    defines in full (HumanEval/32's ``poly``, /38's ``encode_cyclic``), never the entry
    point or another stub. The checks then call the dataset's helpers, not a response's
    redefinition. A prompt that is not Python gives its import lines."""
    try:
        tree = ast.parse(prompt)
    except (SyntaxError, ValueError):
        return "".join(line + "\n" for line in _IMPORT.findall(prompt))
    lines = prompt.splitlines()
    keep = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == entry_point or _is_stub(node):
                continue
        elif not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        keep.append("\n".join(lines[first - 1 : node.end_lineno]))
    return "".join(k + "\n" for k in keep)


def program_parts(
    sample: Sample,
    tests_field: str = "test",
    entry_point_field: str = "entry_point",
    imports_field: str = "prompt",
) -> Program:
    """The row's prompt preamble (:func:`prompt_preamble`: HumanEval's carry ``from
    typing import List`` and sometimes a helper), the response's code, the row's tests
    and entry point. The row is ``meta["row"]``, as every workflow records it."""
    row = sample.meta.get("row") or {}
    if tests_field not in row:
        raise ValueError(
            f"unit_tests needs the tests in the dataset row's field {tests_field!r} "
            f"(set args.tests_field); this row has {sorted(row)}"
        )
    entry = (row.get(entry_point_field) if entry_point_field else None) or ""
    if not (isinstance(entry, str) and (entry == "" or entry.isidentifier())):
        raise ValueError(
            f"unit_tests: the row's {entry_point_field!r} is {entry!r}, not a Python name"
        )
    prompt = row.get(imports_field) if imports_field else None
    preamble = prompt_preamble(prompt, entry) if isinstance(prompt, str) else ""
    return Program(preamble, extract_code(sample.response), str(row[tests_field]), entry)


@register_reward("unit_tests", batched=True)
def unit_tests(
    samples: list[Sample],
    tests_field: Annotated[str, "dataset row field holding the tests"] = "test",
    entry_point_field: Annotated[
        str, "row field naming the function to check(); empty: the tests are plain asserts"
    ] = "entry_point",
    imports_field: Annotated[str, "row field whose import lines go first (the prompt)"] = (
        "prompt"
    ),
    cpu_seconds: Annotated[float, "CPU seconds each program may use"] = 5.0,
    wall_seconds: Annotated[float, "wall seconds each program may take"] = 10.0,
    memory_mb: Annotated[int, "address space of each program's processes, MiB"] = 512,
    run_memory_mb: Annotated[
        int, "memory each program's run holds in all (every process, shared memory), MiB"
    ] = 1024,
    workers: Annotated[int, "programs run at once"] = 8,
) -> list[float | Exception]:
    """1.0 when the row's tests pass against the response's code, else 0.0.

    The tests run in a checker process of their own (``Sandbox.run_tests``); the code
    runs in another and only answers calls: its results reach the asserts as plain data
    (None, bool, numbers, str, bytes and lists, tuples, dicts, sets of them; anything
    else fails the call), so an object whose ``__eq__`` is always true, patched builtins,
    forged status lines, exits of any kind and reading its own files cannot pass. Passing
    is said by the checker alone. Failing asserts, exceptions, time-outs, memory past
    the run's budget and forbidden operations score 0; so do a missing entry point (a
    builtin of its name never stands in), a NaN in any comparison of the checks, and a
    value of the code's that cannot be sent back to it.

    A row the sandbox could not run, or whose tests cannot run as written (an argument
    that is not plain data), gets an exception in its place (that row alone is invalid,
    not scored 0); when no row could run, this raises: not the model's fault, and the
    message says why."""
    programs = [program_parts(s, tests_field, entry_point_field, imports_field) for s in samples]
    box = Sandbox(
        SandboxLimits(
            cpu_seconds=cpu_seconds,
            wall_seconds=wall_seconds,
            memory_mb=memory_mb,
            run_memory_mb=run_memory_mb,
        )
    )

    def run(p: Program):
        return box.run_tests(p.code, p.checks, entry_point=p.entry_point, preamble=p.preamble)

    with ThreadPoolExecutor(max(1, min(workers, len(programs)))) as pool:
        results = list(pool.map(run, programs))
    out: list[float | Exception] = []
    for s, r in zip(samples, results, strict=True):
        if r.error == "sandbox":
            out.append(
                RuntimeError(
                    f"unit_tests: the sandbox could not run row {s.index}'s program "
                    f"({'; '.join(r.notes) or (r.stderr or r.checks)[-300:].strip()})"
                )
            )
        elif r.error == "harness":
            out.append(
                ValueError(
                    f"unit_tests: row {s.index}'s tests (field {tests_field!r}) cannot run "
                    f"against the code as written: {r.harness[0]}; pass only plain data "
                    "(None, bool, numbers, str, bytes, lists, tuples, dicts, sets)"
                )
            )
        else:
            out.append(1.0 if r.completed and r.ok else 0.0)
    if out and all(isinstance(v, Exception) for v in out):
        raise out[0]
    return out
