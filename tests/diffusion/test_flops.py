"""FLOPs of a denoising step (polyrl.diffusion.flops) against torch's own FLOP counter and a
hand count, and a diffusion run's images/s, TFLOP and MFU against a hand computation."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import SD3Transformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from polyrl.core.observe.throughput import device_peak
from polyrl.core.observe.timeline import read_run
from polyrl.diffusion.flops import sd3_call_flops

# the conftest's tiny SD3: latents [12, 8, 8] (16 px, pixel-unshuffle by 2), patch 2 -> 16
# image tokens; 8 CLIP tokens + the one zero T5 token -> 9 prompt tokens; one block, d = 32
TINY_CALL = (
    2 * 16 * 12 * 4 * 32  # patch embedding
    + 2 * 16 * 32 * 4 * 12  # projection out
    + 2 * 9 * 64 * 32  # prompt projection
    + 2 * (256 * 32 + 32 * 32 + 32 * 32 + 32 * 32)  # timestep and pooled embeddings
    + 2 * 16 * 4 * 32 * 32  # the one (last) block: image q, k, v, out
    + 2 * 9 * 3 * 32 * 32  # prompt q, k, v (no out projection in the last block)
    + 4 * (16 + 9) ** 2 * 32  # joint attention: scores and weighted sum
    + 2 * 16 * 8 * 32 * 32  # the image MLP (the prompt's ends before the last block's)
    + 2 * 32 * (6 * 32 + 2 * 32)  # adaptive norms' modulation
    + 2 * 32 * 2 * 32  # the final norm's
)


@pytest.mark.parametrize("dual", [(), (0,)])
def test_a_call_costs_what_torchs_flop_counter_counts(dual):
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        caption_projection_dim=16,
        pooled_projection_dim=6,
        out_channels=4,
        dual_attention_layers=dual,  # SD3.5's second, image-only attention
    )
    # the math attention kernel is plain matrix products, which the counter sees
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(
            hidden_states=torch.zeros(1, 4, 8, 6),
            timestep=torch.ones(1),
            encoder_hidden_states=torch.zeros(1, 5, 12),
            pooled_projections=torch.zeros(1, 6),
        )
    assert sd3_call_flops(model.config, (4, 8, 6), 5) == fc.get_total_flops()


def test_the_tiny_models_call_is_the_hand_count(tiny_sd3_dir):
    config = SD3Transformer2DModel.load_config(tiny_sd3_dir, subfolder="transformer")
    model = SD3Transformer2DModel.from_config(config)
    assert sd3_call_flops(model.config, (12, 8, 8), 9) == TINY_CALL == 706688


def test_a_diffusion_runs_metrics_hold_images_per_second_and_mfu(diffusion_config):
    from polyrl.core.loop import train

    run = train(
        diffusion_config(
            "train.steps=1",
            "run.export=false",
            "algorithm.ppo_epochs=2",  # the update's old log-prob pass runs too
            "algorithm.kl_coef=0.01",  # and the reference pass
            "algorithm.kl_estimator=gaussian_mean",
            "algorithm.skip_zero_advantage=false",  # every valid row trains
            "run.trace_every=1",
        )
    )
    # the engine's sampling is a generate span of the rollout (engine busy figures)
    spans = [e for e in read_run(run.path) if e.get("ph") == "X"]
    (rollout,) = [e for e in spans if e["name"] == "rollout"]
    calls = [e for e in spans if e["name"] == "generate" and e["args"]["engine"] == "main"]
    assert [e["args"]["requests"] for e in calls] == [12]  # 3 prompts x 4 images
    assert rollout["ts"] <= calls[0]["ts"] <= rollout["ts"] + rollout["dur"]
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "time/step_s" in r]
    images = 3 * 4  # prompts_per_step x rollout.n
    assert step["perf/main/images"] == images
    assert step["perf/images_per_s"] == pytest.approx(images / step["time/step_s"])
    assert "perf/gen_tokens_per_s" not in step  # no token policy in this run
    # each image: 4 sampled steps x 2 calls (guidance 2: classifier-free); 2 trained steps
    # (fraction 0.5 of the 3 after the first) x 2 epochs x (forward + backward: 3 calls, and
    # the unconditional call); the old and reference passes: 2 x 2 steps x 2 calls
    calls = images * (4 * 2 + 2 * 2 * (3 + 1) + 2 * 2 * 2)
    assert step["perf/tflops"] == pytest.approx(calls * TINY_CALL / 1e12, rel=1e-12)
    peak = device_peak("cpu")[0]
    assert step["perf/mfu"] == pytest.approx(calls * TINY_CALL / (step["time/step_s"] * peak))
    assert 0 < step["perf/main/mfu"] < 1
