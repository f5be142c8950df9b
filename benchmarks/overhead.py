"""PolyRL's own overhead: rollout against raw vLLM, update against a bare PyTorch step.

1. Rollout throughput (tokens/s) of PolyRL against raw ``vllm.LLM.generate`` on the same
   prompt ids (16 prompts x 8 samples, 64 new tokens, equal lengths), raw vLLM set up like
   PolyRL's engine (in-process, fp32, eager, one log-prob per token, one seed per request).
   PolyRL is measured twice: ``engine.generate`` alone, and the SingleTurn workflow's
   rollout (generate + the rollout record: what a training step pays). Target: >= 0.9 of
   raw. For reference the same pair is measured for the HF engine against transformers'
   ``model.generate`` (sampling, no EOS stop: equal work).
2. Update step: ``polyrl.core.train.trainer.update`` (GRPO, ppo_clip, token-mean, one
   micro-batch of 128 rows) against a bare PyTorch step over the same tokens (forward with
   logits only at response positions, the same token loss written inline, backward,
   grad-norm clip, AdamW). Target: >= 0.8 of bare throughput.

    .venv/bin/python benchmarks/overhead.py [--quick] [--sizes 0.3M 20M]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _runner as runner  # noqa: E402

ROLLOUT_TARGET, UPDATE_TARGET = 0.9, 0.8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--sizes", nargs="+", default=None, choices=list(c.SIZES))
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    threads, why = c.resolve_threads(args.threads)
    sizes = args.sizes or (["0.3M"] if args.quick else ["0.3M", "20M"])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (3 if args.quick else 7)
    isolate = not args.in_process
    T = args.max_new_tokens

    print(
        f"overhead: PolyRL against raw vLLM (rollout) and bare PyTorch (update); "
        f"128 rows x {T} new tokens\n"
    )
    info = c.print_machine(threads, why)
    ok, vwhy = c.vllm_status()
    print(f"  {'polyrl vllm engine':>20}: " + ("available" if ok else f"UNAVAILABLE ({vwhy})"))
    print(
        f"\n{warmup} warm-up + {steps} timed steps per contender, interleaved round-robin"
        + ("; one process per contender" if isolate else "; in-process")
    )

    results: dict = {"machine": info, "warmup": warmup, "steps": steps, "sizes": {}}
    rows, lines = [], []
    for size in sizes:
        model = c.build_model(size)
        nparams = c.param_count(model)
        gen = dict(n=8, prompts=16, max_new_tokens=T)
        vargs = {"max_model_len": 64 + T + 32, "kv_cache_gb": 0.25}
        specs: dict = {}
        if ok:
            specs["raw vllm.LLM.generate"] = ("raw_vllm", dict(model=model, **gen, **vargs))
            specs["PolyRL vLLM engine.generate"] = (
                "polyrl",
                dict(model=model, engine="vllm", engine_args=vargs, mode="generate", **gen),
            )
            specs["PolyRL vLLM rollout (workflow)"] = (
                "polyrl",
                dict(model=model, engine="vllm", engine_args=vargs, mode="rollout", **gen),
            )
        specs["raw transformers generate"] = ("hf_generate", dict(model=model, **gen))
        specs["PolyRL HF engine.generate"] = (
            "polyrl",
            dict(model=model, engine="hf", mode="generate", **gen),
        )
        specs["PolyRL HF rollout (workflow)"] = (
            "polyrl",
            dict(model=model, engine="hf", mode="rollout", **gen),
        )
        upd = dict(rows=128, prompt_len=14, response_len=T, micro_batch_size=128)
        specs["bare PyTorch update"] = ("update", dict(model=model, kind="bare", **upd))
        specs["PolyRL trainer.update"] = ("update", dict(model=model, kind="polyrl", **upd))
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
                    [
                        size,
                        name,
                        float("nan"),
                        float("nan"),
                        (r.error or "no steps").splitlines()[-1][:80],
                    ]
                )
                continue
            s = c.summarize([x["step_s"] for x in recs])
            tokens = c.median_of(recs, "tokens")
            if tokens != tokens:  # updates: tokens trained on
                tokens = upd["rows"] * (upd["prompt_len"] + T)
            s["tokens"] = tokens
            s["tokens_per_s"] = tokens / s["median_s"]
            res[name] = s
            rows.append([size, name, s["median_s"], s["tokens_per_s"], ""])
        if not ok:
            rows.append(
                [
                    size,
                    "PolyRL vLLM engine / raw vLLM",
                    float("nan"),
                    float("nan"),
                    f"vLLM engine unavailable: {vwhy}"[:80],
                ]
            )

        def thr(name: str, res: dict = res) -> float | None:
            return res.get(name, {}).get("tokens_per_s")

        checks = [
            ("PolyRL vLLM rollout (workflow)", "raw vllm.LLM.generate", ROLLOUT_TARGET),
            ("PolyRL vLLM engine.generate", "raw vllm.LLM.generate", None),
            ("PolyRL HF rollout (workflow)", "raw transformers generate", None),
            ("PolyRL HF engine.generate", "raw transformers generate", None),
            ("PolyRL trainer.update", "bare PyTorch update", UPDATE_TARGET),
        ]
        for a, b, target in checks:
            if thr(a) and thr(b):
                ratio = thr(a) / thr(b)
                res.setdefault("ratios", {})[f"{a} / {b}"] = ratio
                verdict = (
                    f"   target >= {target}: {'MET' if ratio >= target else 'NOT MET'}"
                    if target
                    else ""
                )
                lines.append(f"  {size:>5}: {a} / {b} = {ratio:.2f}{verdict}")
            elif target:
                lines.append(
                    f"  {size:>5}: {a} / {b}: not measured "
                    f"({res.get(a, res.get(b, {})).get('error', 'unavailable')})".splitlines()[0]
                )
        results["sizes"][size] = {"params": nparams, "results": res}

    print()
    print(c.table(["size", "contender", "median s", "tokens/s", "note"], rows))
    print("\n(tokens: generated tokens for rollouts; prompt + response tokens for updates)")
    print("\nThroughput ratios, PolyRL / raw (1.00 = no overhead):")
    print("\n".join(lines) if lines else "  (none)")
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
