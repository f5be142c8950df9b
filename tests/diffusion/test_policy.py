"""The diffusion policy: recomputed log-probs, first PPO ratio, KL, CFG, NaN rows, state."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.interfaces import OwnsKL
from polyrl.core.registry import KL_ESTIMATORS
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.trainer import update
from polyrl.diffusion.credit import PerPromptOptions, gaussian_mean_kl, per_prompt_credit


@pytest.mark.parametrize("sampler,level", [("flow_sde", 0.7), ("dance_sde", 0.3), ("cps", 0.7)])
def test_recomputed_logprobs_equal_the_rollouts(make_policy, sampler, level, record_of):
    """Same transformer, same batch layout: the first PPO ratio is exactly 1 (float32)."""
    policy, engine = make_policy(sampler=sampler, noise_level=level, cfg_batch=False)
    traj, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    assert mask[:, :-1].all() and not mask[:, -1].any()  # all steps but the last train
    logp, _ = policy.logprobs(rec)
    assert logp.dtype == torch.float32
    assert torch.equal(logp[mask], rec["rollout_logprobs"][mask])
    assert torch.all(torch.exp(logp[mask] - rec["rollout_logprobs"][mask]) == 1.0)
    assert logp.requires_grad


def test_recomputed_logprobs_match_with_batched_guidance(make_policy, record_of):
    """Sampling with [uncond; cond] in one call (the default, as diffusers does) and
    recomputing with two calls agree to float32 rounding (on this CPU: exactly)."""
    policy, engine = make_policy(cfg_batch=True)
    _, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    logp, _ = policy.logprobs(rec)
    torch.testing.assert_close(logp[mask], rec["rollout_logprobs"][mask], rtol=0, atol=1e-5)


def test_first_ratio_is_exactly_one_with_the_default_batched_guidance(make_policy, record_of):
    """The trainer's old log-probs (a no-grad pass when it needs them: several epochs or
    mini-batches) equal its grad pass bitwise, so the first ratio is exactly 1 whatever the
    sampling layout; with one epoch and one mini-batch the update reports it."""
    policy, engine = make_policy(lora=4)
    _, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    with torch.no_grad():
        old, _ = policy.logprobs(rec)
    new, _ = policy.logprobs(rec)
    assert new.requires_grad
    assert torch.all(torch.exp(new[mask] - old[mask]) == 1.0)
    rec["reward"] = torch.rand(rec.batch_size[0])
    per_prompt_credit(rec, AlgorithmConfig(), **PerPromptOptions())
    out = update(policy, rec, AlgorithmConfig())
    assert out["ppo_kl"] == 0.0 and out["pg_clipfrac"] == 0.0


def test_recomputed_logprobs_match_in_other_micro_batches(make_policy, record_of):
    policy, engine = make_policy(train_steps={"mode": "fraction", "fraction": 0.5})
    _, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    assert (mask.sum(1) == 2).all()  # round(0.5 * 5) steps per trajectory
    for part in (rec[:5], rec[5:11], rec[11:]):
        logp, _ = policy.logprobs(part)
        m = part["loss_mask"].bool()
        torch.testing.assert_close(logp[m], part["rollout_logprobs"][m], rtol=0, atol=1e-5)


def test_kl_is_zero_while_the_adapter_is_unchanged(make_policy, record_of):
    policy, engine = make_policy(lora=4, need_reference=True, lr=1e-2)
    assert isinstance(policy, OwnsKL) and policy.kl_estimators == ("gaussian_mean",)
    _, rec = record_of(policy, engine)
    ref = policy.reference_terms(rec, 1.0, "gaussian_mean")
    assert ref.shape == rec["latents"][:, :-1].shape  # reference means of each step
    logp, _, kl = policy.logprobs_and_kl(rec, estimator="gaussian_mean", reference=ref)
    assert torch.equal(kl, torch.zeros_like(logp))
    assert torch.equal(logp, policy.logprobs(rec)[0])  # one forward gives both
    # k1/k3 on log-probs: the adapter-off reference gives the same log-probs
    assert torch.equal(policy.ref_logprobs(rec), policy.logprobs(rec)[0].detach())
    # one optimizer step on the adapter: the policy moves away from the reference
    rec["reward"] = torch.arange(rec.batch_size[0], dtype=torch.float32)
    per_prompt_credit(rec, AlgorithmConfig(), **PerPromptOptions())
    out = update(policy, rec, AlgorithmConfig(kl_coef=0.1, kl_estimator="gaussian_mean"))
    assert out["kl"] == 0.0  # measured before the step, as the first ratio
    _, _, kl = policy.logprobs_and_kl(rec, estimator="gaussian_mean", reference=ref)
    assert torch.isfinite(kl).all() and kl[rec["loss_mask"].bool()].min() > 0
    assert (kl[~rec["loss_mask"].bool()] == 0).all()
    with pytest.raises(ValueError, match="not 'k3'"):
        policy.reference_terms(rec, 1.0, "k3")


# the record's per-row inputs of DiffusionPolicy.velocity, in its order
ROW_INPUTS = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
    "guidance",
)


def _flow_sde_step(x, v, sigma, sigma_next, a):
    """Flow-GRPO's SDE step (arXiv 2505.05470), written out: (mean, std)."""
    g = a * math.sqrt(sigma / (1 - (sigma_next if sigma >= 1 else sigma)))
    dt = sigma_next - sigma
    return x + dt * (v + g**2 / (2 * sigma) * (x + (1 - sigma) * v)), g * math.sqrt(-dt)


