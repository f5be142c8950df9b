"""Many LoRA agents on one base: batched against one-by-one.

**Update** (:func:`update_case`): 2, 4 and 8 ``lora_agent`` policies (rank 16 on every
linear layer, each its own AdamW) on the 20M benchmark model, each with its own record of
``--prompts`` prompts x ``--n`` responses (arithmetic prompts, chat-templated, 12 to 14
tokens; responses of ``--max-new-tokens`` random tokens; random advantages). One GRPO update
of every agent (ppo_clip, token-mean, one epoch; ``--minibatches`` above 1 recomputes the
old log-probs first, ``--kl-coef`` above 0 adds the reference pass):

- ``one-by-one``: ``polyrl.core.train.trainer.update`` per agent, as the loop ran them before
  (``args.batch_update: false``): each agent's micro-batches are passes of their own;
- ``batched``: ``polyrl.core.train.trainer.update_together`` (the default for lora_agent
  policies on one base): micro-batch k of every agent in ONE forward/backward, each row
  through its own adapter (``polyrl.marl.multi_lora``); each agent's own optimizer step.

Each contender is built in its own fresh process and the steps are interleaved
round-robin (benchmarks/_common.py), so machine load hits both alike; the median wall and
CPU seconds of the timed updates are printed per agent count, and the one-by-one /
batched ratio, measured in the same run, and the limit: the GEMM floor (:func:`gemm_floor`,
the base's matrix products for the same tokens timed alone), below which no batching of
the passes can go on the device.

**Rollout** (:func:`rollout_case`): the same agent counts, every agent's ``--prompts``
prompts x ``--n`` samples of ``--max-new-tokens`` tokens (random prompts, temperature 1),
in ONE engine call (``generate_mixed``: what the episode runtime sends when the agents'
acts wait together; HF engine: one decode loop, each row through its own adapter,
``polyrl.marl.multi_lora``; vLLM: one ``llm.generate`` with a LoRARequest per prompt)
against one call per agent (``generate`` each, as before), timed alternately in one
process on the same engines. ``--rollout-engines hf vllm`` adds vLLM (``vllm_lora``; one
LLM per process, built once for the largest count); none skips the section.

    .venv/bin/python benchmarks/multi_lora.py [--quick] [--agents 2 4 8] [--size 20M]
        [--rollout-engines hf vllm]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

TAG = "@@multi_lora@@"
ONE, BATCHED = "one-by-one", "batched"


# ------------------------------------------------------------------------------ update
def _records(policies, plan: dict) -> list:
    """Each agent's fixed record (its own prompts), the same in every process (seeded)."""
    import torch

    from polyrl.core.record import text_record

    tok = policies[0].tokenizer
    rows = c.read_rows(c.data_file())
    gen = torch.Generator().manual_seed(0)
    out = []
    for k, p in enumerate(policies):
        mine = rows[k * plan["prompts"] : (k + 1) * plan["prompts"]]
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}],
                    tokenize=False,
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )
            for r in mine
            for _ in range(plan["n"])
        ]
        width = plan["max_new_tokens"]
        responses = [torch.randint(3, len(tok), (width,), generator=gen).tolist() for _ in prompts]
        rec = text_record(
            prompt_ids=prompts,
            response_ids=responses,
            rollout_logprobs=[[-1.0] * width for _ in prompts],
            policy=[p.name] * len(prompts),
            uid=[i // plan["n"] for i in range(len(prompts))],
            pad_id=tok.pad_token_id,
        )
        adv = torch.randn(len(prompts), 1, generator=gen).expand(-1, width).contiguous()
        rec["advantages"] = adv
        out.append(rec)
    return out


def update_worker(spec: dict) -> None:
    """Build one contender (``agents`` lora_agent policies on one base), then answer
    ``step`` lines on stdin with one tagged JSON line each."""
    import torch

    from polyrl.core.registry import POLICIES, load_plugins
    from polyrl.core.train import trainer
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.policy import LoraConfig, OptimConfig, PolicyConfig

    load_plugins()
    c.set_threads(spec["threads"])
    shared: dict = {}
    policies = []
    for k in range(spec["agents"]):
        cfg = PolicyConfig(
            model=spec["model"],
            kind="lora_agent",
            lora=LoraConfig(r=16, alpha=32),
            optim=OptimConfig(lr=1e-6),
            device=spec["device"],
            dtype=spec["dtype"],
            micro_batch_size=spec["micro_batch_size"],
            args={"batch_update": spec["together"]},
        )
        policies.append(
            POLICIES.get("lora_agent")(
                f"agent{k}", cfg, total_steps=1000, need_reference=False, shared=shared
            )
        )
    records = _records(policies, spec["plan"])
    rows = sum(len(r) for r in records)
    tokens = sum(int(r["prompt_mask"].sum() + r["response_mask"].sum()) for r in records)
    # forward-only passes before the update: old log-probs (several mini-batches), reference
    extra = int(spec["minibatches"] > 1) + int(spec["kl_coef"] > 0)
    floor = gemm_floor(policies[0].model, tokens, spec["device"], spec["dtype"], extra)
    print(TAG + json.dumps({"rows": rows, "tokens": tokens, "floor_s": floor}), flush=True)
    algo = AlgorithmConfig(minibatches=spec["minibatches"], kl_coef=spec["kl_coef"])
    for line in sys.stdin:
        if json.loads(line).get("op") != "step":
            break
        w0, c0 = time.perf_counter(), time.process_time()
        if spec["together"]:
            trainer.update_together(policies, records, algo)
        else:
            for p, rec in zip(policies, records, strict=True):
                trainer.update(p, rec, algo)
        out = {}
        if spec["device"] == "cuda":
            torch.cuda.synchronize()
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out.update(wall_s=time.perf_counter() - w0, cpu_s=time.process_time() - c0)
        print(TAG + json.dumps(out), flush=True)


def gemm_floor(
    model, tokens: int, device: str, dtype: str, forwards: int = 0, reps: int = 3
) -> float:
    """The limit: seconds of the base's matrix products for ``tokens`` tokens, forward and
    input gradient (the frozen base's share of a LoRA update's backward) plus ``forwards``
    forward-only passes (old and reference log-probs), each decoder layer's Linear timed
    alone on random data (min of ``reps``). Batched passes do these products too, so on a
    device where they dominate no batching goes below this."""
    import collections

    import torch

    shapes = collections.Counter(
        (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in name and "lora_" not in name
    )
    dt = getattr(torch, dtype)
    total = 0.0
    for (d_in, d_out), count in shapes.items():
        x = torch.randn(tokens, d_in, device=device, dtype=dt)
        w = torch.randn(d_out, d_in, device=device, dtype=dt)
        g = torch.randn(tokens, d_out, device=device, dtype=dt)
        best = [math.inf, math.inf]
        for _ in range(reps + 1):  # the first warms up
            for k, (a, b) in enumerate(((x, w.t()), (g, w))):  # forward, input gradient
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                a @ b
                if device == "cuda":
                    torch.cuda.synchronize()
                best[k] = min(best[k], time.perf_counter() - t0)
        total += (best[0] * (1 + forwards) + best[1]) * count
    return total


class Contender:
    """One worker process (``--worker``), stepped on request."""

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


def update_case(args, threads: int, model: str, warmup: int, steps: int) -> dict:
    """The update section: per agent count, one-by-one and batched contenders stepped
    round-robin; prints the table and the ratios, returns the numbers."""
    plan = {"prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens}
    print(
        f"\nupdate: one GRPO update of every agent, {args.prompts} prompts x {args.n} "
        f"responses of {args.max_new_tokens} tokens each; micro_batch_size "
        f"{args.micro_batch_size}; {args.minibatches} mini-batch(es), KL coef {args.kl_coef}; "
        f"{warmup} warm-up + {steps} timed, interleaved round-robin"
    )
    results: dict = {"plan": plan, "agents": {}}
    rows = []
    for agents in args.agents:
        procs = {
            name: Contender(
                f"{agents} agents, {name}",
                {
                    "model": model,
                    "agents": agents,
                    "together": name == BATCHED,
                    "threads": threads,
                    "device": args.device,
                    "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
                    "micro_batch_size": args.micro_batch_size,
                    "plan": plan,
                    "minibatches": args.minibatches,
                    "kl_coef": args.kl_coef,
                },
            )
            for name in (ONE, BATCHED)
        }
        times: dict[str, list[dict]] = {name: [] for name in procs}
        names = list(procs)
        for rnd in range(warmup + steps):
            for name in names[rnd % 2 :] + names[: rnd % 2]:
                out = procs[name].step()
                if rnd >= warmup:
                    times[name].append(out)
            print(f"  {agents} agents: round {rnd + 1}/{warmup + steps}", file=sys.stderr)
        for proc in procs.values():
            proc.close()
        per = {
            name: {
                "wall_s": c.median_of(times[name], "wall_s"),
                "cpu_s": c.median_of(times[name], "cpu_s"),
                **(
                    {"peak_gib": max(t["peak_gib"] for t in times[name])}
                    if args.device == "cuda"
                    else {}
                ),
            }
            for name in procs
        }
        ratio = {k: per[ONE][k] / per[BATCHED][k] for k in ("wall_s", "cpu_s")}
        info = dict(procs[ONE].info)
        info["floor_s"] = min(p.info["floor_s"] for p in procs.values())
        rows.append(
            [
                agents,
                info["rows"],
                info["tokens"],
                per[ONE]["wall_s"],
                per[BATCHED]["wall_s"],
                f"{ratio['wall_s']:.2f}x",
                per[ONE]["cpu_s"],
                per[BATCHED]["cpu_s"],
                f"{ratio['cpu_s']:.2f}x",
                info["floor_s"],
                f"{per[ONE]['wall_s'] / info['floor_s']:.2f}x",
            ]
        )
        results["agents"][agents] = {"contenders": per, "ratio": ratio, "steps": times, **info}
    print(
        c.table(
            [
                "agents",
                "rows",
                "tokens",
                "one-by-one wall s",
                "batched wall s",
                "ratio",
                "one-by-one cpu s",
                "batched cpu s",
                "ratio",
                "GEMM floor s",
                "one-by-one / floor",
            ],
            rows,
        )
    )
    print(
        "GEMM floor: the base's matrix products for these tokens alone (forward and input "
        "gradient); one-by-one / floor bounds what any batching of the passes can gain here"
    )
    return results


# ------------------------------------------------------------------------------ rollout
def _rollout_engines(model: str, agents: int, engine: str, spec: dict) -> tuple[list, list]:
    """``agents`` lora_agent policies (rank 16, adapters moved off PEFT's zero start so
    they differ) on the base at ``model`` and their engines (``hf`` or ``vllm_lora``)."""
    import torch

    from polyrl.core.registry import ENGINES, POLICIES, load_plugins
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.train.policy import LoraConfig, PolicyConfig

    load_plugins()
    torch.manual_seed(0)
    shared: dict = {}
    cfg = PolicyConfig(
        model=model,
        kind="lora_agent",
        lora=LoraConfig(r=16, alpha=32),
        device=spec["device"],
        dtype=spec.get("dtype") or ("bfloat16" if spec["device"] == "cuda" else "float32"),
    )
    policies = [
        POLICIES.get("lora_agent")(
            f"agent{k}", cfg, total_steps=1, need_reference=False, shared=shared
        )
        for k in range(agents)
    ]
    for p in policies:
        state = p.trainable_state()
        p.load_trainable_state({k: v + 0.05 * torch.randn_like(v) for k, v in state.items()})
    if engine == "hf":
        return policies, [HFEngine(p, seed=k) for k, p in enumerate(policies)]
    args = {"max_model_len": 256, "kv_cache_gb": 0.5}
    return policies, [ENGINES.get("vllm_lora")(p, seed=k, **args) for k, p in enumerate(policies)]


def rollout_case(args, threads: int, model: str, warmup: int, steps: int) -> dict:
    """The rollout section: per engine and agent count, the agents' requests (``--prompts``
    prompts x ``--n`` samples of ``--max-new-tokens`` tokens each) in ONE engine call
    (``generate_mixed``: what the batcher sends when the agents' acts wait together) against
    one call per agent (``generate`` each: what it sent before). Both run in this process on
    the same engines, timed alternately (``warmup`` + ``steps``, medians); vLLM allows one
    LLM per process, so its engines are built once for the largest count."""
    import statistics

    import torch

    from polyrl.core.rollout.engine import SamplingParams

    c.set_threads(threads)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    print(
        f"\nrollout: every agent's {args.prompts} prompts x {args.n} samples of "
        f"{args.max_new_tokens} tokens; one engine call for all agents (merged) against one "
        f"per agent; {warmup} warm-up + {steps} timed, alternating, in one process"
    )
    results: dict = {}
    rows = []
    for engine in args.rollout_engines:
        policies, engines = _rollout_engines(model, max(args.agents), engine, vars(args))
        gen = torch.Generator().manual_seed(1)
        vocab = len(policies[0].tokenizer)
        prompts = [
            torch.randint(4, vocab, (12 + i % 3,), generator=gen).tolist()
            for i in range(args.prompts)
        ]
        for agents in args.agents:
            mine = engines[:agents]

            def merged(mine=mine, prompts=prompts) -> None:
                outs = mine[0].generate_mixed([(e, prompts) for e in mine], params)
                assert [len(o) for o in outs] == [len(prompts) * args.n] * len(mine)

            def apart(mine=mine, prompts=prompts) -> None:
                for e in mine:
                    assert len(e.generate(prompts, params)) == len(prompts) * args.n

            times: dict[str, list[float]] = {"merged": [], "apart": []}
            order = [("merged", merged), ("apart", apart)]
            for rnd in range(warmup + steps):
                for name, fn in order if rnd % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    fn()
                    if rnd >= warmup:
                        times[name].append(time.perf_counter() - t0)
                print(f"  {engine}, {agents} agents: round {rnd + 1}", file=sys.stderr)
            m, a = statistics.median(times["merged"]), statistics.median(times["apart"])
            results[f"{engine}/{agents}"] = {"merged_s": m, "apart_s": a, "ratio": a / m, **times}
            rows.append([engine, agents, agents * len(prompts) * args.n, a, m, f"{a / m:.2f}x"])
        for e in engines:
            if hasattr(e, "close"):
                e.close()
    print(
        c.table(
            ["engine", "agents", "rows", "one call per agent s", "one merged call s", "ratio"],
            rows,
        )
    )
    return results


# ------------------------------------------------------------------------------ driver
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--size", default="20M", choices=list(c.SIZES))
    p.add_argument("--agents", nargs="+", type=int, default=None, help="agent counts")
    p.add_argument("--prompts", type=int, default=4, help="prompts per agent")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument(
        "--minibatches",
        type=int,
        default=1,
        help="mini-batches per update (more than 1: old log-probs recomputed first)",
    )
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL to the base (reference pass)")
    p.add_argument(
        "--rollout-engines",
        nargs="*",
        default=["hf"],
        choices=["hf", "vllm"],
        help="engines of the rollout section (none: skip it)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return update_worker(json.loads(args.worker))
    threads, why = c.resolve_threads(args.threads)
    if args.quick:
        args.size = "0.3M" if args.size == "20M" else args.size
    args.agents = args.agents or ([2, 4] if args.quick else [2, 4, 8])
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    print("multi_lora: LoRA agents on one base, batched against one-by-one\n")
    info = c.print_machine(threads, why)
    model = c.build_model(args.size)
    print(f"\n{args.size} base ({c.fmt_params(c.param_count(model))} parameters)")
    results = {"machine": info, "size": args.size}
    results["update"] = update_case(args, threads, model, warmup, steps)
    if args.rollout_engines:
        results["rollout"] = rollout_case(args, threads, model, warmup, steps)
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
