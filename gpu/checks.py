"""The steps of ``gpu/run.sh``: each one check, its figures written as JSON.

``python gpu/checks.py STEP --work DIR`` runs one step and writes ``DIR/steps/STEP.json``
(``{"figures": {...}}``); its exit code is the step's status (0 ok, 3 skipped: the kit or
the device lacks what it needs, anything else failed). ``run.sh`` times each step under its
own limit and records the exit code; ``report`` merges everything into one JSON and
prints a table. ``POLYRL_TEST_DEVICE=cpu`` runs every step at tiny sizes on the CPU.

Steps: ``env`` (versions, device, kit), ``pytest`` (``pytest -m gpu``), ``bench`` (
``benchmarks/grpo_vs_trl.py`` at one size against TRL: s/step, tokens/s, MFU), ``memory``
(peak device memory of PolyRL's GRPO step at Qwen2.5-0.5B's shape), ``arithmetic`` (the
README demo in bf16: held-out accuracy after SFT and after GRPO), ``multi_lora``
(``benchmarks/multi_lora.py``: LoRA agents on one base, batched update and merged rollout
against one-by-one), ``diffusion`` (the colour demo, when the kit carries diffusers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("POLYRL_TEST_DEVICE", "cuda")
GPU = DEVICE.startswith("cuda")
OK, FAILED, SKIPPED = 0, 1, 3
# Sizes per device: the GPU's, and the CPU's tiny stand-ins (the same code paths).
BENCH = {"bench_20m": "20M" if GPU else "0.3M", "bench_05b": "0.5B" if GPU else "0.3M"}
MEMORY_SIZE = "0.5B" if GPU else "0.3M"
# multi_lora: the base, the agent count every run has and the one added while the step's
# time limit allows, and two per-agent records: the benchmark's default (4 prompts x 4 x 16
# tokens, one pass per agent) and examples/gsm8k_debate_qwen2.5.yaml's rows per agent (64)
# and micro-batch (8), responses cut to 64 tokens: eight small passes per agent, where a
# GPU pays each pass's weight reads and launches. Sized for ~60 s on an H200: the update
# at 20M is launch-bound there (3.7k tokens take ~0.5 TFLOP), so each run's ~20-25 s is
# mostly its three processes starting (torch, CUDA, eight adapters on the base).
ML_SIZE = "20M" if GPU else "0.3M"
ML_AGENTS, ML_AGENTS_IF_TIME = (8, 2) if GPU else (3, 2)
ML_PLANS = {
    "default": (4, 4, 16, 32) if GPU else (1, 2, 8, 4),
    "debate_batch": (8, 8, 64, 8) if GPU else (2, 2, 8, 2),
}  # prompts per agent, responses per prompt, response tokens, micro_batch_size


def _finite(x):
    """``x`` with NaN and infinities as None: the JSON stays strict JSON."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _write(work: Path, step: str, figures: dict) -> None:
    (work / "steps").mkdir(parents=True, exist_ok=True)
    path = work / "steps" / f"{step}.json"
    path.write_text(json.dumps({"figures": _finite(figures)}, indent=2, default=str))


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _kit_manifest() -> dict:
    kit = Path(os.environ.get("POLYRL_KIT_DIR", ROOT / "gpu" / "kit"))
    try:
        return json.loads((kit / "manifest.json").read_text())
    except OSError:
        return {}


# ------------------------------------------------------------------------------ steps


def step_env(work: Path, args) -> int:
    """Versions, the device, what the kit carries and which optional modules import."""
    import platform

    import torch
    import transformers

    figures: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": DEVICE,
        "cuda_available": torch.cuda.is_available(),
        "kit": _kit_manifest(),
        "modules": {
            m: _has(m)
            for m in ("verl", "tensordict", "trl", "datasets", "diffusers", "ray", "vllm")
        },
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        figures.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            cuda=torch.version.cuda,
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    import polyrl
    from polyrl.core.train.algorithms import _verl

    _verl()  # verl imports without Ray (gpu/polyrl_kit_noray.py)
    figures["polyrl"] = polyrl.__version__
    _write(work, "env", figures)
    print(json.dumps(figures, indent=2, default=str))
    if GPU and not torch.cuda.is_available():
        print("FAILED: POLYRL_TEST_DEVICE is cuda but torch sees no GPU", file=sys.stderr)
        return FAILED
    return OK