def test_trainer_gaussian_mean_kl_equals_a_hand_computation(make_policy, record_of):
    """With kl_estimator gaussian_mean the update's KL (the policy owns it) is the mean over
    trained steps of mean over latent elements of (mu - mu_ref)^2 / (2 std^2), each step's
    mu, mu_ref and std recomputed here row by row from the velocities."""
    policy, engine = make_policy(lora=4, train_steps={"mode": "fraction", "fraction": 0.5})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the adapter off zero: the policy differs from its reference
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    _, rec = record_of(policy, engine)
    rec["reward"] = torch.rand(rec.batch_size[0], generator=gen)
    per_prompt_credit(rec, AlgorithmConfig(), **PerPromptOptions())
    terms = []
    with torch.no_grad():
        for i, t in rec["loss_mask"].nonzero().tolist():
            x = rec["latents"][i : i + 1, t]
            inputs = (x, rec["timesteps"][i : i + 1, t], *(rec[k][i : i + 1] for k in ROW_INPUTS))
            v = policy.velocity(*inputs)
            with policy.model.disable_adapter():
                v_ref = policy.velocity(*inputs)
            s, s_next = float(rec["sigmas"][i, t]), float(rec["sigmas"][i, t + 1])
            a = float(rec["noise_level"][i])
            mu, std = _flow_sde_step(x, v, s, s_next, a)
            mu_ref, _ = _flow_sde_step(x, v_ref, s, s_next, a)
            terms.append(float(((mu - mu_ref) ** 2).mean()) / (2 * std**2))
    expected = sum(terms) / len(terms)  # token-mean over the trained steps
    assert expected > 1e-6
    out = update(policy, rec, AlgorithmConfig(kl_coef=0.1, kl_estimator="gaussian_mean"))
    assert out["kl"] == pytest.approx(expected, rel=1e-4)


def test_text_encoders_and_vae_are_frozen_and_each_prompt_is_encoded_once(make_policy, monkeypatch):
    policy, _ = make_policy(lora=4)
    fam = policy.family
    frozen = [fam.vae] + [
        e
        for e in (fam.text.text_encoder, fam.text.text_encoder_2, fam.text.text_encoder_3)
        if e is not None
    ]
    trained = {id(p) for g in policy.optimizer.param_groups for p in g["params"]}
    assert len(frozen) >= 3 and trained
    for module in frozen:
        assert not any(p.requires_grad for p in module.parameters())
        assert trained.isdisjoint(id(p) for p in module.parameters())
    calls, real = [], fam.encode
    monkeypatch.setattr(fam, "encode", lambda ps: calls.append(list(ps)) or real(ps))
    first, _ = policy.encode(["red", "blue", "red"])
    second, _ = policy.encode(["blue", "red", "green"])
    assert calls == [["red", "blue"], ["green"]]  # distinct prompts, each once per run
    assert torch.equal(first[0], first[2]) and torch.equal(first[0], second[1])
    assert torch.equal(second[2], real(["green"])[0][0])  # the cache holds the encoding


def test_gaussian_mean_kl_formula():
    means = torch.randn(2, 3, 4, 2, 2)
    ref = torch.randn(2, 3, 4, 2, 2)
    std = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.1, 0.0]])
    kl = gaussian_mean_kl(means, ref, std)
    expected = ((means - ref) ** 2).flatten(2).mean(-1) / (2 * std**2)
    assert torch.allclose(kl[:, :2], expected[:, :2]) and (kl[:, 2] == 0).all()
    # as a log-prob estimator (a policy that does not own it) it refuses, saying why
    with pytest.raises(ConfigError, match=r"kl_estimator=gaussian_mean .*\(k1, k3"):
        KL_ESTIMATORS.get("gaussian_mean")(torch.zeros(2, 3), torch.zeros(2, 3))


def test_cfg_unconditional_branch_is_detached(make_policy, record_of):
    policy, engine = make_policy(guidance_scale=4.0)
    _, rec = record_of(policy, engine, n=2)
    calls = []
    velocity = policy.family.velocity

    def spy(model, x, t, emb, pooled):
        calls.append(
            (
                torch.is_grad_enabled(),
                bool(torch.equal(emb, rec["negative_prompt_embeds"][: emb.shape[0]])),
            )
        )
        return velocity(model, x, t, emb, pooled)

    policy.family.velocity = spy
    logp, _ = policy.logprobs(rec)
    policy.family.velocity = velocity
    assert calls and all(grad != uncond for grad, uncond in calls)  # uncond: no grad
    logp.sum().backward()  # gradient flows through the conditional branch
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.model.parameters())


