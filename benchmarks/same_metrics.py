"""Behaviour unchanged across a refactor: every CPU demo's metrics at one seed, diffed.

    python benchmarks/same_metrics.py run OUT [--steps 10] [--only arithmetic_grpo ...]
    python benchmarks/same_metrics.py diff OLD NEW [--rtol 1e-5]

``run`` trains each CPU demo recipe of ``examples/`` (tiny models built offline into a
private ``HOME`` under ``OUT``, so each tree builds its own) for ``--steps`` RL steps at
seed 0 and keeps ``OUT/<recipe>/metrics.jsonl``. Run it from two ``git archive`` snapshots
(before and after a change), then ``diff`` the two folders: every metric of every line must
match within ``--rtol``/``--atol``, except wall-clock ones (``time``, ``time/*``, ``*_s`` seconds and ``perf/*`` rates),
and both runs must log the same keys. Prints one line per recipe and exits 1 on any
difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The recipes that build their models offline and train on CPU (the README's demo table
# and the agents/gateway demos); the others name hub models and need GPUs.
DEMOS = (
    "arithmetic_grpo",
    "signaling_magrpo",
    "signaling_shared",
    "signaling_lora",
    "gridworld_gigpo",
    "countdown_multi_turn",
    "gateway_calculator",
    "gateway_two_models",
    "vl_shapes_grpo",
    "vl_shapes_grounding",
    "vl_team_colour",
    "vl_zoom",
    "diffusion_colour_grpo",
    "diffusion_colour_nft",
    "diffusion_colour_hacking",
    "diffusion_wan_colour_video",
    "paint_team",
)


def wall_clock(key: str) -> bool:
    """A metric that differs between equal runs because it measures time."""
    if key == "time" or key.startswith("time/") or key.endswith("_s"):  # seconds
        return True
    return key.startswith("perf/") and not key.endswith("_tokens")


def run(out: Path, steps: int, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(out / "home"), "TOKENIZERS_PARALLELISM": "false"}
    failed = 0
    for name in only or DEMOS:
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [
            str(ROOT / ".venv/bin/polyrl"),
            "train",
            str(ROOT / "examples" / f"{name}.yaml"),
            "seed=0",
            f"train.steps={steps}",
            f"run.dir={run_dir}",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        took = time.perf_counter() - t0
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        failed += proc.returncode != 0
        print(f"{name:28s} {status:8s} {took:6.0f} s", flush=True)
    return 1 if failed else 0


def _close(a, b, rtol: float, atol: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    return a == b


def diff_one(old: Path, new: Path, rtol: float, atol: float) -> list[str]:
    """The differences between two metrics.jsonl files, one line each (empty: the same)."""
    a = [json.loads(line) for line in old.read_text().splitlines() if line.strip()]
    b = [json.loads(line) for line in new.read_text().splitlines() if line.strip()]
    if len(a) != len(b):
        return [f"{len(a)} lines vs {len(b)}"]
    out = []
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
        ka = {k for k in ra if not wall_clock(k)}
        kb = {k for k in rb if not wall_clock(k)}
        if ka != kb:
            out.append(f"line {i}: keys only old {sorted(ka - kb)}, only new {sorted(kb - ka)}")
        for k in sorted(ka & kb):
            if not _close(ra[k], rb[k], rtol, atol):
                out.append(f"line {i} {k}: {ra[k]!r} vs {rb[k]!r}")
    return out


def diff(old: Path, new: Path, rtol: float, atol: float) -> int:
    bad = 0
    names = sorted(p.name for p in old.iterdir() if (p / "metrics.jsonl").exists())
    for name in names:
        b = new / name / "metrics.jsonl"
        if not b.exists():
            print(f"{name:28s} MISSING in {new}")
            bad += 1
            continue
        problems = diff_one(old / name / "metrics.jsonl", b, rtol, atol)
        lines = len((old / name / "metrics.jsonl").read_text().splitlines())
        print(f"{name:28s} {'same' if not problems else 'DIFFERS'} ({lines} lines)")
        for p in problems[:8]:
            print(f"    {p}")
        bad += bool(problems)
    print(f"{len(names) - bad}/{len(names)} recipes log the same metrics")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--only", nargs="*", default=[])
    d = sub.add_parser("diff")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    d.add_argument("--rtol", type=float, default=1e-5)
    d.add_argument("--atol", type=float, default=1e-6)
    a = p.parse_args()
    if a.cmd == "run":
        return run(a.out, a.steps, a.only)
    return diff(a.old, a.new, a.rtol, a.atol)


if __name__ == "__main__":
    sys.exit(main())
