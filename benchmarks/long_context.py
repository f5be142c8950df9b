"""Long shared contexts: the update with each shared prefix computed once.

One GRPO update (``polyrl.core.train.trainer.update``: ppo_clip, token-mean, one epoch, no
reference) over records whose rows share long prefixes:

- ``prompt N``: groups of 8 rows sharing one prompt of N tokens (256, 1,024, 4,096),
  responses of 16 to 64 tokens (uniform, seeded);
- ``multi-turn``: ``step`` rows of episodes of 8 turns of 128 tokens (a 32-token response
  and a 96-token observation per turn) after a 128-token task prompt the episodes share;
  turn t's row has the whole history before it as its prompt;
- ``vl image``: a Qwen2.5-VL of the 20M shape (language model 512 wide, 6 layers; a
  4-block, 128-wide vision tower), groups of 8 rows sharing one prompt of 16 text tokens,
  one 448x448 image (1,024 patches, 256 image tokens) and 24 more text tokens, responses
  of 16 to 64 tokens. ``packed`` is then today's VL pass (padded, the vision tower once per
  image) and ``limit`` the vision tower once and the distinct tokens as one sequence.

Contenders, each in its own fresh process, steps interleaved round-robin:

- ``packed``: today's packed pass (``shared_prefix: false``): every row's prefix again;
- ``shared``: the default (``shared_prefix: true``): each shared prefix once per
  micro-batch (``polyrl.core.train.prefix``);
- ``limit``: a bare PyTorch forward/backward over the distinct tokens only, each tree of
  rows as one plain causal sequence of its distinct tokens (no mask), the LM head on as
  many positions as there are response tokens, then clip and AdamW.

Printed per case: tokens (real tokens of the rows, distinct tokens), median wall and CPU
seconds per update, the peak memory an update adds (resident-set high-water mark after
the update minus before it; GPU: the allocator's peak) and the ratios packed / shared and
shared / limit, measured in the same run. Default sizes and record sizes keep a run within
about 20 minutes on a 2-core machine; the 4,096-token case runs at 0.3M only.

    .venv/bin/python benchmarks/long_context.py [--quick] [--sizes 0.3M 20M] [--cases ...]
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
from packing import _mark_mib, _peak_mib  # noqa: E402

TAG = "@@long_context@@"
PACKED, SHARED, LIMIT = "packed", "shared", "limit"
# case -> size -> groups (prompt cases) or episodes (multi-turn)
CASES = {
    "prompt 256": {"0.3M": 4, "20M": 2},
    "prompt 1024": {"0.3M": 2, "20M": 1},
    "prompt 4096": {"0.3M": 1},
    "multi-turn": {"0.3M": 4, "20M": 2},
    "vl image": {"20M": 1},
}
VL = "vl image"
VL_SHAPE = {  # the 20M text shape (_common.SIZES) under a Qwen2.5-VL, vision as vl_grpo_vs_trl
    "hidden_size": 512,
    "num_layers": 6,
    "num_heads": 8,
    "intermediate_size": 1536,
    "vision_depth": 4,
    "vision_hidden_size": 128,
    "vision_heads": 2,
    "vision_intermediate_size": 256,
    "max_position_embeddings": 2048,
}
VL_GRID = (1, 32, 32)  # a 448x448 image at patch 14: 1,024 patches, 256 tokens after merging


def _vl_model(size: str) -> str:
    """The VL case's model, built once under the benchmark cache."""
    import polyrl.multimodal  # noqa: F401
    from polyrl.multimodal.tiny import tiny_qwen2_5_vl

    if size != "20M":
        raise ValueError(f"the {VL} case runs at 20M only, not {size}")
    cache = Path(os.environ.get("POLYRL_BENCH_CACHE", "~/.cache/polyrl/bench")).expanduser()
    path = cache / "tiny-qwen2.5-vl-20m-v4x128"
    tiny_qwen2_5_vl(path, corpus="vl_shapes", seed=0, **VL_SHAPE)
    return str(path)


