"""Flow-GRPO's conventions as options: the KL form and the log-prob convention, for every
sampler and step of a 10-step SD3 schedule, against float64 numpy written here.

The references follow Flow-GRPO's ``sd3_sde_with_logprob`` (its ``sde`` and ``cps`` step
types: ``std_dev_t``, the mean, the log-prob) and ``train_sd3.py`` (``kl_loss = mean((μ -
μref)²) / (2·std_dev_t²)``), and DanceGRPO's constant diffusion for ``dance_sde``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.trainer import update
from polyrl.diffusion.credit import PerPromptOptions, gaussian_mean_kl, per_prompt_credit
from polyrl.diffusion.samplers import get_sampler

LEVELS = {"flow_sde": 0.7, "dance_sde": 0.3, "cps": 0.7, "ode": 0.7}
STEPS = 10


def _sigmas(steps: int = STEPS, shift: float = 3.0) -> np.ndarray:
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(steps)
    return sched.sigmas.double().numpy()


def _reference_step(name, x, v, sigmas, i, a):
    """(mean, std, std_dev_t) in float64: Flow-GRPO's step for flow_sde ('sde') and cps,
    DanceGRPO's (g = η) for dance_sde, Euler for ode; std_dev_t is what Flow-GRPO's KL
    divides by (None for the ODE)."""
    s, s1 = sigmas[i], sigmas[i + 1]
    dt = s1 - s
    if name == "ode":
        return x + dt * v, 0.0, None
    if name == "cps":
        std_dev_t = s1 * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + v * (1 - s)
        return x0 * (1 - s1) + x1 * math.sqrt(s1**2 - std_dev_t**2), std_dev_t, std_dev_t
    if name == "flow_sde":  # Flow-GRPO: at σ = 1 the denominator uses sigmas[1]
        std_dev_t = math.sqrt(s / (1 - (sigmas[1] if s == 1 else s))) * a
    else:
        std_dev_t = a
    mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_dev_t * math.sqrt(-dt), std_dev_t


def _reference_logprob(form, x_next, mean, std):
    if std == 0:
        return 0.0
    if form == "neg_mse":  # Flow-GRPO's cps: "remove all constants"
        return float(np.mean(-((x_next - mean) ** 2)))
    lp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return float(lp.mean())


def _rows(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x[None]).float()


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_every_step_against_float64_in_both_conventions(name):
    sigmas = _sigmas()
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    rng = np.random.default_rng(0)
    sampler, a = get_sampler(name), LEVELS[name]
    for i in range(STEPS):
        x, v, v_ref = (rng.standard_normal((4, 6, 6)) for _ in range(3))
        mean, std, std_dev_t = _reference_step(name, x, v, sigmas, i, a)
        mean_ref, _, _ = _reference_step(name, x, v_ref, sigmas, i, a)
        x_next = mean + std * rng.standard_normal(x.shape)
        s, s1 = torch.tensor(sigmas[i]).float(), torch.tensor(sigmas[i + 1]).float()
        for form in ("gaussian", "neg_mse"):
            out = sampler.step(
                _rows(x), _rows(v), s, s1, noise_level=a, prev_sample=_rows(x_next), logprob=form
            )
            ref_out = sampler.step(
                _rows(x), _rows(v_ref), s, s1, noise_level=a, prev_sample=_rows(x_next)
            )
            np.testing.assert_allclose(out.mean[0].double().numpy(), mean, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(float(out.std[0]), std, rtol=1e-5)
            expected = _reference_logprob(form, x_next, mean, std)
            assert float(out.log_prob[0]) == pytest.approx(expected, rel=1e-4, abs=1e-5), (
                name,
                i,
                form,
            )
            # the KL in both forms: step (the step's std) and flow_grpo (std_dev_t)
            sq = float(np.mean((mean - mean_ref) ** 2))
            step_kl = gaussian_mean_kl(
                out.mean[None, None], ref_out.mean[None, None], out.std[None]
            )
            coef = sampler.noise_coefficient(out.std, s[None], s1[None])
            fg_kl = gaussian_mean_kl(out.mean[None, None], ref_out.mean[None, None], coef[None])
            if std == 0:  # the ODE and CPS's last step: deterministic, no KL
                assert float(step_kl) == 0 and float(fg_kl) == 0 and float(out.log_prob) == 0
                continue
            assert float(step_kl) == pytest.approx(sq / (2 * std**2), rel=1e-4)
            assert float(fg_kl) == pytest.approx(sq / (2 * std_dev_t**2), rel=1e-4)
            if name != "cps":  # the relation: PolyRL's KL = Flow-GRPO's x 1/|dt|
                dt = sigmas[i] - sigmas[i + 1]
                assert float(fg_kl) == pytest.approx(float(step_kl) * dt, rel=1e-4)


def test_flow_grpo_kl_through_the_policy_and_the_trainer(make_policy, record_of):
    """kl_form flow_grpo: the policy's KL (one forward, as the trainer gets it) is each
    trained step's exact (step) KL times |dt| for flow_sde; the update reports it."""
    policy, engine = make_policy(lora=4, policy_args={"kl_form": "step"})
    flow_grpo, _ = make_policy(lora=4, policy_args={"kl_form": "flow_grpo"})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the adapter off zero: the policy differs from its reference
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    flow_grpo.model.load_state_dict(policy.model.state_dict())
    _, rec = record_of(policy, engine)
    kls = {}
    for form, pol in (("step", policy), ("flow_grpo", flow_grpo)):
        ref = pol.reference_terms(rec, 1.0, "gaussian_mean")
        with torch.no_grad():
            _, _, kls[form] = pol.logprobs_and_kl(rec, estimator="gaussian_mean", reference=ref)
    dt = (rec["sigmas"][:, :-1] - rec["sigmas"][:, 1:]).double()
    mask = rec["loss_mask"].bool()
    assert mask.any() and float(kls["step"][mask].min()) > 0
    torch.testing.assert_close(
        kls["flow_grpo"][mask].double(), (kls["step"].double() * dt)[mask], rtol=1e-5, atol=0
    )
    assert (kls["flow_grpo"][~mask] == 0).all()
    rec["reward"] = torch.rand(rec.batch_size[0], generator=gen)
    per_prompt_credit(rec, AlgorithmConfig(), **PerPromptOptions())
    out = update(flow_grpo, rec, AlgorithmConfig(kl_coef=0.04, kl_estimator="gaussian_mean"))
    expected = float(kls["flow_grpo"][mask].mean())  # token-mean over the trained steps
    assert out["kl"] == pytest.approx(expected, rel=1e-4)


