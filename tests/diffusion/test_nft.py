"""DiffusionNFT: its loss against float64 numpy, the policy's forward-process objective, the
engine's ODE data collection and the recipe checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.trainer import update
from polyrl.diffusion.credit import PerPromptOptions, per_prompt_credit
from polyrl.diffusion.nft import nft_loss, optimality


def _reference(v, v_old, x0, xt, s, r, beta, adaptive):
    """DiffusionNFT's train_nft_sd3.py loss per row (arXiv 2509.16117), float64 numpy; also
    d loss / d v with the adaptive weights held fixed (they carry no gradient there)."""
    dims = tuple(range(1, v.ndim))
    s = s.reshape(-1, *([1] * (v.ndim - 1)))
    pos = (1 - beta) * v_old + beta * v
    neg = (1 + beta) * v_old - beta * v
    e_pos, e_neg = xt - s * pos - x0, xt - s * neg - x0
    w_pos = np.abs(e_pos).mean(dims, keepdims=True).clip(min=1e-5) if adaptive else 1.0
    w_neg = np.abs(e_neg).mean(dims, keepdims=True).clip(min=1e-5) if adaptive else 1.0
    lp, ln = (e_pos**2 / w_pos).mean(dims), (e_neg**2 / w_neg).mean(dims)
    loss = (r * lp + (1 - r) * ln) / beta
    n = np.prod(v.shape[1:])
    rr = r.reshape(s.shape)
    grad = (rr * 2 * e_pos / w_pos * (-s * beta) + (1 - rr) * 2 * e_neg / w_neg * (s * beta)) / (
        beta * n
    )
    return loss, grad


@pytest.mark.parametrize("beta", [1.0, 0.1])
@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_loss_and_gradient_against_numpy(beta, adaptive):
    rng = np.random.default_rng(0)
    v, v_old, x0, eps = (rng.standard_normal((5, 3, 4, 4)) for _ in range(4))
    s = rng.uniform(0.1, 1.0, 5)
    xt = (1 - s.reshape(-1, 1, 1, 1)) * x0 + s.reshape(-1, 1, 1, 1) * eps
    adv = np.array([-7.0, -2.5, 0.0, 1.0, 9.0])
    r = np.clip(np.clip(adv, -5, 5) / 5 / 2 + 0.5, 0, 1)
    assert np.allclose(optimality(torch.tensor(adv), 5.0).numpy(), r)
    assert list(r[[0, 2, 4]]) == [0.0, 0.5, 1.0]
    expected, grad = _reference(v, v_old, x0, xt, s, r, beta, adaptive)
    vt = torch.tensor(v, dtype=torch.float32, requires_grad=True)
    loss = nft_loss(
        vt,
        torch.tensor(v_old),
        torch.tensor(x0),
        torch.tensor(xt),
        torch.tensor(s),
        torch.tensor(r),
        beta=beta,
        adaptive=adaptive,
    )
    np.testing.assert_allclose(loss.detach().double().numpy(), expected, rtol=1e-5)
    loss.sum().backward()
    np.testing.assert_allclose(vt.grad.double().numpy(), grad, rtol=1e-4, atol=1e-7)


def test_at_the_old_policy_the_gradient_is_advantage_weighted_flow_matching():
    """With v_old = vθ (one step per rollout) the NFT gradient is (2r - 1) times the
    gradient of the positive (plain) weighted flow-matching loss, for every β."""
    gen = torch.Generator().manual_seed(0)
    v0, x0, eps = (torch.randn(4, 3, 4, 4, generator=gen) for _ in range(3))
    s = torch.tensor([0.9, 0.6, 0.3, 0.1])
    xt = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    r = torch.tensor([0.0, 0.25, 0.5, 1.0])
    ones = torch.ones(4)
    grads = {}
    for beta in (1.0, 0.3):
        for name, rr in (("nft", r), ("plain", ones)):
            v = v0.clone().requires_grad_(True)
            nft_loss(v, v0, x0, xt, s, rr, beta=beta).sum().backward()
            grads[name, beta] = v.grad
        scale = (2 * r - 1).view(-1, 1, 1, 1)
        torch.testing.assert_close(grads["nft", beta], scale * grads["plain", beta])
    torch.testing.assert_close(grads["nft", 1.0], grads["nft", 0.3])


def _nft_policy(model: str, **engine_args):
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.diffusion.engine import DiffusionEngine, sampling_options
    from polyrl.diffusion.nft import DiffusionNftPolicy

    args = {"height": 16, "width": 16, "steps": 6, "guidance_scale": 3.0, "sampler": "ode"}
    args.update(engine_args)
    cfg = from_dict(
        PolicyConfig,
        {
            "kind": "diffusion_nft",
            "model": model,
            "lora": {"r": 4, "alpha": 8},
            "args": {"max_sequence_length": 1, "beta": 1.0, "adv_clip": 5.0},
            "optim": {"lr": 1e-3},
            "micro_batch_size": 64,
            "engine": {"name": "diffusion", "args": args},
        },
    )
    policy = DiffusionNftPolicy("main", cfg, total_steps=10, need_reference=False, device="cpu")
    return policy, DiffusionEngine(policy, seed=0, **sampling_options(cfg, "main"))


def test_policy_objective_is_the_nft_loss_of_the_recorded_clean_latents(
    tiny_sd3_dir, one_thread, record_of
):
    """ODE rollouts train their selected steps; the policy's per-step objective is -5 x the
    NFT loss of the final latent noised with the row's seeded noise, CFG-free; the update
    minimises its token-mean and changes the adapter."""
    from polyrl.diffusion.nft import _noise

    policy, engine = _nft_policy(tiny_sd3_dir)
    traj, rec = record_of(policy, engine, n=2)
    mask = rec["loss_mask"].bool()
    assert (traj.stds == 0).all() and (rec["rollout_logprobs"] == 0).all()  # the ODE
    assert mask[:, :-1].all() and not mask[:, -1].any()
    assert rec["train_seed"].unique().numel() == rec.batch_size[0]
    rec["reward"] = torch.rand(rec.batch_size[0], generator=torch.Generator().manual_seed(0))
    per_prompt_credit(rec, AlgorithmConfig(), **PerPromptOptions())
    objective, _ = policy.logprobs(rec)
    assert objective.requires_grad and (objective[~mask] == 0).all()
    i, t = 3, 2
    x0 = rec["latents"][i : i + 1, -1]
    s = rec["sigmas"][i, t]
    xt = (1 - s) * x0 + s * _noise(rec["train_seed"][i : i + 1], t, tuple(x0.shape[1:]), "cpu")
    with torch.no_grad():  # no CFG although the rollout sampled with guidance 3
        v = policy.family.velocity(
            policy.model,
            xt,
            rec["timesteps"][i : i + 1, t],
            rec["prompt_embeds"][i : i + 1],
            rec["pooled_prompt_embeds"][i : i + 1],
        ).float()
    r = optimality(rec["advantages"][i : i + 1, t], 5.0)
    expected = -5.0 * nft_loss(v, v, x0, xt, s.view(1), r, beta=1.0)
    torch.testing.assert_close(objective[i, t].detach().view(1), expected, rtol=1e-5, atol=1e-6)
    again, _ = policy.logprobs(rec)  # the seeded noise: the same value when recomputed
    assert torch.equal(again.detach(), objective.detach())
    before = {k: p.clone() for k, p in policy.model.named_parameters() if p.requires_grad}
    out = update(policy, rec, AlgorithmConfig(policy_loss="diffusion_nft"))
    assert out["nft/loss"] == pytest.approx(float(-objective.detach()[mask].mean()), rel=1e-5)
    moved = [
        k
        for k, p in policy.model.named_parameters()
        if k in before and not torch.equal(p, before[k])
    ]
    assert moved


def test_recipe_checks_pair_the_nft_kind_and_its_loss(diffusion_config):
    nft = [
        "policies.main.kind=diffusion_nft",
        "policies.main.engine.args.sampler=ode",
        "algorithm.policy_loss=diffusion_nft",
    ]
    cfg = diffusion_config(*nft)
    cfg.validate()
    with pytest.raises(ConfigError, match="set algorithm.policy_loss: diffusion_nft"):
        diffusion_config(*nft[:2])
    with pytest.raises(ConfigError, match="needs a policy of kind diffusion_nft"):
        diffusion_config(nft[2])
    with pytest.raises(ConfigError, match="minibatches=2"):
        diffusion_config(*nft, "algorithm.minibatches=2")
    with pytest.raises(ConfigError, match="sampler=ode samples without noise"):
        diffusion_config("policies.main.engine.args.sampler=ode")
    with pytest.raises(ConfigError, match=r"beta and adv_clip must be > 0"):
        diffusion_config(*nft, "policies.main.args.beta=0")