def test_guidance_changes_the_velocity(make_policy):
    policy, _ = make_policy()
    emb, pooled = policy.encode(["a red blob"] * 2)
    neg, npool = policy.encode([""] * 2)
    x, t = torch.randn(2, 12, 8, 8), torch.full((2,), 500.0)
    with torch.no_grad():
        v_c = policy.velocity(x, t, emb, pooled, neg, npool, torch.tensor([1.0, 1.0]))
        v_g = policy.velocity(x, t, emb, pooled, neg, npool, torch.tensor([1.0, 3.0]))
        v_u = policy.family.velocity(policy.model, x, t, neg, npool)
    assert torch.equal(v_g[0], v_c[0])
    assert torch.allclose(v_g[1], v_u[1] + 3.0 * (v_c[1] - v_u[1]), atol=1e-5)


def test_same_noise_within_a_group(make_policy, prompts):
    policy, engine = make_policy(same_noise=True)
    traj = engine.sample(prompts[:2], n=3)
    x0 = traj.latents[:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2])
    assert not torch.equal(x0[0], x0[3])
    assert not torch.equal(traj.latents[0, -1], traj.latents[1, -1])  # the SDE still differs
    _, other = make_policy(same_noise=False)
    x0 = other.sample(prompts[:1], n=2).latents[:, 0]
    assert not torch.equal(x0[0], x0[1])


def test_nan_stops_only_that_trajectory(make_policy, prompts):
    policy, engine = make_policy()

    def poison(step, first_row, v):
        if step == 2:
            v = v.clone()
            v[3 - first_row] = float("nan")
        return v

    traj = engine.sample(prompts, n=2, velocity_hook=poison)
    assert "step 2" in traj.errors[3] and "NaN" in traj.errors[3]
    assert all(e == "" for i, e in enumerate(traj.errors) if i != 3)
    assert not traj.loss_mask[3].any() and traj.loss_mask[[0, 1, 2, 4]].any(1).all()
    assert torch.isfinite(traj.latents).all() and torch.isfinite(traj.logprobs).all()


def test_eval_sampling_is_deterministic_and_does_not_train(make_policy, prompts):
    policy, engine = make_policy()
    a = engine.sample(prompts, n=2, deterministic=True)
    b = engine.sample(prompts, n=2, deterministic=True)
    assert torch.equal(a.latents, b.latents)  # same starting noise, ODE
    assert not a.loss_mask.any() and (a.logprobs == 0).all() and engine.rollouts == 0
    engine.sample(prompts, n=2)
    assert engine.rollouts == 1


def test_update_moves_the_weights_and_state_round_trips(make_policy, record_of):
    policy, engine = make_policy(lora=4, lr=1e-2)
    _, rec = record_of(policy, engine)
    rec["reward"] = torch.rand(rec.batch_size[0])
    per_prompt_credit(rec, AlgorithmConfig(), **PerPromptOptions())
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    assert all("lora" in k for k in before)
    out = update(policy, rec, AlgorithmConfig(clip_ratio_low=1e-4, clip_ratio_high=1e-4))
    assert out["pg_clipfrac"] == 0.0 and out["skipped_nonfinite"] == 0
    after = policy.trainable_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    state = policy.state_dict()
    fresh, _ = make_policy(lora=4, lr=1e-2)
    fresh.load_state_dict(state)
    logp_a, _ = policy.logprobs(rec)
    logp_b, _ = fresh.logprobs(rec)
    assert torch.equal(logp_a, logp_b)


def test_export_lora_in_diffusers_format(make_policy, tmp_path, tiny_sd3_dir):
    from diffusers import SD3Transformer2DModel

    policy, _ = make_policy(lora=4)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    out = policy.export(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer")
    base.load_lora_adapter(
        str(out), prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
    )
    x, t = torch.randn(1, 12, 8, 8), torch.full((1,), 500.0)
    emb, pooled = policy.encode(["a red blob"])
    with torch.no_grad():
        a = policy.family.velocity(policy.model, x, t, emb, pooled)
        b = policy.family.velocity(base, x, t, emb, pooled)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_export_full_fine_tune_loads_as_a_diffusers_pipeline(make_policy, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    policy, _ = make_policy(lora=0)
    with torch.no_grad():
        next(policy.model.parameters()).add_(0.5)
    out = policy.export(tmp_path / "full")
    pipe = StableDiffusion3Pipeline.from_pretrained(out, text_encoder_3=None, tokenizer_3=None)
    for (k, a), (_, b) in zip(
        policy.model.state_dict().items(), pipe.transformer.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    images = pipe(
        ["a red blob"],
        height=16,
        width=16,
        num_inference_steps=2,
        max_sequence_length=1,
        output_type="pt",
    ).images
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()
