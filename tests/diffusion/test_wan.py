"""Text-to-video on Wan: diffusers' WanPipeline reproduced, exact log-probs on video latents,
the frame-wise PatchVAE, the video rewards against hand computations, a two-step run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

WAN_ARGS = {"steps": 4, "guidance_scale": 1.0, "frames": 4}
PROMPTS = ["red, then blue", "green then yellow"]


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory) -> str:
    """An untrained tiny Wan 2.1 with a (random) AutoencoderKLWan, as WanPipeline loads it."""
    from polyrl.diffusion.tiny import tiny_wan

    return str(tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan", vae="wan", seed=0))


@pytest.fixture(scope="module")
def tiny_wan_patch_dir(tmp_path_factory) -> str:
    """An untrained tiny Wan 2.1 with the frame-wise PatchVideoVAE (the demo's layout)."""
    from polyrl.diffusion.tiny import tiny_wan

    return str(tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan-patch", seed=0))


@pytest.fixture
def wan_policy(make_policy, tiny_wan_dir):
    def make(**kw):
        args = dict(WAN_ARGS, model=tiny_wan_dir, max_sequence_length=8)
        args.update(kw)
        return make_policy(**args)

    return make


def test_wan_checkpoint_layout(tiny_wan_dir, tiny_wan_patch_dir):
    from diffusers import AutoencoderKLWan, WanPipeline

    from polyrl.diffusion.families import detect_family
    from polyrl.diffusion.patch_vae import PatchVideoVAE
    from polyrl.diffusion.wan import WanFamily

    assert detect_family(tiny_wan_dir) == detect_family(tiny_wan_patch_dir) == "wan"
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    assert isinstance(pipe.vae, AutoencoderKLWan)
    fam = WanFamily(tiny_wan_patch_dir, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(fam.vae, PatchVideoVAE)
    assert fam.latent_shape(16, 16, 4) == (12, 4, 8, 8)
    with pytest.raises(ValueError, match="multiples of 4"):
        fam.latent_shape(18, 16, 4)
    with pytest.raises(ValueError, match="T5|UMT5"):
        WanFamily(tiny_wan_dir, dtype=torch.float32, device=torch.device("cpu"), load_t5=False)


def test_patch_video_vae_is_framewise_pixel_unshuffle():
    """Each frame's 2x2 pixel patches become channels (c, dy, dx order), and back."""
    from polyrl.diffusion.patch_vae import PatchVideoVAE

    vae = PatchVideoVAE(patch=2)
    x = torch.randn(2, 3, 5, 4, 6)
    z = vae.encode(x).latent_dist.sample()
    assert z.shape == (2, 12, 5, 2, 3)
    b, c, f, dy, dx, i, j = 1, 2, 3, 1, 0, 1, 2
    assert z[b, c * 4 + dy * 2 + dx, f, i, j] == x[b, c, f, 2 * i + dy, 2 * j + dx]
    assert torch.equal(vae.decode(z).sample, x)
    assert vae.config.z_dim == 12 and vae.config.scale_factor_spatial == 2
    assert vae.config.scale_factor_temporal == 1


def test_ode_reproduces_wan_pipeline_with_guidance(wan_policy, tiny_wan_dir):
    """Noise off, classifier-free guidance on: every latent of the engine's trajectory equals
    WanPipeline's, bit for bit, and the decoded video equals the pipeline's (the VAE's
    per-channel latents_mean / latents_std undone as WanPipeline does)."""
    from diffusers import WanPipeline

    policy, engine = wan_policy(guidance_scale=3.0, cfg_batch=False, negative_prompt="blue")
    traj = engine.sample(PROMPTS, n=2, deterministic=True)
    emb, _ = policy.encode([PROMPTS[i] for i in traj.prompt_index])
    neg, _ = policy.encode(["blue"] * len(traj.prompt_index))
    assert traj.latents.shape == (4, 5, 4, 4, 8, 8)  # [B, N+1, C, F, h, w]
    pipe = WanPipeline.from_pretrained(tiny_wan_dir, transformer=policy.family.transformer)
    pipe.set_progress_bar_config(disable=True)
    stats = torch.tensor(pipe.vae.config.latents_std)
    assert not torch.allclose(stats, torch.ones_like(stats))  # the normalisation matters
    seen = []

    def keep(pipeline, i, t, kw):
        seen.append(kw["latents"].clone())
        return {}

    kw = dict(
        prompt_embeds=emb,
        negative_prompt_embeds=neg,
        latents=traj.latents[:, 0].clone(),
        num_inference_steps=4,
        guidance_scale=3.0,
        height=16,
        width=16,
        num_frames=4,
    )
    with torch.no_grad():
        out = pipe(**kw, output_type="latent", callback_on_step_end=keep).frames
        video = pipe(**kw, output_type="pt").frames  # [B, F, 3, H, W] in [0, 1]
    assert torch.equal(pipe.scheduler.sigmas, traj.sigmas[0])
    for t, lat in enumerate(seen):
        assert torch.equal(lat, traj.latents[:, t + 1]), f"step {t}"
    assert torch.equal(out, traj.latents[:, -1])
    decoded = engine.decode(traj.latents[:, -1])
    assert decoded.shape == (4, 3, 4, 16, 16)
    torch.testing.assert_close(decoded.permute(0, 2, 1, 3, 4), video, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_recomputed_logprobs_equal_the_rollouts_and_train(wan_policy, record_of, sampler):
    """Video latents: the first PPO ratio is exactly 1, the LoRA reference equals the
    policy, and a loss on the log-probs reaches the adapter."""
    policy, engine = wan_policy(lora=4, need_reference=True, sampler=sampler)
    _, rec = record_of(policy, engine, prompts=PROMPTS, n=3)
    mask = rec["loss_mask"].bool()
    assert mask[:, :-1].all() and not mask[:, -1].any()
    logp, _ = policy.logprobs(rec)
    assert torch.equal(logp[mask], rec["rollout_logprobs"][mask])
    assert torch.equal(policy.ref_logprobs(rec), logp.detach())
    logp[mask].sum().backward()
    grads = [p.grad for n, p in policy.model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads)


def test_export_lora_loads_into_wan_pipeline(wan_policy, tiny_wan_dir, tmp_path):
    from diffusers import WanPipeline

    policy, _ = wan_policy(lora=4)
    names = [n for n, _ in policy.model.named_parameters() if "lora_A" in n]
    assert any("attn1.to_q" in n for n in names) and any("attn2.to_v" in n for n in names)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    out = policy.export(tmp_path / "lora")
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    pipe.load_lora_weights(str(out), weight_name="pytorch_lora_weights.safetensors")
    x, t = torch.randn(1, 4, 4, 8, 8), torch.full((1,), 500.0)
    emb, pooled = policy.encode(["red, then blue"])
    with torch.no_grad():
        a = policy.family.velocity(policy.model, x, t, emb, pooled)
        b = policy.family.velocity(pipe.transformer, x, t, emb, pooled)
        with policy.model.disable_adapter():
            base = policy.family.velocity(policy.model, x, t, emb, pooled)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(a, base)


def test_frames_must_match_the_model(make_policy, tiny_wan_patch_dir):
    from polyrl.core.config import ConfigError

    with pytest.raises(ConfigError, match="video model"):
        make_policy(model=tiny_wan_patch_dir, max_sequence_length=8, frames=0)
    with pytest.raises(ConfigError, match="image model"):
        make_policy(frames=4)  # the tiny SD3
    with pytest.raises(ConfigError, match="frames must be >= 0"):
        make_policy(frames=-1)


# ------------------------------------------------------------------------ rewards


def _video(*colours, size=4, flicker=0.0):
    """A list of PIL frames, each one colour (a palette name or an RGB triple)."""
    from polyrl.diffusion.colour import PALETTE
    from polyrl.diffusion.rewards import to_pil

    frames = []
    for k, c in enumerate(colours):
        rgb = torch.tensor(PALETTE[c] if isinstance(c, str) else c)
        img = rgb[:, None, None].expand(3, size, size).clone()
        if flicker and k % 2:
            img[:, 0, :] = (img[:, 0, :] + flicker).clamp(0, 1)
        frames.append(to_pil(img))
    return frames


def _sample(prompt, frames, answer=None, index=0):
    from polyrl.core.rollout.rewards import Sample

    return Sample(prompt=prompt, response="", answer=answer, meta={}, images=frames, index=index)


def test_video_colour_rewards_by_hand():
    from polyrl.diffusion.colour_video import frame_targets
    from polyrl.diffusion.rewards import video_colour, video_colour_accuracy

    assert frame_targets(4) == [0, 0, 1, 1] and frame_targets(5) == [0, 0, -1, 1, 1]
    right = _sample("red, then blue", _video("red", "red", "blue", "blue"))
    swapped = _sample("red, then blue", _video("blue", "blue", "red", "red"))
    # the answer field wins over the prompt; the odd middle frame is nobody's
    half = _sample("x", _video("red", "green", "yellow", "blue", "blue"), answer=["red", "blue"])
    # one frame of four is half red, half background
    bg = (0.12, 0.12, 0.12)
    split = _video("red", "red", "blue", "blue", size=4)
    img = torch.tensor([0.9, 0.1, 0.1])[:, None, None].expand(3, 4, 4).clone()
    img[:, :2] = torch.tensor(bg)[:, None, None]
    from polyrl.diffusion.rewards import to_pil

    split[1] = to_pil(img)
    partial = _sample("red then blue", split)
    got = video_colour([right, swapped, half, partial])
    assert got == pytest.approx([1.0, 0.0, (1 + 0 + 1 + 1) / 4, (1 + 0.5 + 1 + 1) / 4])
    assert video_colour_accuracy([right, swapped, half, partial]) == [1.0, 0.0, 0.0, 1.0]


def test_temporal_consistency_by_hand():
    from polyrl.diffusion.rewards import temporal_consistency

    still = _sample("red, then blue", _video("red", "red", "blue", "blue"))
    # frames 1 and 3 have their first row raised by 0.2 (clamped at 1): the change between
    # frames 0-1 and 2-3 counts, the prompted change 1-2 does not
    flick = _sample("red, then blue", _video("red", "red", "blue", "blue", flicker=0.2))

    px = [np.asarray(f, dtype=np.float64) / 255 for f in flick.images]
    assert np.abs(px[1] - px[0]).max() > 0.1  # the flicker is there
    want = 1 - (np.abs(px[1] - px[0]).mean() + np.abs(px[3] - px[2]).mean()) / 2
    assert temporal_consistency([still, flick]) == pytest.approx([1.0, want], abs=1e-6)
    with pytest.raises(ValueError, match="frames >= 4"):
        temporal_consistency([_sample("red, then blue", _video("red", "blue"))])
    with pytest.raises(ValueError, match="frame"):
        temporal_consistency([_sample("red, then blue", [])])


def test_colour_video_task_and_rendering(tmp_path):
    from polyrl.diffusion import colour
    from polyrl.diffusion.colour_video import corpus, prompt_colours, render_videos, write_dataset
    from polyrl.diffusion.rewards import temporal_consistency, to_pil, video_colour_accuracy

    train, evl = write_dataset(tmp_path, seed=0, n_train=20)
    rows, evals = ([json.loads(x) for x in p.read_text().splitlines()] for p in (train, evl))
    assert len(rows) == 20 and len(evals) == 12  # every ordered pair of 4 colours
    for r in rows + evals:
        assert (
            tuple(r["answer"]) == prompt_colours(r["prompt"]) and r["answer"][0] != r["answer"][1]
        )
    assert prompt_colours("red, then blue") == ("red", "blue") and prompt_colours("red") is None
    assert set(corpus()) >= {r["prompt"] for r in rows}
    names = list(colour.PALETTE)
    idx = torch.tensor([[0, 2], [3, 1]])
    vids = render_videos(idx, 4, 16, torch.Generator().manual_seed(0), names)
    assert vids.shape == (2, 3, 4, 16, 16)
    samples = [
        _sample("", [to_pil(vids[k, :, f]) for f in range(4)], answer=[names[a], names[b]])
        for k, (a, b) in enumerate(idx.tolist())
    ]
    assert video_colour_accuracy(samples) == [1.0, 1.0]
    assert all(0.9 < x < 1.0 for x in temporal_consistency(samples))  # small pixel noise


# ------------------------------------------------------------------------ a run


def test_two_training_steps_write_video_grids(tiny_wan_patch_dir, two_step_run):
    from PIL import Image

    run, steps = two_step_run(
        tiny_wan_patch_dir,
        "{height: 16, width: 16, frames: 4, steps: 4, guidance_scale: 2.0, "
        "train_steps: {mode: window, window_start: 0, window_size: 2}}",
        "policies.main.args={max_sequence_length: 8}",
        "task.name=colour_video",
        "task.args={n_train: 16, eval_pairs: ['red, then blue', 'blue, then red']}",
        "rollout.workflow=text_to_video",
        "rollout.args={mp4: true}",
        "eval.n=2",
        "eval.temperature=0.0",
        "eval.accuracy_term=video_colour_accuracy",
        "reward.terms=[{name: video_colour}, {name: temporal_consistency, weight: 0.2}, "
        "{name: video_colour_accuracy, weight: 0.0}]",
    )
    assert len(steps) == 2 and all(x["rollout/rows"] == 6 for x in steps)
    assert all(0 <= x["reward/temporal_consistency/mean"] <= 1 for x in steps)
    gif = Image.open(run.path / "video_after.gif")
    assert gif.n_frames == 4  # one GIF frame per video frame
    assert gif.size == (2 * 66 + 2, 2 * 66 + 2)  # 2 prompts x 2 samples of 16 px, x4, pad 2
    strip = Image.open(run.path / "video_after.png")  # 4 rows (samples) x 4 frames
    assert strip.size == (4 * 66 + 2, 4 * 66 + 2)
    assert (run.path / "video_before.gif").is_file()
    import av

    with av.open(str(run.path / "video_after.mp4")) as mp4:
        frames = [f.to_ndarray(format="rgb24") for f in mp4.decode(video=0)]
    assert len(frames) == 4 and frames[0].shape == (134, 134, 3)
    # H.264 (4:2:0) is lossy: each MP4 frame is nearest to the GIF frame of its own time
    gifs = []
    for k in range(4):
        gif.seek(k)
        gifs.append(np.asarray(gif.convert("RGB"), dtype=np.float64))
    dist = np.array([[np.abs(m - g).mean() for g in gifs] for m in frames])
    assert (dist.argmin(1) == np.arange(4)).all(), dist
    assert (run.path / "export" / "main" / "pytorch_lora_weights.safetensors").is_file()


def test_text_to_video_needs_frames(tiny_wan_patch_dir, tmp_path):
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import ConfigError, load
    from polyrl.core.recipe import Config

    with pytest.raises(ConfigError, match="frames"):
        load(
            Config,
            None,
            [
                f"run.dir={tmp_path}/run",
                "task.name=colour_video",
                f"task.dir={tmp_path}/data",
                "policies.main.kind=diffusion",
                f"policies.main.model={tiny_wan_patch_dir}",
                "policies.main.engine.name=diffusion",
                "policies.main.engine.args={height: 16, width: 16}",
                "rollout.workflow=text_to_video",
                "reward.terms=[{name: video_colour}]",
                "algorithm.credit=per_prompt",
            ],
        )
