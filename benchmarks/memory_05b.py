"""Memory of a Qwen2.5-0.5B-shaped policy: local mode against Ray + FSDP2 on 2 CPU ranks.

The model is Qwen2.5-0.5B's shape at random init (``qwen2_5_0_5b_shape`` in core/demo/tiny.py:
hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936; 494M fp32
parameters), built offline once. Each mode runs in its own process: the policy with
activation checkpointing and AdamW takes ``--steps`` GRPO updates on synthetic rows, then
every training process reports the bytes it holds of the parameters, gradients and
optimizer state (its shards under FSDP), its peak resident memory while training (the peak
is reset after setup) and its peak over the whole process (setup included: every rank
builds the full model before sharding it).

    .venv/bin/python benchmarks/memory_05b.py [--layers 24] [--steps 2] [--mode local ray]

Memory: local mode holds ~8 GiB at 24 layers (weights, gradients, two Adam moments); the
modes run one after the other, never at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

GIB = 2**30


def model_dir(layers: int, vocab_rows: int) -> str:
    from polyrl.core.demo.tiny import qwen2_5_0_5b_shape

    path = c.CACHE / f"qwen2.5-0.5b-shape-L{layers}-V{vocab_rows}"
    return str(qwen2_5_0_5b_shape(path, num_layers=layers, vocab_rows=vocab_rows))


def _config(path: str, args, ray: bool):
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    over = [
        f"policies.main.model={path}",
        "policies.main.optim.lr=1e-5",
        f"policies.main.micro_batch_size={args.rows}",
        "policies.main.gradient_checkpointing=true",
    ]
    if ray:
        over += [
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 2, num_cpus: 2, threads_per_worker: 1}",
        ]
    return load(Config, None, over)


def _record(tokenizer, args, seed: int):
    """``rows`` rows in groups of 4: random prompt and response tokens, 0/1 rewards."""
    import torch

    from polyrl.core.record import text_record
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.credit import group_credit

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer) - 4  # the byte symbols, never the special tokens at the end

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    responses = [ids(args.response) for _ in range(args.rows)]
    rec = text_record(
        prompt_ids=[ids(args.prompt) for _ in range(args.rows)],
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        policy=["main"] * args.rows,
        uid=[i // 4 for i in range(args.rows)],
        pad_id=tokenizer.pad_token_id,
    )
    rec["reward"] = torch.randint(0, 2, (args.rows,), generator=g).float()
    group_credit(rec, AlgorithmConfig())
    return rec


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def child(mode: str, args) -> dict:
    """One mode's run in this process; the result of each training process."""
    import torch

    from polyrl.core.distributed.ray_workers import memory_report
    from polyrl.core.train.algorithms import AlgorithmConfig

    torch.set_num_threads(1 if mode == "ray" else 2)
    path = model_dir(args.layers, args.vocab_rows)
    cfg = _config(path, args, ray=mode == "ray")
    kw = {"total_steps": 10, "need_reference": False, "shared": {}}
    if mode == "local":
        from polyrl.core.distributed.backend import LocalBackend
        from polyrl.core.train import trainer

        policy = LocalBackend(cfg).make_policy("main", cfg.policies["main"], **kw)
        setup_peak = memory_report(policy)["peak_rss"]
        _reset_peak()
        times = []
        for s in range(args.steps):
            t0 = time.perf_counter()
            trainer.update(
                policy,
                _record(policy.tokenizer, args, s),
                AlgorithmConfig(),
                generator=torch.Generator().manual_seed(s),
            )
            times.append(time.perf_counter() - t0)
        ranks = [memory_report(policy) | {"setup_peak": setup_peak}]
    else:
        from polyrl.core.distributed.ray_backend import RayBackend

        backend = RayBackend(cfg)
        try:
            policy = backend.make_policy("main", cfg.policies["main"], **kw)
            group = backend.groups["main"]
            setup = group.call("memory")  # waits for setup
            group.call("reset_peak_memory")
            times = []
            for s in range(args.steps):
                t0 = time.perf_counter()
                backend.update(
                    policy,
                    _record(policy.tokenizer, args, s),
                    AlgorithmConfig(),
                    temperature=1.0,
                    generator=torch.Generator().manual_seed(s),
                )
                times.append(time.perf_counter() - t0)
            ranks = [
                m | {"setup_peak": st["peak_rss"]}
                for m, st in zip(group.call("memory"), setup, strict=True)
            ]
        finally:
            backend.shutdown()
    return {"mode": mode, "ranks": ranks, "step_s": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab-rows", type=int, default=151936)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="rows per update (groups of 4)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--response", type=int, default=96, help="response tokens per row")
    p.add_argument("--mode", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.child:
        print(c.RESULT_TAG + json.dumps(child(args.child, args)), flush=True)
        return
    path = model_dir(args.layers, args.vocab_rows)
    n = c.param_count(path)
    print(
        f"memory_05b: {c.fmt_params(n)} parameters ({args.layers} layers, vocabulary "
        f"{args.vocab_rows}), fp32, AdamW, activation checkpointing; {args.steps} updates of "
        f"{args.rows} rows x ({args.prompt} prompt + {args.response} response) tokens\n"
    )
    c.print_machine(2)
    results = []
    for mode in args.mode:  # one process at a time: local mode alone needs ~8 GiB at 0.5B
        cmd = [sys.executable, __file__, "--child", mode] + sys.argv[1:]
        env = os.environ | {"OMP_NUM_THREADS": "1" if mode == "ray" else "2"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in proc.stdout.splitlines() if x.startswith(c.RESULT_TAG)]
        if proc.returncode or not line:
            print(f"{mode}: FAILED\n{proc.stderr[-3000:]}")
            continue
        results.append(json.loads(line[-1][len(c.RESULT_TAG) :]))
    rows = []
    local = next((r["ranks"][0] for r in results if r["mode"] == "local"), None)
    for r in results:
        for k, m in enumerate(r["ranks"]):
            state = m["params"] + m["grads"] + m["optimizer"]
            share = state / (local["params"] + local["grads"] + local["optimizer"]) if local else 0
            who = "local" if r["mode"] == "local" else f"ray rank {k}"
            rows.append(
                [
                    who,
                    m["params"] / GIB,
                    m["grads"] / GIB,
                    m["optimizer"] / GIB,
                    state / GIB,
                    share if local else float("nan"),
                    m["peak_rss"] / GIB,
                    m["setup_peak"] / GIB,
                    sum(r["step_s"]) / len(r["step_s"]),
                ]
            )
    print(
        c.table(
            [
                "process",
                "params GiB",
                "grads GiB",
                "Adam GiB",
                "state GiB",
                "x local",
                "train peak RSS GiB",
                "peak RSS to setup end GiB",
                "s/update",
            ],
            rows,
        )
    )
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