def step_pytest(work: Path, args) -> int:
    """``pytest -m gpu``: each test's outcome and seconds, and the figures the tests print."""
    import xml.etree.ElementTree as ET

    xml = work / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/core/test_gpu.py", "-s", "-q"]
    cmd += ["-p", "no:cacheprovider", f"--junitxml={xml}", f"--basetemp={work / 'pytest-tmp'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout + proc.stderr)
    tests: dict = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = tag if tag != "failure" else "failed"
                    msg = (el.get("message") or "").splitlines()
                    tests[case.get("name")] = {
                        "outcome": outcome,
                        "why": msg[0][:200] if msg else "",
                    }
                    break
            tests.setdefault(case.get("name"), {"outcome": outcome})
            tests[case.get("name")]["seconds"] = round(float(case.get("time", 0)), 2)
    # what the tests print, after pytest's progress marks on the same line
    printed = re.findall(r"(?:float32|bfloat16|FSDP2) on .*", proc.stdout)
    counts = {
        k: sum(t["outcome"] == k for t in tests.values())
        for k in ("passed", "failed", "error", "skipped")
    }
    _write(
        work,
        "pytest",
        {"counts": counts, "tests": tests, "printed": printed, "rc": proc.returncode},
    )
    return OK if proc.returncode == 0 and counts["passed"] else FAILED


def step_bench(work: Path, args) -> int:
    """``grpo_vs_trl.py`` at one size: each contender's median s/step, tokens/s and MFU."""
    size = BENCH[args.name]
    out = work / f"{args.name}.json"
    steps = ["--warmup", "1", "--steps", "3" if GPU else "2"]
    cmd = [sys.executable, "benchmarks/grpo_vs_trl.py", "--device", "cuda" if GPU else "cpu"]
    cmd += ["--sizes", size, *steps, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout + proc.stderr)
    if not out.is_file():
        _write(work, args.name, {"size": size, "rc": proc.returncode})
        return FAILED
    res = json.loads(out.read_text())
    got = res["sizes"][size]
    figures: dict = {
        "size": size,
        "params": got["params"],
        "dtype": res.get("dtype"),
        "peak_tflops": res.get("peak_tflops"),
        "peak_source": res.get("peak_source"),
    }
    status = OK
    for name, r in got["results"].items():
        if not isinstance(r, dict):  # the ratio, below
            continue
        key = "trl" if name.startswith("TRL") else "polyrl_vllm" if "vLLM" in name else "polyrl_hf"
        if "error" in r:
            err = str(r["error"]).strip().splitlines()[-1][:200]
            if key == "trl" and not _has("trl"):
                err = "not measured: TRL is not in the kit (gpu/make_kit.sh left it out)"
            elif key == "polyrl_vllm":
                err = "not measured: vLLM does not fit the kit"
            elif key in ("trl", "polyrl_hf"):
                status = FAILED
            figures[key] = {"error": err}
            continue
        figures[key] = {
            k: r.get(k)
            for k in ("median_s", "tokens_per_s", "mfu", "rollout_s", "update_s", "mean_len")
            if k in r
        }
    ratio = got["results"].get("ratio_trl_over_polyrl_best")
    if ratio is not None:
        figures["trl_s_over_polyrl_s"] = ratio
    _write(work, args.name, figures)
    return status if proc.returncode == 0 else FAILED


def step_memory(work: Path, args) -> int:
    """Peak device memory of PolyRL's GRPO step (the benchmark's: 16 prompts x 8, 64 new
    tokens, AdamW, bf16 on a GPU) at Qwen2.5-0.5B's shape; peak RSS on the CPU."""
    import resource

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _common as c
    from _contenders import PolyRLStepper

    model = c.build_model(MEMORY_SIZE)
    dtype = "bfloat16" if GPU else "float32"
    if GPU:
        torch.cuda.reset_peak_memory_stats()
    stepper = PolyRLStepper(model, "hf", device=DEVICE, dtype=dtype)
    setup = torch.cuda.max_memory_allocated() if GPU else 0
    times = [stepper.step()["step_s"] for _ in range(3)]
    figures: dict = {"size": MEMORY_SIZE, "params": c.param_count(model), "dtype": dtype}
    figures["step_s"] = times
    if GPU:
        figures.update(
            peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            after_setup_gib=setup / 2**30,
        )
    figures["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    stepper.close()
    _write(work, "memory", figures)
    print(json.dumps(figures, indent=2))
    return OK


def _overrides(work: Path, name: str) -> list[str]:
    return [
        f"run.dir={work / 'runs' / name}",
        "run.progress=false",
        "run.loggers=[]",  # the kit carries no tensorboard
        "run.export=false",
        "run.save_every=0",
        f"policies.main.device={DEVICE}",
    ]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_arithmetic(work: Path, args) -> int:
    """The README demo (SFT warm start, then GRPO) in bf16: held-out accuracy after SFT,
    before any GRPO step, and after the last."""
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    recipe = ROOT / "core" / "recipes" / "arithmetic_grpo.yaml"
    over = _overrides(work, "arithmetic") + [
        "policies.main.dtype=bfloat16",
        f"policies.main.model={work / 'models' / 'tiny-arith'}",
        "eval.every=0",
    ]
    if not GPU:  # the same recipe, far fewer steps
        over += ["sft.steps=30", "train.steps=3", "task.args.n_eval=24"]
    cfg = load(Config, recipe, over)
    t0 = time.perf_counter()
    run = train(cfg)
    seconds = time.perf_counter() - t0
    rows = _metrics(run.path)
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    figures = {
        "dtype": "bfloat16",
        "sft_steps": cfg.sft.steps,
        "grpo_steps": cfg.train.steps,
        "held_out_prompts": getattr(cfg.task.args, "n_eval", None),
        "accuracy_after_sft": evals[0],
        "accuracy_after_grpo": evals[-1],
        "gain": evals[-1] - evals[0],
        "median_grpo_step_s": statistics.median(steps) if steps else None,
        "run_s": seconds,
    }
    for key in ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/mfu"):
        got = [r[key] for r in rows if r.get(key) is not None]  # the run's own figures
        figures["median_" + key.split("/")[1]] = statistics.median(got) if got else None
    _write(work, "arithmetic", figures)
    print(json.dumps(figures, indent=2))
    return OK if len(evals) >= 2 else FAILED


def step_diffusion(work: Path, args) -> int:
    """The diffusion colour demo (tiny SD3, Flow-GRPO, LoRA): eval colour accuracy and the
    training reward before and after."""
    if not (_has("diffusers") and _has("PIL")):
        _write(work, "diffusion", {"why": "diffusers/pillow not in the kit (did not fit)"})
        print("skipped: the kit carries no diffusers (gpu/make_kit.sh left it out)")
        return SKIPPED
    import polyrl.diffusion  # noqa: F401  (registers the colour task, rewards, engine)
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    over = _overrides(work, "diffusion") + [
        f"policies.main.model={work / 'models' / 'tiny-sd3-colour'}",
        "run.samples_per_step=0",
    ]
    if not GPU:
        over += ["policies.main.build_args.pretrain_steps=60", "train.steps=3", "eval.every=0"]
    cfg = load(Config, ROOT / "examples" / "diffusion_colour_grpo.yaml", over)
    t0 = time.perf_counter()
    run = train(cfg)
    seconds = time.perf_counter() - t0
    rows = _metrics(run.path)
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    k = min(3, len(rewards))
    figures = {
        "grpo_steps": cfg.train.steps,
        "eval_colour_accuracy_before": evals[0] if evals else None,
        "eval_colour_accuracy_after": evals[-1] if evals else None,
        "reward_first_steps": sum(rewards[:k]) / k if k else None,
        "reward_last_steps": sum(rewards[-k:]) / k if k else None,
        "run_s": seconds,
    }
    _write(work, "diffusion", figures)
    print(json.dumps(figures, indent=2))
    return OK if rewards else FAILED


def _multi_lora_figures(res: dict, figures: dict, plan: str) -> None:
    """Fold one ``multi_lora.py --json`` result into the step's figures, by plan and agent
    count: the update's median seconds one-by-one and batched and their ratio; the HF
    engine's one call per agent against one merged call."""
    upd = figures["update"].setdefault(plan, {"plan": dict(res["update"]["plan"]), "agents": {}})
    upd["plan"]["micro_batch_size"] = ML_PLANS[plan][3]
    for agents, r in res["update"]["agents"].items():
        one, both = r["contenders"]["one-by-one"], r["contenders"]["batched"]
        upd["agents"][str(agents)] = {
            "rows": r["rows"],
            "tokens": r["tokens"],
            "one_by_one_s": one["wall_s"],
            "batched_s": both["wall_s"],
            "ratio": r["ratio"]["wall_s"],
            "one_by_one_cpu_s": one["cpu_s"],
            "batched_cpu_s": both["cpu_s"],
            **{
                f"{k}_peak_gib": c["peak_gib"]
                for k, c in (("one_by_one", one), ("batched", both))
                if "peak_gib" in c
            },
        }
    for key, r in (res.get("rollout") or {}).items():
        engine, agents = key.split("/")
        out = figures.setdefault(f"rollout_{engine}", {"plan": dict(res["update"]["plan"])})
        out.setdefault("agents", {})[agents] = {
            "one_call_per_agent_s": r["apart_s"],
            "merged_s": r["merged_s"],
            "ratio": r["ratio"],
        }


def step_multi_lora(work: Path, args) -> int:
    """``benchmarks/multi_lora.py``: LoRA agents on one base, the update batched against
    one-by-one at two per-agent sizes and the HF engine's merged rollout against one call
    per agent. Runs in order of importance, each written as it ends (a cut run keeps the
    others); the smaller agent count only while ``POLYRL_STEP_LIMIT_S`` (run.sh's limit
    for the step) leaves the time the larger count's run took."""
    t0 = time.monotonic()
    limit = float(os.environ.get("POLYRL_STEP_LIMIT_S") or 0) or None
    dtype = "bfloat16" if GPU else "float32"
    figures: dict = {"size": ML_SIZE, "dtype": dtype, "warmup": 1, "steps": 2}
    figures.update(update={}, runs={})
    runs = [  # plan, agents, engines of the rollout section, only if time allows
        ("debate_batch", ML_AGENTS, [], False),
        ("default", ML_AGENTS, ["hf"], False),
        ("default", ML_AGENTS_IF_TIME, ["hf"], True),
    ]
    status, took = OK, 0.0
    for plan, agents, engines, optional in runs:
        name = f"{plan}/{agents}"
        left = None if limit is None else limit - (time.monotonic() - t0) - 3
        if optional and left is not None and left < took:
            figures["runs"][name] = {
                "skipped": f"{left:.0f} s left, the last run took {took:.0f} s"
            }
            _write(work, "multi_lora", figures)
            continue
        prompts, n, tokens, mbs = ML_PLANS[plan]
        out = work / f"multi_lora_{plan}_{agents}.json"
        cmd = [sys.executable, "benchmarks/multi_lora.py", "--size", ML_SIZE]
        cmd += ["--device", "cuda" if GPU else "cpu", "--dtype", dtype, "--agents", str(agents)]
        cmd += ["--prompts", str(prompts), "--n", str(n), "--max-new-tokens", str(tokens)]
        cmd += ["--micro-batch-size", str(mbs), "--warmup", "1", "--steps", "2"]
        cmd += ["--rollout-engines", *engines, "--json", str(out)]
        print("$ " + " ".join(cmd[1:]), flush=True)
        log = work / f"multi_lora_{plan}_{agents}.log"
        s0 = time.monotonic()
        with log.open("w") as f:
            try:
                rc = subprocess.run(
                    cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=left
                ).returncode
            except subprocess.TimeoutExpired:  # its workers exit when their stdin closes
                rc = 124
        took = time.monotonic() - s0
        print(log.read_text(errors="replace"), flush=True)
        run: dict = {"rc": rc, "seconds": round(took, 1)}
        if rc == 0 and out.is_file():
            _multi_lora_figures(json.loads(out.read_text()), figures, plan)
        else:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            run["error"] = "cut at the step's time limit" if rc == 124 else tail[0][:200]
            status = 124 if rc == 124 else FAILED
        figures["runs"][name] = run
        _write(work, "multi_lora", figures)
        if rc == 124:
            break
    print(json.dumps(figures, indent=2))
    return status


# ------------------------------------------------------------------------------ report

STATUS = {0: "ok", 3: "skipped", 124: "timeout", 137: "timeout"}


def _summary(name: str, f: dict) -> str:
    """One line of a step's figures for the table."""

    def num(x, fmt="{:.3g}"):
        return "n/a" if x is None or x != x else fmt.format(x)

    if name == "env":
        return f"{f.get('gpu', f.get('device'))}; torch {f.get('torch')}, transformers {f.get('transformers')}"
    if name == "pytest":
        c = f.get("counts", {})
        return f"{c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('error', 0)} failed, {c.get('skipped', 0)} skipped"
    if name.startswith("bench"):
        p, t = f.get("polyrl_hf", {}), f.get("trl", {})
        line = (
            f"{f.get('size')}: PolyRL {num(p.get('median_s'))} s/step, "
            f"{num(p.get('tokens_per_s'), '{:.0f}')} tok/s, MFU {num(p.get('mfu'), '{:.1%}')}"
        )
        if "median_s" in t:
            line += (
                f"; TRL {num(t.get('median_s'))} s/step, MFU {num(t.get('mfu'), '{:.1%}')}"
                f"; TRL/PolyRL {num(f.get('trl_s_over_polyrl_s'), '{:.2f}')}x"
            )
        elif "error" in t:
            line += f"; TRL: {t['error'][:60]}"
        return line
    if name == "memory":
        if "peak_allocated_gib" in f:
            return f"{f.get('size')}: peak allocated {num(f['peak_allocated_gib'])} GiB, reserved {num(f.get('peak_reserved_gib'))} GiB"
        return f"{f.get('size')}: peak RSS {num(f.get('peak_rss_gib'))} GiB"
    if name == "arithmetic":
        return (
            f"held-out accuracy {num(f.get('accuracy_after_sft'))} after SFT -> "
            f"{num(f.get('accuracy_after_grpo'))} after {f.get('grpo_steps')} GRPO steps"
        )
    if name == "multi_lora":
        upd, ro = f.get("update", {}), f.get("rollout_hf", {}).get("agents", {})
        counts = {a for u in upd.values() for a in u["agents"]} | set(ro)
        parts = []
        for a in sorted(counts, key=int, reverse=True):
            big = upd.get("debate_batch", {}).get("agents", {}).get(a)
            small = upd.get("default", {}).get("agents", {}).get(a)
            got = []
            if big:
                got.append(
                    f"update {num(big['ratio'], '{:.2f}x')} "
                    f"({num(big['one_by_one_s'])} -> {num(big['batched_s'])} s)"
                )
            if small:
                got.append(f"small update {num(small['ratio'], '{:.2f}x')}")
            if a in ro:
                got.append(f"HF rollout {num(ro[a]['ratio'], '{:.2f}x')}")
            parts.append(f"{a} agents: " + ", ".join(got))
        head = f"{f.get('size')} {f.get('dtype')}, one-by-one/batched"
        return "; ".join([head, *parts]) if parts else head + ": no run finished"
    if name == "diffusion":
        if "why" in f:
            return f["why"]
        return (
            f"colour accuracy {num(f.get('eval_colour_accuracy_before'))} -> "
            f"{num(f.get('eval_colour_accuracy_after'))}; reward "
            f"{num(f.get('reward_first_steps'))} -> {num(f.get('reward_last_steps'))}"
        )
    return ""


def report(work: Path, out: Path, order: list[str]) -> int:
    """Merge the steps into ``out/gpu_checks.json`` and print the table."""
    checks: dict = {}
    for name in order:
        st = work / "steps" / f"{name}.status"
        if not st.is_file():
            checks[name] = {"status": "not run", "seconds": 0.0, "figures": {}}
            continue
        s = json.loads(st.read_text())
        status = s.get("status") or STATUS.get(s["rc"], "failed")
        fig = work / "steps" / f"{name}.json"
        figures = json.loads(fig.read_text())["figures"] if fig.is_file() else {}
        entry = {"status": status, "seconds": s.get("seconds", 0.0), "figures": figures}
        entry["limit_s"] = s.get("limit_s")
        if status not in ("ok", "skipped"):
            log = work / "steps" / f"{name}.log"
            tail = (
                log.read_text(errors="replace").strip().splitlines()[-15:] if log.is_file() else []
            )
            entry["error"] = s.get("why") or (
                f"exit code {s['rc']}" + (" (step time limit)" if status == "timeout" else "")
            )
            entry["log_tail"] = tail
        elif s.get("why"):
            entry["why"] = s["why"]
        checks[name] = entry
    total = sum(c["seconds"] for c in checks.values())
    result = {
        "device": DEVICE,
        "started": os.environ.get("POLYRL_GPU_STARTED"),
        "total_s": round(total, 1),
        "ok": all(c["status"] in ("ok", "skipped") for c in checks.values()),
        "checks": checks,
    }
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(result), indent=2, default=str, allow_nan=False)
    (out / "gpu_checks.json").write_text(text + "\n")
    w = max(len(n) for n in checks)
    print(f"\nPolyRL GPU checks on {DEVICE} ({out / 'gpu_checks.json'}):\n")
    print(f"  {'check':<{w}}  {'status':<8} {'seconds':>7}  figures")
    print(f"  {'-' * w}  {'-' * 8} {'-' * 7}  {'-' * 40}")
    for name, c in checks.items():
        line = _summary(name, c["figures"]) if c["figures"] else c.get("why", c.get("error", ""))
        print(f"  {name:<{w}}  {c['status']:<8} {c['seconds']:>7.1f}  {line}")
    print(
        f"\n  total {total:.0f} s; " + ("all checks ok" if result["ok"] else "SOME CHECKS FAILED")
    )
    return 0 if result["ok"] else 1


STEPS = {
    "env": step_env,
    "pytest": step_pytest,
    "bench_20m": step_bench,
    "bench_05b": step_bench,
    "memory": step_memory,
    "arithmetic": step_arithmetic,
    "multi_lora": step_multi_lora,
    "diffusion": step_diffusion,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", choices=[*STEPS, "report"])
    p.add_argument("--work", required=True, type=Path, help="the runner's scratch folder")
    p.add_argument("--out", type=Path, help="report: where gpu_checks.json goes")
    p.add_argument("--order", nargs="*", default=list(STEPS), help="report: the steps, in order")
    args = p.parse_args(argv)
    if args.name == "report":
        return report(args.work, args.out or args.work, ["setup", *args.order])
    return STEPS[args.name](args.work, args)


if __name__ == "__main__":
    sys.exit(main())