def _vl_params(path: str) -> int:
    """Parameters of the VL model (language model, vision tower, head)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def _vl_record(policy, count: int):
    """Groups of 8 rows on one image each (random pixels), seeded like :func:`_record`."""
    import torch

    from polyrl.core.record import set_strings, text_record
    from polyrl.multimodal.vision import VisionInputs

    tok = policy.tokenizer
    start, pad, end = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    )
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, 300, (n,), generator=gen).tolist()

    t, h, w = VL_GRID
    dim = 3 * 2 * 14 * 14
    prompts, responses, uid, visions = [], [], [], []
    for g in range(count):
        v = VisionInputs(
            f"image-{g}", torch.randn(t * h * w, dim, generator=gen), torch.tensor([VL_GRID])
        )
        p = ids(16) + [start] + [pad] * (t * h * w // 4) + [end] + ids(24)
        for _ in range(8):
            prompts.append(p)
            responses.append(ids(int(torch.randint(16, 65, (1,), generator=gen))))
            uid.append(g)
            visions.append(v)
    rec = text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[-1.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=uid,
        pad_id=tok.pad_token_id,
    )
    set_strings(rec, "vision", visions)
    width = rec["response_ids"].shape[1]
    rec["advantages"] = torch.randn(len(prompts), 1, generator=gen).expand(-1, width).contiguous()
    return rec


def _vl_limit(policy, rec):
    """The VL limit's sequences: per group, its prompt (image once) then every response."""
    import torch

    out = []
    for g in sorted(set(rec["uid"].tolist())):
        rows = (rec["uid"] == g).nonzero().flatten().tolist()
        first = rows[0]
        prompt = rec["prompt_ids"][first][rec["prompt_mask"][first].bool()]
        resp = [rec["response_ids"][i][rec["response_mask"][i].bool()] for i in rows]
        seq = torch.cat([prompt, *resp])
        out.append((seq, sum(len(r) for r in resp), policy.vision_rows(rec)[first]))
    return out


def _vl_bare_step(model, optimizer, seqs) -> None:
    """The VL limit: the vision tower once per image, each group's distinct tokens as one
    causal sequence (M-RoPE positions by the model's own rules), forward/backward."""
    import torch

    from polyrl.multimodal.forward import vl_forward

    for ids, n, v in seqs:
        ids = ids.to(next(model.parameters()).device)
        logits, _, _ = vl_forward(
            model, ids[None], torch.ones_like(ids)[None], [v], logits_to_keep=n + 1
        )
        logp = torch.log_softmax(logits[0, :-1].float(), -1)
        loss = -logp.gather(-1, ids[-n:, None]).mean() / len(seqs)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------ worker
def _record(tok, case: str, count: int):
    """The case's record, the same in every process (seeded)."""
    import torch

    from polyrl.core.record import text_record

    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, len(tok), (n,), generator=gen).tolist()

    prompts, responses, uid = [], [], []
    if case.startswith("prompt"):
        plen = int(case.split()[1])
        for g in range(count):
            p = ids(plen)
            for _ in range(8):
                prompts.append(p)
                responses.append(ids(int(torch.randint(16, 65, (1,), generator=gen))))
                uid.append(g)
    else:
        task = ids(128)
        for e in range(count):
            history = list(task)
            for _ in range(8):
                response = ids(32)
                prompts.append(list(history))
                responses.append(response)
                uid.append(e)
                history += response + ids(96)
    rec = text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[-1.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=uid,
        pad_id=tok.pad_token_id,
    )
    width = rec["response_ids"].shape[1]
    rec["advantages"] = torch.randn(len(prompts), 1, generator=gen).expand(-1, width).contiguous()
    return rec


