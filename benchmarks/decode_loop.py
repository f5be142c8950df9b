"""The decode loop against transformers' own ``generate``, and one tree's loop against another's.

Equal work: greedy, the same left-padded batch of distinct prompts, the same
``max_new_tokens``, KV cache on, models that never emit EOS (``_common.forbid_tokens``, so
no row stops early and the batch never shrinks). PolyRL's side is the engine's whole
``generate`` call (the loop, log-probs, completions and their text); transformers' side is
``model.generate(do_sample=False)`` on the same padded ids (images: the same pixel values,
grids and placeholder marks). Text: the benchmark Qwen2 of ``--size``; VL: a tiny Qwen2.5-VL
(two images of different sizes per batch and one text prompt), through the ``hf_vl`` engine.

``--trees A B ...``: source trees to time PolyRL's loop in (each a folder holding ``core/``,
``multimodal/``, ... and ``polyrl/__init__.py``, e.g. ``git archive <commit> | tar -x -C
A``); default: this checkout. Each tree runs in its own worker process (the tree first on
``sys.path``), all workers built first, then steps interleaved round-robin, so the old/new
ratio and each tree's loop/generate ratio come from one run. Models are built once by this
checkout and loaded from the cache by every tree.

    .venv/bin/python benchmarks/decode_loop.py [--quick] [--trees /tmp/old /tmp/new]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    CACHE,
    HERE,
    build_model,
    forbid_tokens,
    print_machine,
    resolve_threads,
    table,
    write_json,
)

PACKAGES = ("core", "agents", "marl", "multimodal", "diffusion")
VL_SIZES = dict(
    corpus="vl_shapes",
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    vision_depth=1,
    vision_hidden_size=32,
    seed=0,
)


def build_vl_model() -> str:
    """A tiny Qwen2.5-VL that never emits EOS or PAD (built once, then cached)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from polyrl.multimodal.tiny import is_complete, tiny_qwen2_5_vl

    path = CACHE / "qwen2.5-vl-tiny-noeos"
    if is_complete(path):
        return str(path)
    tmp = Path(tempfile.mkdtemp(prefix=".vl.", dir=CACHE))
    built = tiny_qwen2_5_vl(tmp / "model", **VL_SIZES)
    model = AutoModelForImageTextToText.from_pretrained(built, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(built)
    forbid_tokens(model, [tok.eos_token_id, tok.pad_token_id])
    model.save_pretrained(built)
    os.replace(built, path)
    return str(path)


# ------------------------------------------------------------------------------ worker


class Worker:
    """One tree's side: PolyRL's engine and transformers' generate on the same batches."""

    def __init__(self, text_path: str, vl_path: str | None, batch: int, tokens: int) -> None:
        import torch

        from polyrl.core.config import from_dict
        from polyrl.core.record import pad_left
        from polyrl.core.rollout.engine import HFEngine, SamplingParams
        from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

        self.params = SamplingParams(temperature=0, max_new_tokens=tokens)
        self.tokens = tokens
        cfg = from_dict(PolicyConfig, {"model": text_path})
        policy = CausalLMPolicy("main", cfg, total_steps=10, need_reference=False)
        tok = policy.tokenizer
        texts = [f"{3 * i + 1}+{i * i}=" + "?" * (i % 5) for i in range(batch)]
        self.text_prompts = [tok.encode(t) for t in texts]
        ids, mask = pad_left(self.text_prompts, tok.pad_token_id)
        self.text = (
            HFEngine(policy, seed=0),
            policy.model,
            {"input_ids": ids, "attention_mask": mask},
        )
        self.pad = tok.pad_token_id
        self.vl = None
        if vl_path is not None:
            self.vl = self._vl(vl_path, batch, torch, pad_left)

    def _vl(self, path: str, batch: int, torch, pad_left):
        from PIL import Image

        import polyrl.multimodal  # noqa: F401
        from polyrl.core.config import from_dict
        from polyrl.core.rollout.engine import Request
        from polyrl.core.train.policy import PolicyConfig
        from polyrl.multimodal.engine import VLEngine
        from polyrl.multimodal.policy import QwenVLPolicy
        from polyrl.multimodal.vision import VisionInputs

        cfg = from_dict(PolicyConfig, {"model": path, "kind": "qwen_vl"})
        policy = QwenVLPolicy("main", cfg, total_steps=10, need_reference=False)
        proc = policy.processor
        requests, pixels, grids = [], [], []
        for i in range(batch):
            if i % 3 == 2:  # a text prompt
                got = proc(text=[f"How many sides has shape {i}?"], return_tensors="pt")
                requests.append(Request(got["input_ids"][0].tolist()))
                continue
            size = (56, 56) if i % 3 == 0 else (112, 84)
            image = Image.new("RGB", size, (20 * i % 256, 90, 200))
            got = proc(
                text=[f"{proc.image_token}What colour is it, {i}?"],
                images=[image],
                return_tensors="pt",
            )
            v = VisionInputs(f"p{i}", got["pixel_values"], got["image_grid_thw"])
            requests.append(Request(got["input_ids"][0].tolist(), vision=v))
            pixels.append(got["pixel_values"])
            grids.append(got["image_grid_thw"])
        ids, mask = pad_left([r.prompt for r in requests], policy.tokenizer.pad_token_id)
        kinds = (ids == policy.model.config.image_token_id).int()
        inputs = {
            "input_ids": ids,
            "attention_mask": mask,
            "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.cat(grids),
            "mm_token_type_ids": kinds,
        }
        return VLEngine(policy, seed=0), policy.model, inputs, requests

    def step(self, what: str) -> dict:
        import torch

        kind, side = what.split("/")
        if kind == "text":
            engine, model, inputs = self.text
            prompts = self.text_prompts
        else:
            assert self.vl is not None
            engine, model, inputs, prompts = self.vl
        with torch.no_grad():
            t0 = time.perf_counter()
            if side == "polyrl":
                outs = engine.generate(prompts, self.params)
                lengths = [len(c.token_ids) for c in outs]
            else:
                out = model.generate(
                    **inputs,
                    max_new_tokens=self.tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=self.pad,
                )
                lengths = [out.shape[1] - inputs["input_ids"].shape[1]] * len(out)
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": sum(lengths), "min_len": min(lengths)}


def serve(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    worker = Worker(spec["text"], spec["vl"], spec["batch"], spec["tokens"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(worker.step(line.strip())), flush=True)


def tree_path(tree: Path) -> str:
    """A folder whose ``polyrl`` package is ``tree`` (links to its source folders)."""
    root = Path(tempfile.mkdtemp(prefix="decode-loop-tree-"))
    pkg = root / "polyrl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text((tree / "polyrl" / "__init__.py").read_text())
    for name in PACKAGES:
        if (tree / name).is_dir():
            (pkg / name).symlink_to(tree / name)
    return str(root)


class Remote:
    def __init__(self, name: str, tree: Path | None, spec: dict) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([tree_path(tree), str(HERE)])
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            bufsize=1,
        )
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} ended (see its stderr above)")
        return json.loads(line)

    def step(self, what: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 0.3M, 2 timed steps")
    p.add_argument("--size", default=None, help="text model size (default 20M; quick: 0.3M)")
    p.add_argument("--batch", type=int, default=16, help="prompts per call")
    p.add_argument("--tokens", type=int, default=64, help="max_new_tokens (every row runs them)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 7; quick: 2)")
    p.add_argument("--no-vl", action="store_true", help="text only")
    p.add_argument("--trees", nargs="*", default=None, help="source trees (default: this one)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(json.loads(args.serve))
    threads, why = resolve_threads(args.threads)
    print_machine(threads, why)
    size = args.size or ("0.3M" if args.quick else "20M")
    steps = args.steps or (2 if args.quick else 7)
    if args.quick:
        args.batch, args.tokens = min(args.batch, 6), min(args.tokens, 16)
    spec = {
        "text": build_model(size),
        "vl": None if args.no_vl else build_vl_model(),
        "batch": args.batch,
        "tokens": args.tokens,
        "threads": threads,
    }
    trees = [Path(t).resolve() for t in args.trees] if args.trees else [None]
    names = [str(t) if t is not None else "this checkout" for t in trees]
    workers = [Remote(n, t, spec) for n, t in zip(names, trees, strict=True)]
    kinds = ["text"] + ([] if args.no_vl else ["vl"])
    plan = [(w, f"{k}/{s}") for k in kinds for w in workers for s in ("polyrl", "generate")]
    times: dict[tuple[str, str], list[float]] = {(w.name, what): [] for w, what in plan}
    lengths: dict[tuple[str, str], int] = {}
    for r in range(args.warmup + steps):
        for w, what in plan[r % len(plan) :] + plan[: r % len(plan)]:  # rotate the order
            got = w.step(what)
            lengths[(w.name, what)] = got["min_len"]
            if r >= args.warmup:
                times[(w.name, what)].append(got["seconds"])
    for w in workers:
        w.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\nDecode: {size} text model, tiny Qwen2.5-VL; {args.batch} prompts, greedy, "
        f"{args.tokens} new tokens per row; median of {steps} steps (s)"
    )
    rows = []
    for name in names:
        for k in kinds:
            ours, theirs = med[(name, f"{k}/polyrl")], med[(name, f"{k}/generate")]
            shortest = min(lengths[(name, f"{k}/polyrl")], lengths[(name, f"{k}/generate")])
            rows.append([name, k, f"{ours:.3f}", f"{theirs:.3f}", f"{ours / theirs:.3f}", shortest])
    print(
        table(["tree", "model", "PolyRL s", "generate s", "PolyRL/generate", "min resp len"], rows)
    )
    if len(names) > 1:
        print("\nPolyRL loop, each tree / the first:")
        for name in names[1:]:
            for k in kinds:
                ratio = med[(name, f"{k}/polyrl")] / med[(names[0], f"{k}/polyrl")]
                print(f"  {k}: {name} / {names[0]} = {ratio:.3f}")
    write_json(args.json, {"spec": spec, "times": {f"{a}|{b}": v for (a, b), v in times.items()}})


if __name__ == "__main__":
    main()
