"""PolyRL vs TRL's GRPOTrainer on a tiny Qwen2.5-VL: seconds per GRPO step.

Same model, same data, same reward, in two setups (``SETUPS``): ``demo`` is the README
demo's tiny Qwen2.5-VL (built offline; its vision tower is 1 block, 32 wide) on 112x112
vl_shapes colour questions (16 image tokens each); ``vision`` keeps the language model and
gives it a 4-block, 128-wide vision tower and 224x224 images (64 image tokens), so that
how often a trainer runs the vision tower shows. Same reward (``_common.digit_share``:
unlike exact match, which is 0 for every sample of the untrained model and so leaves
every advantage 0, it varies within groups, so both updates do real work), group size 8,
16 prompts per step, up to 3 new tokens, temperature 1, lr 1e-6 (the policy barely moves,
so both sample near-identical lengths), grad-norm clip 1, one update per rollout over all
128 rows (PolyRL micro_batch_size=128; TRL per_device_train_batch_size=128), no reference
model (kl_coef=0 / beta=0), fp32, TRL without vLLM and without gradient checkpointing.

A PolyRL step is ``time/step_s`` of core/loop.py (VL rollout with the hf_vl engine ->
rewards -> credit -> update -> sync). A TRL step is one optimizer step of
``trainer.train()``, from ``on_step_begin`` to ``on_step_end``. The two contenders run at
the same time, each in its own single-threaded process, so machine load hits both alike;
the median step after warm-up is reported.

Host memory against dataset size (lazy image loading) is measured by vl_memory.py.

    .venv/bin/python benchmarks/vl_grpo_vs_trl.py [--steps 8] [--warmup 2] [--quick]
                                                  [--setups demo vision]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

CACHE = Path(os.environ.get("POLYRL_BENCH_CACHE", "~/.cache/polyrl/bench")).expanduser()
# Setups: "demo" is the README demo's model and images (a vision tower of 1 block, 32 wide:
# its cost is negligible next to the language model's); "vision" gives the same language
# model a vision tower of 4 blocks, 128 wide, and 224x224 images (64 image tokens), so
# that what a trainer does with the images (how often it runs the tower) shows.
SETUPS = {
    "demo": {
        "model": "tiny-qwen2.5-vl-shapes",
        "size": 112,
        "max_pixels": 112 * 112,
        "build": {"vision_depth": 1, "vision_hidden_size": 32},
    },
    "vision": {
        "model": "tiny-qwen2.5-vl-shapes-v4x128-224",
        "size": 224,
        "max_pixels": 224 * 224,
        "build": {
            "vision_depth": 4,
            "vision_hidden_size": 128,
            "vision_heads": 2,
            "vision_intermediate_size": 256,
        },
    },
}
BUILD = {"corpus": "vl_shapes", "hidden_size": 128, "num_layers": 2, "num_heads": 4, "seed": 0}
TASK = {"question": "colour", "distractors": 0, "shape_size": [0.4, 0.6]}
MIN_PIXELS = 56 * 56
TAG = "VLBENCH "


def build(n_rows: int, setup: str = "demo") -> tuple[str, str]:
    """(model dir, train.jsonl) of a setup, built once under the benchmark cache."""
    import polyrl.multimodal  # noqa: F401
    from polyrl.multimodal import shapes
    from polyrl.multimodal.tiny import tiny_qwen2_5_vl

    st = SETUPS[setup]
    model = CACHE / st["model"]
    tiny_qwen2_5_vl(
        model, min_pixels=MIN_PIXELS, max_pixels=st["max_pixels"], **BUILD, **st["build"]
    )
    data = CACHE / (
        f"vl-shapes-{n_rows}" if st["size"] == 112 else f"vl-shapes-{st['size']}px-{n_rows}"
    )
    if not (data / "train.jsonl").is_file():
        shapes.write_dataset(data, n_train=n_rows, n_eval=1, seed=0, size=st["size"], **TASK)
    return str(model), str(data / "train.jsonl")


# --------------------------------------------------------------------------- contenders


def run_polyrl(model: str, data: str, steps: int, out: str, setup: str = "demo") -> list[float]:
    import polyrl.core  # noqa: F401
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    reward = c.register_bench_reward()
    data_cfg = {
        "kind": "vl",
        "path": data,
        "args": {"min_pixels": MIN_PIXELS, "max_pixels": SETUPS[setup]["max_pixels"]},
        "max_prompt_tokens": 128,
    }
    cfg = load(
        Config,
        None,
        [
            f"run.dir={out}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            f"policies.main.model={model}",
            "policies.main.kind=qwen_vl",
            "policies.main.engine.name=hf_vl",
            "policies.main.optim.lr=1e-6",
            "policies.main.micro_batch_size=128",
            f"data={json.dumps(data_cfg)}",
            "rollout.workflow=vl_single_turn",
            "rollout.n=8",
            "rollout.prompts_per_step=16",
            "rollout.max_new_tokens=3",
            f"train.steps={steps}",
            "run.samples_per_step=0",
            f"reward.terms={json.dumps([{'name': reward}])}",
        ],
    )
    run = train(cfg)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step_s"] for r in rows if r.get("time/step_s") is not None]


def run_trl(model: str, data: str, steps: int, out: str) -> list[float]:
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl.core.rollout.rewards import Sample

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    root = Path(data).parent
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    ds = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"].replace("<image>", "")}],
                "image": str(root / r["images"][0]),
                "answer": r["answer"],
            }
            for r in rows
        ]
    ).cast_column("image", datasets.Image())

    def reward(prompts, completions, answer, **_):
        texts = [x[-1]["content"] if isinstance(x, list) else x for x in completions]
        return [
            c.digit_share(Sample(prompt="", response=t, answer=a, meta={}))
            for t, a in zip(texts, answer, strict=True)
        ]

    cfg = GRPOConfig(
        output_dir=out,
        num_generations=8,
        per_device_train_batch_size=128,
        gradient_accumulation_steps=1,
        max_completion_length=3,
        beta=0.0,
        num_iterations=1,
        use_vllm=False,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        bf16=False,
        fp16=False,
        max_steps=steps,
        learning_rate=1e-6,
        temperature=1.0,
        top_p=1.0,
        shuffle_dataset=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        mask_truncated_completions=False,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
    )
    net = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(model)
    trainer = GRPOTrainer(
        model=net, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=proc
    )
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    trainer.add_callback(Clock())
    trainer.train()
    return times


# --------------------------------------------------------------------------- driver


def child(kind: str, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    out = tempfile.mkdtemp(prefix=f"vlbench-{kind}-")
    if kind == "polyrl":
        res = {
            "times": run_polyrl(args.model, args.data, args.warmup + args.steps, out, args.setup)
        }
    else:
        res = {"times": run_trl(args.model, args.data, args.warmup + args.steps, out)}
    print(TAG + json.dumps(res), flush=True)


def spawn(kind: str, model: str, data: str, args: argparse.Namespace) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--model",
        model,
        "--data",
        data,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--setup",
        args.setup,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def collect(name: str, proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate()
    for line in stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads per contender")
    p.add_argument("--quick", action="store_true", help="3 timed steps")
    p.add_argument(
        "--setups",
        nargs="+",
        default=list(SETUPS),
        choices=list(SETUPS),
        help="demo: the README demo's model; vision: a 4-block vision tower and 224x224 images",
    )
    p.add_argument("--setup", default="demo", help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args)
        return
    if args.quick:
        args.steps = 3
    import torch
    import transformers
    import trl

    print("vl_grpo_vs_trl: seconds per GRPO step, tiny Qwen2.5-VL, 16 prompts x 8 samples\n")
    print(
        f"  torch {torch.__version__}, transformers {transformers.__version__}, trl "
        f"{trl.__version__}, {os.cpu_count()} CPUs, {args.threads} thread(s) per contender, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for setup in args.setups:
        args.setup = setup
        model, data = build(256, setup)
        st = SETUPS[setup]
        print(f"\n  setup {setup!r}: {st['build']}, {st['size']}x{st['size']} images")
        procs = {
            "PolyRL (hf_vl engine)": spawn("polyrl", model, data, args),
            "TRL GRPOTrainer": spawn("trl", model, data, args),
        }
        medians = {}
        for name, proc in procs.items():
            times = collect(name, proc)["times"][args.warmup :]
            medians[name] = statistics.median(times)
            print(
                f"  {name:<24} median {medians[name]:.3f} s/step over {len(times)} steps "
                f"(min {min(times):.3f}, max {max(times):.3f})"
            )
        ratio = medians["TRL GRPOTrainer"] / medians["PolyRL (hf_vl engine)"]
        print(f"  ratio TRL / PolyRL ({setup}): {ratio:.2f}x (target: >= 2x)")
    print(f"\n  load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
