"""Responses of widely varying length: continuous batching (vLLM) against batch decoding (HF).

The grpo_vs_trl setup (16 prompts x 8 samples, limit 64 new tokens, same model, prompts
and reward), but each response row gets a planned length: 80% of rows stop within 4
tokens (1-4, uniform), 20% run to the 64-token limit. The benchmark models never emit
EOS on their own; EOS is forced at the planned length by the same rule in every engine
(PolyRL HF engine: around its sampler; PolyRL vLLM engine: a vLLM v1 logits processor
keyed by each request's seed; TRL: a transformers LogitsProcessor in its generate). The
same rows get the same lengths everywhere (the table's "resp len"/"short" columns check it).

Contenders: PolyRL with the vLLM engine (continuous batching: a finished sequence leaves
the batch at once), PolyRL with the HF engine as shipped (drops finished rows from the
decode batch, KV cache included, once they are 1/8 of it), the HF engine with that off
(``drop_finished=False``: the whole batch decodes until its last row stops, as
transformers' ``generate`` does), and TRL's GRPOTrainer (transformers ``generate``).
Printed: seconds per rollout and per full training step, and the gains.

    .venv/bin/python benchmarks/variable_lengths.py [--quick] [--sizes 0.3M 20M]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _runner as runner  # noqa: E402

HF, HF_FULL = "PolyRL (HF engine)", "PolyRL (HF engine, drop_finished=off)"
VLLM, TRL = "PolyRL (vLLM engine)", "TRL GRPOTrainer"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--sizes", nargs="+", default=None, choices=list(c.SIZES))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--long-frac", type=float, default=0.2, help="rows that run to the limit")
    p.add_argument("--short-max", type=int, default=4, help="other rows stop within this many")
    p.add_argument("--no-trl", action="store_true", help="leave TRL out")
    args = p.parse_args()
    threads, why = c.resolve_threads(args.threads)
    sizes = args.sizes or (["0.3M"] if args.quick else ["0.3M", "20M"])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    isolate = not args.in_process
    T = args.max_new_tokens
    plan = {"long_frac": args.long_frac, "short_max": args.short_max}

    print(
        f"variable_lengths: 16 prompts x 8 samples; {1 - args.long_frac:.0%} of responses stop "
        f"within {args.short_max} tokens, {args.long_frac:.0%} run to {T}\n"
    )
    info = c.print_machine(threads, why)
    ok, vwhy = c.vllm_status()
    print(f"  {'polyrl vllm engine':>20}: " + ("available" if ok else f"UNAVAILABLE ({vwhy})"))
    print(
        f"\n{warmup} warm-up + {steps} timed steps per contender, interleaved round-robin"
        + ("; one process per contender" if isolate else "; in-process")
    )

    results: dict = {"machine": info, "warmup": warmup, "steps": steps, "plan": plan, "sizes": {}}
    rows, lines = [], []
    for size in sizes:
        model = c.build_model(size)
        nparams = c.param_count(model)
        common = dict(n=8, prompts=16, max_new_tokens=T, stop_plan_args=plan)
        specs = {
            HF: ("polyrl", dict(model=model, engine="hf", **common)),
            HF_FULL: (
                "polyrl",
                dict(model=model, engine="hf", engine_args={"drop_finished": False}, **common),
            ),
        }
        if ok:
            specs[VLLM] = (
                "polyrl",
                dict(
                    model=model,
                    engine="vllm",
                    engine_args={"max_model_len": 64 + T + 32, "kv_cache_gb": 0.25},
                    **common,
                ),
            )
        if not args.no_trl:
            specs[TRL] = ("trl", dict(model=model, total_steps=warmup + steps, **common))
        print(
            f"\n[{size}: {c.fmt_params(nparams)} parameters] starting contenders ...",
            file=sys.stderr,
            flush=True,
        )
        remotes = runner.start_all(specs, threads=threads, isolate=isolate)
        timed = runner.interleave(remotes, warmup=warmup, steps=steps)
        runner.close_all(remotes)

        res: dict = {}
        for name, r in remotes.items():
            recs = timed[name].get("default", [])
            if r.error or not recs:
                res[name] = {"error": r.error or "no steps"}
                rows.append(
                    [size, name]
                    + [float("nan")] * 4
                    + [(r.error or "no steps").splitlines()[-1][:80]]
                )
                continue
            s = c.summarize([x["step_s"] for x in recs])
            s.update(
                {
                    k: c.median_of(recs, k)
                    for k in ("rollout_s", "update_s", "mean_len", "short_frac")
                }
            )
            res[name] = s
            rows.append(
                [size, name, s["rollout_s"], s["median_s"], s["mean_len"], s["short_frac"], ""]
            )
        if not ok:
            res[VLLM] = {"error": f"unavailable: {vwhy}"}
            rows.append([size, VLLM] + [float("nan")] * 4 + [f"unavailable: {vwhy}"[:80]])

        def get(name: str, key: str, res: dict = res) -> float | None:
            v = res.get(name, {}).get(key)
            return v if v and v == v else None

        pairs = [
            (
                HF_FULL,
                VLLM,
                "rollout_s",
                "vLLM continuous batching vs HF batch decoding (drop_finished=off), per rollout",
            ),
            (HF, VLLM, "rollout_s", "vLLM vs PolyRL HF engine as shipped, per rollout"),
            (HF_FULL, HF, "rollout_s", "HF engine: dropping finished rows vs not, per rollout"),
            (TRL, HF, "median_s", "TRL / PolyRL (HF engine), per training step"),
            (TRL, VLLM, "median_s", "TRL / PolyRL (vLLM engine), per training step"),
        ]
        for a, b, key, label in pairs:
            if get(a, key) and get(b, key):
                ratio = get(a, key) / get(b, key)
                res.setdefault("ratios", {})[label] = ratio
                lines.append(f"  {size:>5}: {label}: {ratio:.2f}x")
        results["sizes"][size] = {"params": nparams, "results": res}

    print()
    print(c.table(["size", "contender", "rollout s", "step s", "resp len", "short", "note"], rows))
    print("\n(TRL's rollout time is not exposed separately: its column shows n/a)")
    print("\nGains (a / b, higher = b faster):")
    print("\n".join(lines) if lines else "  (none: contenders failed)")
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