def test_neg_mse_rollout_logprobs_are_recomputed_exactly(make_policy, record_of):
    """engine.args.logprob neg_mse: the engine records -mean((x' - μ)²) and the policy
    recomputes the same values (same batch layout: bit for bit). The same seed with the
    default 'gaussian' samples the same latents, and its log-probs are the neg_mse ones
    times 1/(2·std²) minus log(std) and log(√(2π))."""
    recs = {}
    for form in ("neg_mse", "gaussian"):
        policy, engine = make_policy(sampler="cps", noise_level=0.7, cfg_batch=False, logprob=form)
        traj, rec = record_of(policy, engine)
        logp, _ = policy.logprobs(rec)
        mask = rec["loss_mask"].bool()
        assert mask.any() and torch.equal(logp[mask], rec["rollout_logprobs"][mask])
        recs[form] = (traj, rec)
    traj, mse = recs["neg_mse"]
    _, gauss = recs["gaussian"]
    assert torch.equal(mse["latents"], gauss["latents"])
    mask = mse["loss_mask"].bool()
    assert (mse["rollout_logprobs"][mask] < 0).all()
    std = traj.stds.double()[mask]
    expected = (
        mse["rollout_logprobs"].double()[mask] / (2 * std**2)
        - std.log()
        - 0.5 * math.log(2 * math.pi)
    )
    torch.testing.assert_close(
        gauss["rollout_logprobs"].double()[mask], expected, rtol=1e-4, atol=1e-4
    )


def test_bad_convention_names_fail_naming_the_key(make_policy):
    with pytest.raises(ConfigError, match=r"logprob='mse'.*gaussian, neg_mse"):
        make_policy(logprob="mse")
    with pytest.raises(ConfigError, match=r"kl_form='flowgrpo'.*step, flow_grpo"):
        make_policy(policy_args={"kl_form": "flowgrpo"})
