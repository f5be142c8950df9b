"""PolyRL (HF engine), PolyRL (vLLM engine) and TRL's GRPOTrainer: seconds per GRPO step.

Same model, same prompts in the same order (core/tasks/arithmetic, chat-templated), same
reward function (_common.digit_share, which varies within every group, so every update
does its full work), group size 8, 16 prompts per step, 64 new tokens for every response (the benchmark models never emit EOS/PAD: see
benchmarks/_common.py:forbid_tokens), temperature 1, top-p 1, lr 1e-6, grad-norm clip 1,
one forward/backward over all 128 rows per update (PolyRL micro_batch_size=128; TRL
per_device_train_batch_size=128, gradient_accumulation_steps=1), no reference model
(kl_coef=0 / beta=0), one update per rollout (ppo_epochs=1 / num_iterations=1), fp32.
TRL: no vLLM, use_cpu, gradient checkpointing off like PolyRL (TRL's own default is on;
--trl-gradient-checkpointing adds a contender with it).

A PolyRL step is what core/loop.py runs: SingleTurn rollout -> rewards.score ->
credit.assign -> trainer.update -> engine.sync. A TRL step is one optimizer step of
``trainer.train()`` (generation, reward, loss, backward, optimizer), from its
``on_step_begin`` to its ``on_step_end``. Steps of all contenders are interleaved
round-robin; the median over the timed steps after warm-up is reported.

    .venv/bin/python benchmarks/grpo_vs_trl.py [--quick] [--sizes 0.3M 20M] [--threads N]
        [--workload uniform realistic equal] [--device cuda [--peak-tflops X]]

On a GPU (``--device cuda``: bf16, sizes 20M and Qwen2.5-0.5B's shape by default) the
uniform table adds MFU, model FLOPs utilization: the step's model FLOPs, 8 x parameters x
tokens (a forward over every prompt and response token to sample them, a forward and a
backward, 6 x, to train on them; attention's own FLOPs left out, as is usual), divided
by the step's seconds and the device's dense peak (``PEAK_TFLOPS``, or ``--peak-tflops``).
Both contenders do the same model work, so their MFUs stand in the inverse ratio of their
step times; MFU says how far both are from what the device could do.

``--workload`` (default ``uniform``: the comparison above) adds two more, each printed
as its own table with its ratios and limits:

- ``realistic``: responses of widely varying length (80% of rows stop within 4 tokens,
  20% run to the limit: the stop plans of ``variable_lengths.py``), a reward under which
  ~45% of groups agree (``_contenders.agree_reward``: every sample of those prompts gets
  0, as an untrained model's math answers would), PolyRL at its defaults and TRL at its
  documented defaults (only what defines the workload is set). Target: TRL / PolyRL >= 2.
  ``--prefix-off`` adds PolyRL with ``shared_prefix: false`` (the packed pass before
  prefix trees) beside the default.
- ``equal``: the uniform workload with each half of PolyRL's step measured against its
  own limit in the same run: the update against a bare PyTorch forward/backward/AdamW
  step over the same number of tokens (no padding in either: PolyRL packs its rows), the
  rollout against the fastest raw generate loop for the same tokens (transformers'
  ``generate``; raw ``vllm.LLM.generate`` when vLLM imports). Target: >= 0.9 each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _runner as runner  # noqa: E402
from _contenders import AGREE_PERCENT  # noqa: E402

TARGET = 1.5
REALISTIC_TARGET, HALF_TARGET = 2.0, 0.9
HF, VLLM, TRL = "PolyRL (HF engine)", "PolyRL (vLLM engine)", "TRL GRPOTrainer"
HF_OFF = "PolyRL (HF engine, no prefix tree)"
REALISTIC_PLAN = {"long_frac": 0.2, "short_max": 4}
# Dense peak TFLOP/s by GPU name and dtype (vendor data sheets, SXM unless named; bf16 on
# the tensor cores, float32 without TF32, as PyTorch's default matmul runs). First match wins.
PEAK_TFLOPS = [
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 51.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float32": 60.0}),
    ("H100", {"bfloat16": 989.0, "float32": 67.0}),
    ("H200", {"bfloat16": 989.0, "float32": 67.0}),
    ("A100", {"bfloat16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float32": 91.6}),
]


def peak_tflops(device: str, dtype: str, requested: float | None) -> tuple[float | None, str]:
    """The device's dense peak for ``dtype`` and where the number comes from."""
    if requested:
        return requested, "--peak-tflops"
    if device != "cuda":
        return None, "no peak known for a CPU (give --peak-tflops)"
    import torch

    name = torch.cuda.get_device_name(0)
    for key, peaks in PEAK_TFLOPS:
        if key in name and dtype in peaks:
            return peaks[dtype], f"{name}, {dtype} data-sheet peak"
    return None, f"{name}: not in PEAK_TFLOPS (give --peak-tflops)"


