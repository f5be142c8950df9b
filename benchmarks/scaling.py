"""How PolyRL's step cost grows with group size and response length.

Seconds per full GRPO step (SingleTurn rollout -> reward -> credit -> trainer.update ->
sync; 16 prompts per step, equal-length responses) for group size 4/8/16/32 and response
length 32/64/128, with the HF engine and, when it imports, the vLLM engine. Printed per
configuration: seconds per step, its rollout/update split, and the cost per generated
token. Linear growth shows as a flat (or falling, as fixed costs amortise) per-token cost;
the fitted exponent b in  time ~ tokens^b  is printed per engine and axis (b = 1: linear;
b > 1: super-linear, e.g. Python work that grows with the square of the batch).

    .venv/bin/python benchmarks/scaling.py [--quick] [--size 0.3M]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _runner as runner  # noqa: E402

LINEAR_TOL = 1.1  # exponent above which growth is called super-linear


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares exponent b of y = a * x^b."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return (
        sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--size", default="0.3M", choices=list(c.SIZES))
    p.add_argument("--groups", type=int, nargs="+", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--no-vllm", action="store_true")
    args = p.parse_args()
    threads, why = c.resolve_threads(args.threads)
    groups = args.groups or ([4, 8] if args.quick else [4, 8, 16, 32])
    lengths = args.lengths or ([32, 64] if args.quick else [32, 64, 128])
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    isolate = not args.in_process

    print(
        f"scaling: seconds per GRPO step, 16 prompts x group size {groups} x response length "
        f"{lengths}\n"
    )
    info = c.print_machine(threads, why)
    ok, vwhy = c.vllm_status()
    ok = ok and not args.no_vllm
    print(
        f"  {'polyrl vllm engine':>20}: "
        + ("available" if ok else f"not measured ({'--no-vllm' if args.no_vllm else vwhy})")
    )
    model = c.build_model(args.size)
    nparams = c.param_count(model)
    print(
        f"\nmodel {args.size} ({c.fmt_params(nparams)} parameters); {warmup} warm-up + {steps} "
        "timed steps per configuration, all configurations and engines interleaved"
    )

    max_rows = 16 * max(groups)
    specs = {
        "HF engine": (
            "polyrl",
            dict(model=model, engine="hf", micro_batch_size=128, engine_args={"batch_size": 256}),
        )
    }
    if ok:
        kv = 0.5 if args.size == "0.3M" else 4.0
        specs["vLLM engine"] = (
            "polyrl",
            dict(
                model=model,
                engine="vllm",
                micro_batch_size=128,
                engine_args={
                    "max_model_len": 64 + max(lengths) + 32,
                    "kv_cache_gb": kv,
                    "max_num_seqs": max_rows,
                },
            ),
        )
    configs = [{"n": g, "max_new_tokens": t} for t in lengths for g in groups]
    remotes = runner.start_all(specs, threads=threads, isolate=isolate)
    timed = runner.interleave(remotes, warmup=warmup, steps=steps, configs=configs)
    runner.close_all(remotes)

    rows, lines = [], []
    results: dict = {"machine": info, "model": args.size, "params": nparams, "engines": {}}
    for name, r in remotes.items():
        if r.error:
            rows.append(
                [
                    name,
                    "-",
                    "-",
                    float("nan"),
                    float("nan"),
                    float("nan"),
                    float("nan"),
                    float("nan"),
                    r.error.splitlines()[-1][:80],
                ]
            )
            results["engines"][name] = {"error": r.error}
            continue
        per: dict = {}
        for cfg in configs:
            recs = timed[name].get(runner.config_key(cfg), [])
            if not recs:
                continue
            step = c.median_of(recs, "step_s")
            tokens = c.median_of(recs, "tokens")
            d = {
                "step_s": step,
                "rollout_s": c.median_of(recs, "rollout_s"),
                "update_s": c.median_of(recs, "update_s"),
                "tokens": tokens,
                "us_per_token": 1e6 * step / tokens,
            }
            per[runner.config_key(cfg)] = d
            rows.append(
                [
                    name,
                    cfg["n"],
                    cfg["max_new_tokens"],
                    int(tokens),
                    step,
                    d["rollout_s"],
                    d["update_s"],
                    d["us_per_token"],
                    "",
                ]
            )
        results["engines"][name] = {"configs": per, "exponents": {}}

        def pts(sel, per=per):
            return [(v["tokens"], v["step_s"]) for k, v in per.items() if sel(k)]

        fits = {"all configurations": pts(lambda k: True)}
        if 64 in lengths:
            fits["group size (length 64)"] = pts(lambda k: k.startswith("max_new_tokens=64,"))
        if 8 in groups:
            fits["response length (group 8)"] = pts(lambda k: k.endswith(",n=8"))
        for label, pp in fits.items():
            if len(pp) >= 2:
                b = slope(pp)
                verdict = "about linear or better" if b <= LINEAR_TOL else "SUPER-LINEAR"
                lines.append(f"  {name:>11}, {label:<27}: b = {b:.2f}  ({verdict})")
                results["engines"][name]["exponents"][label] = b
        if per:
            costs = [v["us_per_token"] for v in per.values()]
            lines.append(
                f"  {name:>11}, per-token cost range: {min(costs):.1f} .. {max(costs):.1f} us "
                f"(max/min {max(costs) / min(costs):.2f})"
            )

    print()
    print(
        c.table(
            [
                "engine",
                "group",
                "length",
                "tokens",
                "s/step",
                "rollout s",
                "update s",
                "us/token",
                "note",
            ],
            rows,
        )
    )
    print("\nGrowth exponent b in  step time ~ generated tokens^b  (1 = linear):")
    print("\n".join(lines) if lines else "  (none)")
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
