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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _runner as runner  # noqa: E402

TARGET = 1.5
HF, VLLM, TRL = "PolyRL (HF engine)", "PolyRL (vLLM engine)", "TRL GRPOTrainer"


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
    print(
        f"\n{warmup} warm-up + {steps} timed steps per contender, interleaved round-robin"
        + ("; one process per contender" if isolate else "; in-process")
    )

    results: dict = {"machine": info, "warmup": warmup, "steps": steps, "sizes": {}}
    rows, ratio_lines = [], []
    for size in sizes:
        model = c.build_model(size)
        nparams = c.param_count(model)
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
                    + [float("nan")] * 6
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
            rows.append(
                [
                    size,
                    c.fmt_params(nparams),
                    name,
                    s["median_s"],
                    s["min_s"],
                    s["tokens_per_s"],
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
                + [float("nan")] * 6
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
        results["sizes"][size] = {"params": nparams, "results": res}

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
                "rollout s",
                "update s",
                "resp len",
                "note",
            ],
            rows,
        )
    )
    print("\n(tokens/s: response tokens sampled and trained on per second of a whole step)")
    print("\n(rollout s / update s: PolyRL's split of its step; TRL does not expose one)")
    print("\nRatios, TRL seconds per step / PolyRL seconds per step (higher = PolyRL faster):")
    print("\n".join(ratio_lines) if ratio_lines else "  (no ratio: a contender failed)")
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
