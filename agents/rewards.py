"""Rewards that read what the environment reported (rows from the multi-turn workflow).

- ``env_return``: the episode's undiscounted sum of environment rewards.
- ``env_success``: 1.0 if the episode succeeded (the env's ``info["success"]``, else
  return > 0), per row.
- ``success_rate``: the same success, weighted so that the *row mean* is the success rate
  over episodes even in ``step`` mode, where long episodes have more rows. Use it with
  weight 0 as a metric (``eval.accuracy_term: success_rate``), not as a training reward.
- ``unit_tests``: 1.0 when the response's Python passes the row's tests, run in the
  sandbox (HumanEval/MBPP-style rows; the marl CoopHumanEval recipe scores two agents'
  joined code with it). Passing is the sandbox's ``completed``: the runner sends the
  run's secret nonce on its own channel only after the last check returned, so an early
  ``sys.exit(0)``/``os._exit(0)``, an exit status or text on stderr never passes.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from polyrl.agents.sandbox import Sandbox, SandboxLimits
from polyrl.core.rewards import Sample, register_reward


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


def program_with_tests(
    sample: Sample,
    tests_field: str = "test",
    entry_point_field: str = "entry_point",
    imports_field: str = "prompt",
) -> str:
    """Imports of the dataset row's prompt (HumanEval's carry ``from typing import List``),
    then the response's code, then the row's tests, then ``check(<entry point>)`` when the
    row names one. The row is ``meta["row"]``, as every workflow records it."""
    row = sample.meta.get("row") or {}
    if tests_field not in row:
        raise ValueError(
            f"unit_tests needs the tests in the dataset row's field {tests_field!r} "
            f"(set args.tests_field); this row has {sorted(row)}"
        )
    parts = []
    prompt = row.get(imports_field) if imports_field else None
    if isinstance(prompt, str):
        parts += _IMPORT.findall(prompt)
    parts += [extract_code(sample.response), str(row[tests_field])]
    entry = row.get(entry_point_field) if entry_point_field else None
    if entry:
        parts.append(f"check({entry})")
    return "\n\n".join(parts) + "\n"


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
    workers: Annotated[int, "programs run at once"] = 8,
) -> list[float | Exception]:
    """1.0 when the program (:func:`program_with_tests`) ran to its last statement -- the
    sandbox's ``completed``, proven by a nonce the tests' runner sends only after the
    checks returned -- and ended cleanly, else 0.0: failing asserts, exceptions, exiting
    early with any status, time-outs and forbidden operations all score 0.

    A row the sandbox could not run gets an exception in its place (that row alone is
    invalid, not scored 0); when it could run none of them, this raises: not the model's
    fault, and the message says why."""
    programs = [
        program_with_tests(s, tests_field, entry_point_field, imports_field) for s in samples
    ]
    box = Sandbox(
        SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb)
    )
    with ThreadPoolExecutor(max(1, min(workers, len(programs)))) as pool:
        results = list(pool.map(box.run, programs))
    out: list[float | Exception] = []
    for s, r in zip(samples, results, strict=True):
        if r.error == "sandbox":
            out.append(
                RuntimeError(
                    f"unit_tests: the sandbox could not run row {s.index}'s program "
                    f"({'; '.join(r.notes) or r.stderr[-300:].strip()})"
                )
            )
        else:
            out.append(1.0 if r.completed and r.ok else 0.0)
    if out and all(isinstance(v, Exception) for v in out):
        raise out[0]
    return out
