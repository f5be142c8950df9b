"""Diffusion GRPO timing: one epoch split into sampling / reward / training, the cost of the
log-prob-recording sampler against diffusers' own pipeline, and a 2-step training window
against training every step.

    python benchmarks/diffusion_sampler.py                 # tiny SD3 built offline (CPU)
    python benchmarks/diffusion_sampler.py --size small    # a wider/deeper offline SD3
    python benchmarks/diffusion_sampler.py --family flux   # tiny FLUX (vs FluxPipeline)
    python benchmarks/diffusion_sampler.py --model PATH    # any local SD3 / FLUX checkpoint

Each measurement is the median of ``--repeats`` runs after a warm-up, in wall-clock and in
CPU time of this process (on a shared machine the CPU time is the steadier number; with
one thread it is the work done). Printed ratios:

- ``recording sampler / pipeline``: PolyRL's engine (SDE steps, per-step log-probs, every
  latent kept) over ``StableDiffusion3Pipeline`` / ``FluxPipeline`` with
  ``output_type="latent"``, the same transformer, prompt embeddings, steps, guidance, batch
  and starting noise (target <= 1.3);
- ``window(2) / all steps``: training time of one epoch with a 2-step window over all
  (steps - 1) trainable steps (ideal: 2 / (steps - 1)).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {  # builder arguments per family (tiny_sd3 / tiny_flux)
    "sd3": {
        "tiny": {"image_size": 16, "vae_patch": 2, "layers": 2, "heads": 2, "head_dim": 32},
        "small": {"image_size": 32, "vae_patch": 2, "layers": 4, "heads": 4, "head_dim": 32},
    },
    "flux": {
        "tiny": {
            "image_size": 16,
            "vae_patch": 2,
            "layers": 1,
            "single_layers": 2,
            "heads": 2,
            "head_dim": 32,
        },
        "small": {
            "image_size": 32,
            "vae_patch": 2,
            "layers": 2,
            "single_layers": 4,
            "heads": 4,
            "head_dim": 32,
        },
    },
}
SEQ_LEN = {"sd3": 1, "flux": 8}  # offline models: SD3 has no T5 (1 zero token); FLUX's T5


def median_time(fn, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds: medians over ``repeats`` calls after one warm-up call."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def make_policy(model: str, args, **engine):
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.diffusion.engine import DiffusionEngine, sampling_options
    from polyrl.diffusion.policy import DiffusionPolicy

    sampling = {
        "height": args.resolution,
        "width": args.resolution,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "batch_size": args.batch,
    }
    sampling.update(engine)
    cfg = from_dict(
        PolicyConfig,
        {
            "kind": "diffusion",
            "model": model,
            "lora": {"r": args.lora, "alpha": 2 * args.lora},
            "args": {"max_sequence_length": args.seq_len},
            "micro_batch_size": args.batch,
            "optim": {"lr": 1e-4},
            "engine": {"name": "diffusion", "args": sampling},
        },
    )
    policy = DiffusionPolicy("main", cfg, total_steps=100, need_reference=False, device=args.device)
    return policy, DiffusionEngine(policy, seed=0, **sampling_options(cfg))


def bench_pipeline_overhead(model: str, args) -> dict[str, float]:
    """Recording engine vs the family's diffusers pipeline at the same steps, batch, noise."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    from polyrl.diffusion.packed import pack_latents

    policy, engine = make_policy(model, args, train_steps={"mode": "all"})
    prompts = [f"a {c} blob" for c in ("red", "green", "blue", "yellow")]
    n = max(1, args.batch // len(prompts))
    flux = policy.family.name == "flux"
    if flux:
        pipe = FluxPipeline.from_pretrained(model, transformer=policy.family.transformer)
    else:
        pipe = StableDiffusion3Pipeline.from_pretrained(
            model, transformer=policy.family.transformer, text_encoder_3=None, tokenizer_3=None
        )
    pipe.to(policy.device)
    pipe.set_progress_bar_config(disable=True)
    emb, pooled = policy.encode([p for p in prompts for _ in range(n)])
    neg, neg_pooled = policy.encode([""] * emb.shape[0])
    shape = policy.family.latent_shape(args.resolution, args.resolution)
    latents = torch.randn((emb.shape[0], *shape))
    # FLUX: guidance goes to the guidance embedding (no negative branch); SD3: CFG
    extra = (
        {} if flux else {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled}
    )
    start = pack_latents(latents) if flux else latents

    def run_pipe():
        with torch.no_grad():
            pipe(
                prompt_embeds=emb,
                pooled_prompt_embeds=pooled,
                num_inference_steps=args.steps,
                guidance_scale=args.guidance,
                height=args.resolution,
                width=args.resolution,
                latents=start.to(policy.device),
                output_type="latent",
                **extra,
            )

    def run_engine():
        engine.sample(prompts, n=n)

    if policy.device.type == "cuda":
        run_pipe, run_engine = _synced(run_pipe), _synced(run_engine)
    (w_pipe, c_pipe), (w_engine, c_engine) = (
        median_time(run_pipe, args.repeats),
        median_time(run_engine, args.repeats),
    )
    return {
        "pipeline_s": w_pipe,
        "engine_s": w_engine,
        "ratio": w_engine / w_pipe,
        "pipeline_cpu_s": c_pipe,
        "engine_cpu_s": c_engine,
        "cpu_ratio": c_engine / c_pipe,
    }


def _synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()

    return run


def bench_epoch(model: str, args, selection: dict) -> dict[str, float]:
    """One GRPO epoch (rollout, reward, credit, update) on the colour task, timed by part."""
    from polyrl.core.rollout.rewards import RewardConfig, RewardTerm, score
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update
    from polyrl.diffusion.credit import PerPromptOptions, per_prompt_credit
    from polyrl.diffusion.workflow import diffusion_record

    policy, engine = make_policy(model, args, train_steps=selection)
    prompts = [f"a {c} blob" for c in ("red", "green", "blue", "yellow")]
    n = max(1, args.batch // len(prompts))
    reward_cfg = RewardConfig(terms=[RewardTerm("colour")])
    algo = AlgorithmConfig(clip_ratio_low=1e-4, clip_ratio_high=1e-4)
    parts: dict[str, list[float]] = {"sampling": [], "reward": [], "training": [], "cpu": []}
    for k in range(args.repeats + 1):
        c0 = time.process_time()
        t0 = time.perf_counter()
        traj = engine.sample(prompts, n=n)
        images = engine.decode(traj.latents[:, -1])
        rows = [prompts[i] for i in traj.prompt_index]
        rec = diffusion_record(
            traj,
            policy="main",
            uid=traj.prompt_index.tolist(),
            prompt_text=rows,
            meta=[{"images": [im]} for im in images],
        )
        t1 = time.perf_counter()
        score(rec, reward_cfg)
        per_prompt_credit(rec, algo, **PerPromptOptions())
        t2 = time.perf_counter()
        update(policy, rec, algo)
        t3 = time.perf_counter()
        if k:  # the first epoch is a warm-up
            parts["sampling"].append(t1 - t0)
            parts["reward"].append(t2 - t1)
            parts["training"].append(t3 - t2)
            parts["cpu"].append(time.process_time() - c0)
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["epoch"] = out["sampling"] + out["reward"] + out["training"]
    out["trained_steps"] = float(rec["loss_mask"].sum(1).float().mean())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="local SD3/FLUX checkpoint (default: build one)")
    p.add_argument(
        "--family",
        choices=sorted(SIZES),
        default="sd3",
        help="offline model to build when --model is not given",
    )
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="T5 tokens per prompt (default: what the offline model has)",
    )
    p.add_argument("--resolution", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--guidance", type=float, default=4.5)
    p.add_argument("--lora", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from diffusers.utils import logging as dlogging

    import polyrl.core  # noqa: F401
    import polyrl.diffusion  # noqa: F401
    from polyrl.diffusion.families import detect_family
    from polyrl.diffusion.models import quiet_diffusers
    from polyrl.diffusion.tiny import tiny_flux, tiny_sd3

    dlogging.set_verbosity_error()  # the pipeline notes that PatchVAE is no AutoencoderKL
    quiet_diffusers()  # no save/load progress bars

    family = detect_family(args.model) if args.model else args.family
    size = SIZES[family][args.size]
    args.resolution = args.resolution or size["image_size"]
    args.seq_len = args.seq_len or (256 if args.model else SEQ_LEN[family])
    build = {"sd3": tiny_sd3, "flux": tiny_flux}[family]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build(Path(tmp) / family, **size))
        dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        print(
            f"{family} model {args.model or args.size} | device {dev} | threads "
            f"{torch.get_num_threads()} | {args.resolution}px, {args.steps} steps, batch "
            f"{args.batch}, guidance {args.guidance}, LoRA r={args.lora}"
        )
        o = bench_pipeline_overhead(model, args)
        print(
            f"sampling  diffusers pipeline {o['pipeline_s']:.3f} s | recording engine "
            f"{o['engine_s']:.3f} s | recording sampler / pipeline = {o['ratio']:.2f}x wall, "
            f"{o['cpu_ratio']:.2f}x CPU (target <= 1.3)"
        )
        full = bench_epoch(model, args, {"mode": "all"})
        win = bench_epoch(model, args, {"mode": "window", "window_start": 0, "window_size": 2})
        for name, e in (("all steps", full), ("window(2)", win)):
            print(
                f"epoch [{name:9s}] {e['epoch']:.3f} s = sampling {e['sampling']:.3f} + reward "
                f"{e['reward']:.3f} + training {e['training']:.3f} "
                f"({e['trained_steps']:.0f} trained steps; {e['cpu']:.3f} CPU-s)"
            )
        ideal = win["trained_steps"] / full["trained_steps"]
        print(
            f"training time window(2) / all steps = {win['training'] / full['training']:.2f} "
            f"(proportional: {ideal:.2f}); epoch ratio = {win['epoch'] / full['epoch']:.2f} "
            f"wall, {win['cpu'] / full['cpu']:.2f} CPU"
        )


if __name__ == "__main__":
    main()
