"""The FLUX family: diffusers' FluxPipeline reproduced, exact log-probs, LoRA export, a run."""

from __future__ import annotations

import pytest
import torch

FLUX_ARGS = {"steps": 4, "guidance_scale": 3.5}


@pytest.fixture
def flux_policy(make_policy, tiny_flux_dir):
    def make(**kw):
        args = dict(FLUX_ARGS, model=tiny_flux_dir, max_sequence_length=8)
        args.update(kw)
        return make_policy(**args)

    return make


def test_packing_is_diffusers_own_and_round_trips():
    from diffusers import FluxPipeline

    from polyrl.diffusion.packed import image_ids, pack_latents, unpack_latents

    x = torch.randn(3, 12, 8, 6)
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 3, 12, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), x)
    assert torch.equal(
        image_ids(4, 3, torch.device("cpu"), torch.float32),
        FluxPipeline._prepare_latent_image_ids(3, 4, 3, "cpu", torch.float32),
    )


def test_ode_reproduces_flux_pipeline_step_by_step(flux_policy, tiny_flux_dir, prompts):
    """Noise off: every latent of the engine's trajectory equals FluxPipeline's (same
    starting noise, prompt embeddings, guidance, σ's), bit for bit."""
    from diffusers import FluxPipeline

    from polyrl.diffusion.packed import pack_latents, unpack_latents

    policy, engine = flux_policy()
    traj = engine.sample(prompts, n=2, deterministic=True)
    emb, pooled = policy.encode([prompts[i] for i in traj.prompt_index])
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, transformer=policy.family.transformer)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def keep(pipeline, i, t, kw):
        seen.append(unpack_latents(kw["latents"], 8, 8))
        return {}

    with torch.no_grad():
        out = pipe(
            prompt_embeds=emb,
            pooled_prompt_embeds=pooled,
            latents=pack_latents(traj.latents[:, 0]),
            num_inference_steps=4,
            guidance_scale=3.5,
            height=16,
            width=16,
            output_type="latent",
            callback_on_step_end=keep,
        ).images
    assert torch.equal(pipe.scheduler.sigmas, traj.sigmas[0])  # dynamic shift (mu) as diffusers
    assert torch.equal(pipe.scheduler.timesteps, traj.timesteps[0])
    for t, lat in enumerate(seen):
        assert torch.equal(lat, traj.latents[:, t + 1]), f"step {t}"
    assert torch.equal(unpack_latents(out, 8, 8), traj.latents[:, -1])
    # the guidance value is an input of the transformer: another value, another image
    with torch.no_grad():
        other = pipe(
            prompt_embeds=emb,
            pooled_prompt_embeds=pooled,
            latents=pack_latents(traj.latents[:, 0]),
            num_inference_steps=4,
            guidance_scale=1.0,
            height=16,
            width=16,
            output_type="latent",
        ).images
    assert not torch.equal(other, out)


@pytest.mark.parametrize("sampler,level", [("flow_sde", 0.7), ("cps", 0.7)])
def test_recomputed_logprobs_equal_the_rollouts(flux_policy, record_of, sampler, level):
    """First PPO ratio exactly 1; the LoRA reference (adapter off) equals the policy."""
    policy, engine = flux_policy(lora=4, need_reference=True, sampler=sampler, noise_level=level)
    _, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    assert mask[:, :-1].all() and not mask[:, -1].any()
    assert rec["negative_prompt_embeds"].shape[1] == 0  # no unconditional branch stored
    logp, _ = policy.logprobs(rec)
    assert torch.equal(logp[mask], rec["rollout_logprobs"][mask])
    assert torch.all(torch.exp(logp[mask] - rec["rollout_logprobs"][mask]) == 1.0)
    assert logp.requires_grad
    assert torch.equal(policy.ref_logprobs(rec), logp.detach())


def test_one_transformer_call_per_step_with_guidance(flux_policy):
    policy, _ = flux_policy()
    calls = []
    model = policy.model
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(kwargs["guidance"].clone()), with_kwargs=True
    )
    emb, pooled = policy.encode(["a red blob"] * 2)
    x, t = torch.randn(2, 12, 8, 8), torch.full((2,), 500.0)
    empty = emb[:, :0]
    with torch.no_grad():
        v = policy.velocity(x, t, emb, pooled, empty, pooled[:, :0], torch.tensor([3.5, 1.0]))
        v1 = policy.velocity(x, t, emb, pooled, empty, pooled[:, :0], torch.tensor([1.0, 1.0]))
    hook.remove()
    assert len(calls) == 2 and torch.equal(calls[0], torch.tensor([3.5, 1.0]))
    assert torch.equal(v[1], v1[1]) and not torch.equal(v[0], v1[0])


def test_export_lora_loads_into_flux_pipeline(flux_policy, tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline

    policy, _ = flux_policy(lora=4)
    names = [n for n, _ in policy.model.named_parameters() if "lora_A" in n]
    assert any("single_transformer_blocks" in n for n in names)
    assert any(".transformer_blocks" in n and "add_q_proj" in n for n in names)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    out = policy.export(tmp_path / "lora")
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    pipe.load_lora_weights(str(out), weight_name="pytorch_lora_weights.safetensors")
    x, t, g = torch.randn(1, 12, 8, 8), torch.full((1,), 500.0), torch.full((1,), 3.5)
    emb, pooled = policy.encode(["a red blob"])
    with torch.no_grad():
        a = policy.family.velocity(policy.model, x, t, emb, pooled, g)
        b = policy.family.velocity(pipe.transformer, x, t, emb, pooled, g)
        with policy.model.disable_adapter():
            base = policy.family.velocity(policy.model, x, t, emb, pooled, g)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(a, base)


def test_flux_needs_its_t5(tiny_flux_dir):
    from polyrl.diffusion.families import detect_family
    from polyrl.diffusion.packed import FluxFamily

    assert detect_family(tiny_flux_dir) == "flux"
    with pytest.raises(ValueError, match="T5"):
        FluxFamily(tiny_flux_dir, dtype=torch.float32, device=torch.device("cpu"), load_t5=False)


def test_two_training_steps_through_the_workflow(tiny_flux_dir, two_step_run):
    run, steps = two_step_run(
        tiny_flux_dir,
        "{height: 16, width: 16, steps: 4, guidance_scale: 3.5, "
        "train_steps: {mode: window, window_start: 0, window_size: 2}}",
        "policies.main.args={max_sequence_length: 8}",
    )
    assert len(steps) == 2 and all(x["rollout/rows"] == 6 for x in steps)
    assert all(x["main/kl"] is not None and x["main/kl"] >= 0 for x in steps)
    assert (run.path / "grid_after.png").is_file()
    assert (run.path / "export" / "main" / "pytorch_lora_weights.safetensors").is_file()
