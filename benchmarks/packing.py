"""Packed against padded updates on responses of widely varying length.

One GRPO update (``polyrl.core.train.trainer.update``: ppo_clip, token-mean, one epoch, no
reference) over a fixed record of 16 prompts x 8 responses: 80% of the responses have 1
to 4 tokens, 20% have 64 (``--long-frac``, ``--short-max``, ``--max-new-tokens``); prompts
are the arithmetic task's, chat-templated (12 to 14 tokens). Contenders, each in its own
fresh process, steps interleaved round-robin:

- ``padded``: ``pack: false, shared_prefix: false``, ``micro_batch_size`` rows per pass;
- ``padded, shared prefix``: ``pack: false`` (each distinct prompt once, its KV cache
  shared by its group: the default before packing);
- ``packed``: ``pack: true`` with the default token budget (``micro_batch_size`` x the
  longest row), rows packed without padding (shared prefixes in a tree, core/train/prefix.py,
  where the cost model finds it pays);
- ``packed, no prefix tree``: the same with ``shared_prefix: false``: the packed pass as it
  was before prefix trees, measured beside it (issue 30's "before and after");
- with ``--budget N``, also ``packed, N tokens`` (``max_tokens_per_micro_batch: N``).

Printed per model size: median wall and CPU seconds per update (CPU time: the process's
own, less sensitive to other jobs on a shared machine), the peak memory an update adds
(resident-set high-water mark after the update, minus the one before it: weights,
gradients and optimizer state are allocated before the mark; on ``--device cuda`` the
GPU allocator's peak instead), tokens through the model (padding and bin fillers
included) and passes per update, and padded / packed ratios measured in the same run.

    .venv/bin/python benchmarks/packing.py [--quick] [--sizes 0.3M 20M] [--budget N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

PADDED, SHARED, PACKED = "padded", "padded, shared prefix", "packed"
PACKED_OFF = "packed, no prefix tree"  # the packed pass before core/train/prefix.py (issue 30)
TAG = "@@packing@@"


# ------------------------------------------------------------------------------ worker
def _record(policy, plan: dict):
    """The fixed variable-length record, the same in every process (seeded)."""
    import torch

    from polyrl.core.record import text_record

    tok = policy.tokenizer
    rows = c.read_rows(c.data_file())[: plan["prompts"]]
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for row in rows:
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(plan["n"]):
            long = float(torch.rand(1, generator=gen)) < plan["long_frac"]
            n = (
                plan["max_new_tokens"]
                if long
                else int(torch.randint(1, plan["short_max"] + 1, (1,), generator=gen))
            )
            prompts.append(ids)
            responses.append(torch.randint(3, len(tok), (n,), generator=gen).tolist())
    rec = text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[-1.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=[i // plan["n"] for i in range(len(prompts))],
        pad_id=tok.pad_token_id,
    )
    width = rec["response_ids"].shape[1]
    rec["advantages"] = torch.randn(len(prompts), 1, generator=gen).expand(-1, width).contiguous()
    return rec


def _peak_mib(device: str) -> float:
    """High-water mark of the process's resident memory (cpu) or of the GPU allocator."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _mark_mib(device: str) -> float:
    """Memory before the updates: what a later peak is measured from."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    return _peak_mib(device)


def worker(spec: dict) -> None:
    """Build one contender, then answer ``step`` lines on stdin with one tagged JSON line."""
    import torch

    from polyrl.core.train import trainer
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.passes import pack_rows, packs
    from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig

    c.set_threads(spec["threads"])
    device = spec["device"]
    cfg = PolicyConfig(
        model=spec["model"],
        optim=OptimConfig(lr=1e-6),
        device=device,
        dtype=spec["dtype"],
        **spec["policy"],
    )
    policy = CausalLMPolicy("main", cfg, total_steps=1000, need_reference=False)
    rec = _record(policy, spec["plan"])
    # optimizer state and gradients exist before the memory mark (a zero-gradient step)
    for p in policy.model.parameters():
        p.grad = torch.zeros_like(p)
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    budget = policy.token_budget(rec)
    plan_rows = trainer._micro_batch_rows(len(rec), cfg.micro_batch_size, None, budget)
    lengths = rec["prompt_mask"].sum(-1) + rec["response_mask"].sum(-1)
    real, padded = int(lengths.sum()), rec["prompt_ids"].numel() + rec["response_ids"].numel()
    if budget is not None:  # packed: each pass's bins (sdpa/eager) or one sequence (flash)
        flash = "flash" in str(policy.model.config._attn_implementation)
        through = sum(
            sum(lengths[rows].tolist()) if flash else bins * width
            for rows in plan_rows
            for _, _, bins, width in [pack_rows(lengths[rows].tolist(), int(lengths[rows].max()))]
        )
    elif cfg.shared_prefix:  # each distinct prompt once per pass, responses padded
        through = rec["response_ids"].numel() + sum(
            len(torch.unique(rec["prompt_ids"][rows], dim=0)) * rec["prompt_ids"].shape[1]
            for rows in plan_rows
        )
    else:
        through = padded
    info = {
        "rows": len(rec),
        "real_tokens": real,
        "padded_tokens": padded,
        "tokens_through_model": through,
        "passes": len(plan_rows),
        "packed": packs(policy.model, cfg.pack),
        "mark_mib": _mark_mib(device),
    }
    print(TAG + json.dumps(info), flush=True)
    algo = AlgorithmConfig()
    for line in sys.stdin:
        if json.loads(line).get("op") != "step":
            break
        w0, c0 = time.perf_counter(), time.process_time()
        trainer.update(policy, rec, algo)
        peak = _peak_mib(device)  # (synchronises a GPU before the clocks stop)
        out = {
            "wall_s": time.perf_counter() - w0,
            "cpu_s": time.process_time() - c0,
            "peak_mib": peak,
        }
        print(TAG + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ driver
class Contender:
    def __init__(self, name: str, spec: dict) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            bufsize=1,
        )
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        raise RuntimeError(f"{self.name}: worker exited with {self.proc.wait()}")

    def step(self) -> dict:
        self.proc.stdin.write(json.dumps({"op": "step"}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--sizes", nargs="+", default=None, choices=list(c.SIZES))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--long-frac", type=float, default=0.2, help="responses of max length")
    p.add_argument("--short-max", type=int, default=4, help="other responses: 1 to this many")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--budget", type=int, default=None, help="also packed with this token budget")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    threads, why = c.resolve_threads(args.threads)
    sizes = args.sizes or (["0.3M"] if args.quick else ["0.3M", "20M"])
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    plan = {
        "prompts": 16,
        "n": 8,
        "long_frac": args.long_frac,
        "short_max": args.short_max,
        "max_new_tokens": args.max_new_tokens,
    }
    mb = args.micro_batch_size
    print(
        f"packing: one GRPO update over 16 prompts x 8 responses; {1 - args.long_frac:.0%} "
        f"of responses 1-{args.short_max} tokens, {args.long_frac:.0%} {args.max_new_tokens}; "
        f"micro_batch_size {mb}\n"
    )
    info = c.print_machine(threads, why)
    print(f"\n{warmup} warm-up + {steps} timed updates per contender, interleaved round-robin")
    contenders = {
        PADDED: {"pack": False, "shared_prefix": False},
        SHARED: {"pack": False, "shared_prefix": True},
        PACKED: {"pack": True},
        PACKED_OFF: {"pack": True, "shared_prefix": False},
    }
    if args.budget:
        contenders[f"packed, {args.budget} tokens"] = {
            "pack": True,
            "max_tokens_per_micro_batch": args.budget,
        }
    results: dict = {"machine": info, "plan": plan, "micro_batch_size": mb, "sizes": {}}
    for size in sizes:
        model = c.build_model(size)
        print(f"\n{size} ({c.fmt_params(c.param_count(model))} parameters)")
        procs = {
            name: Contender(
                name,
                {
                    "model": model,
                    "threads": threads,
                    "device": args.device,
                    "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
                    "plan": plan,
                    "policy": {"micro_batch_size": mb, **kw},
                },
            )
            for name, kw in contenders.items()
        }
        times: dict[str, list[dict]] = {name: [] for name in procs}
        names = list(procs)
        for rnd in range(warmup + steps):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                out = procs[name].step()
                if rnd >= warmup:
                    times[name].append(out)
            print(f"  round {rnd + 1}/{warmup + steps} done", file=sys.stderr, flush=True)
        for proc in procs.values():
            proc.close()
        rows, per = [], {}
        for name, proc in procs.items():
            wall = c.median_of(times[name], "wall_s")
            cpu = c.median_of(times[name], "cpu_s")
            mem = max(t["peak_mib"] for t in times[name]) - proc.info["mark_mib"]
            per[name] = {"wall_s": wall, "cpu_s": cpu, "update_mib": mem, **proc.info}
            rows.append(
                [name, proc.info["tokens_through_model"], proc.info["passes"], wall, cpu, mem]
            )
        print(
            c.table(
                ["contender", "tokens", "passes", "wall s/update", "cpu s/update", "update MiB"],
                rows,
            )
        )
        pk = per[PACKED]
        for ref in (PADDED, SHARED, PACKED_OFF):
            r = per[ref]
            print(
                f"  {ref} / packed: wall {r['wall_s'] / pk['wall_s']:.2f}x, "
                f"cpu {r['cpu_s'] / pk['cpu_s']:.2f}x, "
                f"update memory {r['update_mib'] / max(pk['update_mib'], 1e-9):.2f}x"
            )
        print(
            f"  rows {pk['rows']}: {pk['real_tokens']} real tokens, "
            f"{pk['padded_tokens']} padded ({pk['padded_tokens'] / pk['real_tokens']:.2f}x)"
        )
        results["sizes"][size] = {"contenders": per, "steps": times}
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