def _bare_step(model, optimizer, seqs, targets) -> None:
    """The limit: each tree's distinct tokens as one causal sequence, forward/backward."""
    import torch

    for ids, n in zip(seqs, targets, strict=True):
        logits = model(input_ids=ids[None], logits_to_keep=n + 1, use_cache=False).logits
        logp = torch.log_softmax(logits[0, :-1].float(), -1)
        loss = -logp.gather(-1, ids[-n:, None]).mean() / len(seqs)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def worker(spec: dict) -> None:
    """Build one contender, then answer ``step`` lines on stdin with one tagged JSON line."""
    import torch

    from polyrl.core.train import prefix, trainer
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.passes import prefix_units
    from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig

    c.set_threads(spec["threads"])
    device = spec["device"]
    bare = spec["name"] == LIMIT
    vl = spec["case"] == VL
    cfg = PolicyConfig(
        model=spec["model"],
        kind="qwen_vl" if vl else "causal_lm",
        optim=OptimConfig(lr=1e-6),
        device=device,
        dtype=spec["dtype"],
        shared_prefix=spec["name"] != PACKED,
    )
    if vl:
        from polyrl.multimodal.policy import QwenVLPolicy

        policy = QwenVLPolicy("main", cfg, total_steps=1000, need_reference=False)
        rec = _vl_record(policy, spec["count"])
    else:
        policy = CausalLMPolicy("main", cfg, total_steps=1000, need_reference=False)
        rec = _record(policy.tokenizer, spec["case"], spec["count"])
    for p in policy.model.parameters():  # optimizer state exists before the memory mark
        p.grad = torch.zeros_like(p)
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    if vl:  # distinct tokens: each group's prompt once and its responses
        vl_seqs = _vl_limit(policy, rec)
        units = [prefix.Unit([0], [0], len(s)) for s, _, _ in vl_seqs]
    else:
        units = prefix_units(policy.model, rec, cfg.shared_prefix_min_tokens)
    tokens, lengths = prefix.row_tokens(rec)
    seqs, targets = [], []
    if bare and not vl:
        for u in units:
            lay = prefix.tree_layout([u], tokens, lengths.tolist(), len(lengths))
            seqs.append(lay.ids[0, : u.distinct].to(device))
            targets.append(int(rec["response_mask"][u.rows].sum()))
    info = {
        "rows": len(rec),
        "real_tokens": int(lengths.sum()),
        "distinct_tokens": sum(u.distinct for u in units),
        "trees": len(vl_seqs) if vl else sum(u.shared for u in units),
        "mark_mib": _mark_mib(device),
    }
    print(TAG + json.dumps(info), flush=True)
    algo = AlgorithmConfig()
    for line in sys.stdin:
        if json.loads(line).get("op") != "step":
            break
        w0, c0 = time.perf_counter(), time.process_time()
        if bare:
            policy.model.train(True)
            if vl:
                _vl_bare_step(policy.model, policy.optimizer, vl_seqs)
            else:
                _bare_step(policy.model, policy.optimizer, seqs, targets)
            policy.model.train(False)
        else:
            trainer.update(policy, rec, algo)
        peak = _peak_mib(device)
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
            [sys.executable, __file__, "--worker", json.dumps({**spec, "name": name})],
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
    p.add_argument("--sizes", nargs="+", default=None, choices=["0.3M", "20M"])
    p.add_argument("--cases", nargs="+", default=None, choices=list(CASES))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    threads, why = c.resolve_threads(args.threads)
    sizes = args.sizes or (["0.3M"] if args.quick else ["0.3M", "20M"])
    cases = args.cases or (["prompt 256", "multi-turn"] if args.quick else list(CASES))
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    print("long_context: one GRPO update over rows sharing long prefixes\n")
    info = c.print_machine(threads, why)
    print(f"\n{warmup} warm-up + {steps} timed updates per contender, interleaved round-robin")
    results: dict = {"machine": info, "sizes": {}}
    for size in sizes:
        text_cases = [k for k in cases if k != VL and size in CASES[k]]
        model = c.build_model(size) if text_cases else None
        if model:
            print(f"\n{size} ({c.fmt_params(c.param_count(model))} parameters)")
        rows, ratios = [], []
        for case in cases:
            count = CASES[case].get(size)
            if count is None:
                continue
            if case == VL:
                model = _vl_model(size)
                print(f"\n{size} VL ({c.fmt_params(_vl_params(model))} parameters)")
            spec = {
                "model": model,
                "threads": threads,
                "device": args.device,
                "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
                "case": case,
                "count": count,
            }
            procs = {name: Contender(name, spec) for name in (PACKED, SHARED, LIMIT)}
            times: dict[str, list[dict]] = {name: [] for name in procs}
            names = list(procs)
            for rnd in range(warmup + steps):
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                for name in order:
                    out = procs[name].step()
                    if rnd >= warmup:
                        times[name].append(out)
                print(f"  {case}: round {rnd + 1}/{warmup + steps}", file=sys.stderr, flush=True)
            for proc in procs.values():
                proc.close()
            per = {}
            for name, proc in procs.items():
                per[name] = {
                    "wall_s": c.median_of(times[name], "wall_s"),
                    "cpu_s": c.median_of(times[name], "cpu_s"),
                    "update_mib": max(t["peak_mib"] for t in times[name]) - proc.info["mark_mib"],
                    **proc.info,
                }
            first = per[PACKED]
            unit = "episodes" if case == "multi-turn" else "groups"
            label = f"{case} ({unit} {count})"
            for name in names:
                r = per[name]
                rows.append([label, name, first["rows"], r["wall_s"], r["cpu_s"], r["update_mib"]])
            pk, sh, lim = per[PACKED], per[SHARED], per[LIMIT]
            ratios.append(
                [
                    label,
                    first["real_tokens"],
                    first["distinct_tokens"],
                    pk["wall_s"] / sh["wall_s"],
                    pk["cpu_s"] / sh["cpu_s"],
                    sh["wall_s"] / lim["wall_s"],
                    sh["cpu_s"] / lim["cpu_s"],
                    pk["update_mib"] / max(sh["update_mib"], 1e-9),
                ]
            )
            results["sizes"].setdefault(size, {})[case] = {"contenders": per, "steps": times}
        print(c.table(["case", "contender", "rows", "wall s", "cpu s", "update MiB"], rows))
        print(
            c.table(
                [
                    "case",
                    "real tokens",
                    "distinct",
                    "packed/shared wall",
                    "cpu",
                    "shared/limit wall",
                    "cpu",
                    "packed/shared MiB",
                ],
                ratios,
            )
        )
    c.write_json(args.json, results)


if __name__ == "__main__":
    main()