def _summaries(remotes, timed) -> dict:
    """Each contender's median step and the medians of what its steps report."""
    res: dict = {}
    for name, r in remotes.items():
        recs = timed[name].get("default", [])
        if r.error or not recs:
            res[name] = {"error": (r.error or "no steps").strip().splitlines()[-1][:80]}
            continue
        s = c.summarize([x["step_s"] for x in recs])
        keys = {k for x in recs for k in x if k != "step_s"}
        s.update({k: c.median_of(recs, k) for k in keys})
        res[name] = s
    return res


def _mean_prompt_tokens(model: str, prompts: int) -> int:
    """Mean chat-templated prompt length of the first ``prompts`` rows PolyRL samples."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = c.read_rows(c.data_file())[:prompts]
    lens = [
        len(
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}],
                    tokenize=False,
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )
        )
        for r in rows
    ]
    return round(sum(lens) / len(lens))


def realistic(args, sizes, threads, warmup, steps, ok) -> dict:
    """Varying lengths, agreeing groups, TRL at its defaults: seconds per step."""
    T, out, rows, lines = args.max_new_tokens, {}, [], []
    for size in sizes:
        model = c.build_model(size)
        common = dict(n=8, prompts=16, max_new_tokens=T, reward="agree")
        plan = {"stop_plan_args": REALISTIC_PLAN}
        specs = {HF: ("polyrl", dict(model=model, engine="hf", **common, **plan))}
        if args.prefix_off:  # the packed pass before prefix trees, beside today's (issue 30)
            specs[HF_OFF] = (
                "polyrl",
                dict(model=model, engine="hf", shared_prefix=False, **common, **plan),
            )
        if ok:
            vargs = {"max_model_len": 64 + T + 32, "kv_cache_gb": 0.25}
            specs[VLLM] = (
                "polyrl",
                dict(model=model, engine="vllm", engine_args=vargs, **common, **plan),
            )
        specs[TRL + " (defaults)"] = (
            "trl",
            dict(model=model, total_steps=warmup + steps, trl_defaults=True, **common, **plan),
        )
        print(f"\n[realistic, {size}] starting contenders ...", file=sys.stderr, flush=True)
        remotes = runner.start_all(specs, threads=threads, isolate=not args.in_process)
        timed = runner.interleave(remotes, warmup=warmup, steps=steps)
        runner.close_all(remotes)
        res = _summaries(remotes, timed)
        for name, r in res.items():
            rows.append(
                [size, name]
                + [r.get(k, float("nan")) for k in ("median_s", "rollout_s", "update_s")]
                + [r.get(k, float("nan")) for k in ("mean_len", "short_frac", "agree_frac")]
                + [r.get("error", "")]
            )
        trl = res[TRL + " (defaults)"].get("median_s")
        polys = {
            k: v["median_s"]
            for k, v in res.items()
            if k.startswith("PolyRL") and k != HF_OFF and "median_s" in v
        }
        off, hf = res.get(HF_OFF, {}), res[HF]
        if "median_s" in off and "median_s" in hf:
            lines.append(
                f"  {size:>5}: no prefix tree / default (HF engine): step "
                f"{off['median_s'] / hf['median_s']:.2f}x, update "
                f"{off['update_s'] / hf['update_s']:.2f}x (>= 1: the default is no slower)"
            )
        if polys:
            best = min(polys, key=polys.get)
            b = res[best]
            if trl:
                ratio = trl / polys[best]
                res["ratio"] = ratio
                lines.append(
                    f"  {size:>5}: TRL (defaults) / {best} = {ratio:.2f}x   target >= "
                    f"{REALISTIC_TARGET}x: {'MET' if ratio >= REALISTIC_TARGET else 'NOT MET'}"
                )
            else:
                lines.append(f"  {size:>5}: TRL not measured ({res[TRL + ' (defaults)']['error']})")
            lines.append(
                f"  {size:>5}: {best}'s step: rollout {b['rollout_s']:.3f} s + update "
                f"{b['update_s']:.3f} s + reward/credit/sync "
                f"{b['median_s'] - b['rollout_s'] - b['update_s']:.3f} s"
            )
        out[size] = res
    print(
        "\nRealistic workload: seconds per GRPO step (16 prompts x 8, 80% of rows stop within "
        f"4 tokens, 20% run to {T}; ~{AGREE_PERCENT}% of groups agree)\n"
    )
    print(
        c.table(
            [
                "size",
                "contender",
                "median s/step",
                "rollout s",
                "update s",
                "resp len",
                "short frac",
                "agree frac",
                "note",
            ],
            rows,
        )
    )
    print("\nRatios, TRL seconds per step / PolyRL seconds per step (higher = PolyRL faster):")
    print("\n".join(lines) if lines else "  (none)")
    return out


def equal(args, sizes, threads, warmup, steps, ok) -> dict:
    """The uniform workload, each half of PolyRL's step against its own limit."""
    T, out, rows, lines = args.max_new_tokens, {}, [], []
    for size in sizes:
        model = c.build_model(size)
        P = _mean_prompt_tokens(model, 16)
        gen = dict(n=8, prompts=16, max_new_tokens=T)
        specs = {HF: ("polyrl", dict(model=model, engine="hf", **gen))}
        raws = ["raw transformers generate"]
        specs[raws[0]] = ("hf_generate", dict(model=model, **gen))
        if ok:
            vargs = {"max_model_len": 64 + T + 32, "kv_cache_gb": 0.25}
            specs[VLLM] = ("polyrl", dict(model=model, engine="vllm", engine_args=vargs, **gen))
            raws.append("raw vllm.LLM.generate")
            specs[raws[1]] = ("raw_vllm", dict(model=model, **gen, **vargs))
        bare = "bare PyTorch update"
        specs[bare] = (
            "update",
            dict(
                model=model,
                kind="bare",
                rows=128,
                prompt_len=P,
                response_len=T,
                micro_batch_size=128,
            ),
        )
        print(f"\n[equal, {size}] starting contenders ...", file=sys.stderr, flush=True)
        remotes = runner.start_all(specs, threads=threads, isolate=not args.in_process)
        timed = runner.interleave(remotes, warmup=warmup, steps=steps)
        runner.close_all(remotes)
        res = _summaries(remotes, timed)
        if "median_s" in res[bare]:
            res[bare]["tokens"] = 128 * (P + T)
        for name, r in res.items():
            rows.append(
                [
                    size,
                    name,
                    r.get("median_s", float("nan")),
                    r.get("rollout_s", float("nan")),
                    r.get("update_s", float("nan")),
                    r.get("error", ""),
                ]
            )
        raw_tps = {k: res[k]["tokens"] / res[k]["median_s"] for k in raws if "median_s" in res[k]}
        for poly in (HF, VLLM):
            r = res.get(poly, {})
            if "median_s" not in r:
                continue
            if raw_tps:
                fastest = max(raw_tps, key=raw_tps.get)
                ratio = r["tokens"] / r["rollout_s"] / raw_tps[fastest]
                lines.append(
                    f"  {size:>5}: {poly} rollout / {fastest} (fastest raw), tokens/s = "
                    f"{ratio:.2f}   limit >= {HALF_TARGET}: {'MET' if ratio >= HALF_TARGET else 'NOT MET'}"
                )
            if "median_s" in res[bare]:
                mine = (r["prompt_tokens"] + r["tokens"]) / r["update_s"]
                ratio = mine / (res[bare]["tokens"] / res[bare]["median_s"])
                lines.append(
                    f"  {size:>5}: {poly} update / {bare}, tokens/s = {ratio:.2f}   limit >= "
                    f"{HALF_TARGET}: {'MET' if ratio >= HALF_TARGET else 'NOT MET'}"
                )
        out[size] = res
    print(
        f"\nEqual workload: each half against its limit (128 rows x {T} new tokens; bare update "
        "over 128 x (mean prompt + response) tokens)\n"
    )
    print(c.table(["size", "contender", "median s", "rollout s", "update s", "note"], rows))
    print("\nRatios, PolyRL throughput / its limit's (1.00 = at the limit):")
    print("\n".join(lines) if lines else "  (none)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--sizes", nargs="+", default=None, choices=list(c.SIZES))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="also time TRL with its default gradient_checkpointing=True",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="cProfile PolyRL's timed steps into DIR/<size>/profile-*.prof",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s for MFU (default: PEAK_TFLOPS by GPU name)",
    )
    p.add_argument(
        "--workload",
        nargs="+",
        default=["uniform"],
        choices=["uniform", "realistic", "equal"],
        help="uniform: the comparison above; realistic / equal: see the module doc",
    )
    p.add_argument(
        "--prefix-off",
        action="store_true",
        help="realistic: also PolyRL with shared_prefix off (the packed pass before prefix "
        "trees), to show the default is no slower",
    )
    args = p.parse_args()
    threads, why = c.resolve_threads(args.threads)
    gpu = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    sizes = args.sizes or (
        ["20M"]
        if gpu and args.quick
        else ["20M", "0.5B"]
        if gpu
        else ["0.3M"]
        if args.quick
        else ["0.3M", "20M"]
    )
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    isolate = not args.in_process
    T = args.max_new_tokens

    print(
        f"grpo_vs_trl: seconds per GRPO step (16 prompts x 8 samples, {T} new tokens each; "
        f"{args.device}, {dtype})\n"
    )
    info = c.print_machine(threads, why)
    ok, vwhy = c.vllm_status()
    print(f"  {'polyrl vllm engine':>20}: " + ("available" if ok else f"UNAVAILABLE ({vwhy})"))
    peak, peak_why = peak_tflops(args.device, dtype, args.peak_tflops)
    print(f"  {'peak for MFU':>20}: " + (f"{peak:g} TFLOP/s ({peak_why})" if peak else peak_why))
    print(
        f"\n{warmup} warm-up + {steps} timed steps per contender, interleaved round-robin"
        + ("; one process per contender" if isolate else "; in-process")
    )

    results: dict = {
        "machine": info,
        "warmup": warmup,
        "steps": steps,
        "dtype": dtype,
        "peak_tflops": peak,
        "peak_source": peak_why,
        "sizes": {},
    }
    rows, ratio_lines = [], []
    for size in sizes if "uniform" in args.workload else []:
        model = c.build_model(size)
        nparams = c.param_count(model)
        prompt_len = _mean_prompt_tokens(model, 16)
        common = dict(n=8, prompts=16, max_new_tokens=T, device=args.device, dtype=dtype)
        specs = {HF: ("polyrl", dict(model=model, engine="hf", **common))}
        if ok:
            # on a GPU the contenders share it: the vLLM engine takes 30% for weights + cache
            memory = {"gpu_memory_utilization": 0.3} if gpu else {"kv_cache_gb": 0.25}
            specs[VLLM] = (
                "polyrl",
                dict(
                    model=model,
                    engine="vllm",
                    engine_args={"max_model_len": 64 + T + 32, **memory},
                    **common,
                ),
            )
        specs[TRL] = ("trl", dict(model=model, total_steps=warmup + steps, **common))
        if args.trl_gradient_checkpointing:
            specs[TRL + " (grad ckpt)"] = (
                "trl",
                dict(
                    model=model, total_steps=warmup + steps, gradient_checkpointing=True, **common
                ),
            )
        print(
            f"\n[{size}: {c.fmt_params(nparams)} parameters] starting contenders ...",
            file=sys.stderr,
            flush=True,
        )
        remotes = runner.start_all(specs, threads=threads, isolate=isolate)
        prof_dir = None
        if args.profile:
            prof_dir = Path(args.profile) / size
            prof_dir.mkdir(parents=True, exist_ok=True)
        timed = runner.interleave(remotes, warmup=warmup, steps=steps, profile_dir=prof_dir)
        runner.close_all(remotes)

        res: dict = {}
        for name, r in remotes.items():
            recs = timed[name].get("default", [])
            if r.error or not recs:
                res[name] = {"error": r.error or "no steps"}
                rows.append(
                    [size, c.fmt_params(nparams), name]
                    + [float("nan")] * 7
                    + [(r.error or "no steps").splitlines()[-1][:80]]
                )
                continue
            s = c.summarize([x["step_s"] for x in recs])
            s.update(
                {
                    k: c.median_of(recs, k)
                    for k in ("rollout_s", "update_s", "sync_s", "reward_credit_s", "mean_len")
                }
            )
            s["startup"] = r.info
            res[name] = s
            s["tokens_per_s"] = 8 * 16 * s["mean_len"] / s["median_s"]  # sampled, per step
            flops = 8 * nparams * 8 * 16 * (prompt_len + s["mean_len"])  # see the module doc
            s["model_tflop_per_step"] = flops / 1e12
            s["mfu"] = flops / s["median_s"] / (peak * 1e12) if peak else float("nan")
            rows.append(
                [
                    size,
                    c.fmt_params(nparams),
                    name,
                    s["median_s"],
                    s["min_s"],
                    s["tokens_per_s"],
                    s["mfu"],
                    s["rollout_s"],
                    s["update_s"],
                    s["mean_len"],
                    "",
                ]
            )
        if not ok:
            res[VLLM] = {"error": f"unavailable: {vwhy}"}
            rows.append(
                [size, c.fmt_params(nparams), VLLM]
                + [float("nan")] * 7
                + [f"unavailable: {vwhy}"[:80]]
            )
        trl = res[TRL].get("median_s")
        polys = {
            k: v["median_s"] for k, v in res.items() if k.startswith("PolyRL") and "median_s" in v
        }
        if trl and polys:
            best = min(polys, key=polys.get)
            for k, v in polys.items():
                ratio_lines.append(f"  {size:>5}: TRL / {k:<21} = {trl / v:5.2f}x")
            ratio = trl / polys[best]
            res["ratio_trl_over_polyrl_best"] = ratio
            ratio_lines.append(
                f"  {size:>5}: TRL / PolyRL-best ({best}) = {ratio:.2f}x   "
                f"target >= {TARGET}x: {'MET' if ratio >= TARGET else 'NOT MET'}"
            )
            if TRL + " (grad ckpt)" in res and "median_s" in res[TRL + " (grad ckpt)"]:
                g = res[TRL + " (grad ckpt)"]["median_s"] / polys[best]
                ratio_lines.append(
                    f"  {size:>5}: TRL with its default gradient checkpointing / "
                    f"PolyRL-best = {g:.2f}x"
                )
        results["sizes"][size] = {"params": nparams, "prompt_tokens": prompt_len, "results": res}

    for workload in ("realistic", "equal"):
        if workload in args.workload:
            run = realistic if workload == "realistic" else equal
            results[workload] = run(args, sizes, threads, warmup, steps, ok)
    if "uniform" not in args.workload:
        c.write_json(args.json, results)
        return
    print()
    print(
        c.table(
            [
                "size",
                "params",
                "contender",
                "median s/step",
                "min s/step",
                "tokens/s",
                "MFU",
                "rollout s",
                "update s",
                "resp len",
                "note",
            ],
            rows,
        )
    )
    print("\n(tokens/s: response tokens sampled and trained on per second of a whole step)")
    print(
        "(MFU: 8 x parameters x (prompt + response tokens) per step / step seconds / peak "
        + (f"{peak:g} TFLOP/s)" if peak else f"- n/a: {peak_why})")
    )
    print("\n(rollout s / update s: PolyRL's split of its step; TRL does not expose one)")
    print("\nRatios, TRL seconds per step / PolyRL seconds per step (higher = PolyRL faster):")
    print("\n".join(ratio_lines) if ratio_lines else "  (no ratio: a contender failed)")
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
