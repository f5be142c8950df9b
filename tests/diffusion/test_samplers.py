"""SDE samplers: Euler with noise off, Gaussian log-densities, the σ=1 and σ→0 ends."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.core.registry import UnknownNameError
from polyrl.diffusion.samplers import SAMPLERS, gaussian_log_prob, get_sampler

NAMES = ("flow_sde", "dance_sde", "cps", "ode")


def _scheduler(steps: int = 10, shift: float = 3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(steps)
    return sched


def test_registry_lists_the_four_samplers():
    assert set(NAMES) <= set(SAMPLERS.names())


@pytest.mark.parametrize("name", NAMES)
def test_noise_off_reproduces_diffusers_euler_step(name):
    sched = _scheduler()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=gen)
    sampler = get_sampler(name)
    for i in range(len(sched.timesteps)):
        v = torch.randn(x.shape, generator=gen)
        sched._step_index = i  # diffusers tracks the step index itself; pin it
        expected = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
        out = sampler.step(x, v, sched.sigmas[i], sched.sigmas[i + 1], noise_level=0.7, noise=False)
        assert torch.equal(out.prev_sample, expected.float()), (name, i)
        assert torch.equal(out.mean, expected.float())
        assert torch.all(out.std == 0) and torch.all(out.log_prob == 0)
        x = expected


@pytest.mark.parametrize("name", ("flow_sde", "dance_sde"))
def test_zero_noise_level_is_euler_too(name):
    sched = _scheduler()
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    out = get_sampler(name).step(x, v, sched.sigmas[3], sched.sigmas[4], noise_level=0.0)
    assert torch.allclose(out.mean, x + (sched.sigmas[4] - sched.sigmas[3]) * v)
    assert torch.all(out.std == 0)


def _reference_mean_std(name, x, v, s, s1, a):
    """The formulas of polyrl.diffusion.samplers' docstring (flow_sde: Flow-GRPO, arXiv
    2505.05470), written out independently."""
    dt = s1 - s
    if name == "cps":
        std = s1 * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return x0 * (1 - s1) + x1 * math.sqrt(s1**2 - std**2), std
    g = a * math.sqrt(s / (1 - (s1 if s == 1 else s))) if name == "flow_sde" else a
    mean = x + dt * (v + g**2 / (2 * s) * (x + (1 - s) * v))
    return mean, g * math.sqrt(-dt)


@pytest.mark.parametrize("name,a", [("flow_sde", 0.7), ("dance_sde", 0.3), ("cps", 0.7)])
@pytest.mark.parametrize("i", [0, 4, 8])  # 0 is the σ=1 step
def test_log_prob_is_the_gaussian_log_density(name, a, i):
    sched = _scheduler()
    s, s1 = float(sched.sigmas[i]), float(sched.sigmas[i + 1])
    gen = torch.Generator().manual_seed(i)
    x, v = torch.randn(4, 4, 6, 6, generator=gen), torch.randn(4, 4, 6, 6, generator=gen)
    out = get_sampler(name).step(x, v, s, s1, noise_level=a, generator=gen)
    mean, std = _reference_mean_std(name, x.double(), v.double(), s, s1, a)
    assert torch.allclose(out.mean.double(), mean, atol=1e-5)
    assert torch.allclose(out.std.double(), torch.full((4,), std, dtype=torch.float64), rtol=1e-5)
    direct = torch.distributions.Normal(mean, std).log_prob(out.prev_sample.double())
    assert out.log_prob.dtype == torch.float32
    assert torch.allclose(out.log_prob.double(), direct.flatten(1).mean(1), atol=1e-4)
    # recomputing the recorded transition gives the same log-prob bit for bit
    again = get_sampler(name).step(x, v, s, s1, noise_level=a, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)


@pytest.mark.parametrize("name", ("flow_sde", "dance_sde", "cps"))
def test_sigma_one_step_is_finite(name):
    sched = _scheduler(steps=10, shift=1.0)
    assert float(sched.sigmas[0]) == 1.0
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    out = get_sampler(name).step(x, v, sched.sigmas[0], sched.sigmas[1], noise_level=0.7)
    for t in (out.prev_sample, out.mean, out.std, out.log_prob):
        assert torch.isfinite(t).all()
    assert torch.all(out.std > 0)


def test_last_step_to_sigma_zero():
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    cps = get_sampler("cps").step(x, v, 0.05, 0.0, noise_level=0.7)
    assert torch.all(cps.std == 0) and torch.all(cps.log_prob == 0)  # deterministic
    assert torch.allclose(cps.prev_sample, x - 0.05 * v)  # lands on x̂0
    for name in ("flow_sde", "dance_sde"):
        out = get_sampler(name).step(x, v, 0.05, 0.0, noise_level=0.7)
        assert torch.isfinite(out.log_prob).all() and torch.all(out.std > 0)


def test_noise_switches_per_row():
    x, v = torch.randn(4, 2, 4, 4), torch.randn(4, 2, 4, 4)
    noise = torch.tensor([True, False, True, False])
    out = get_sampler("flow_sde").step(
        x, v, 0.8, 0.6, noise_level=0.7, noise=noise, generator=torch.Generator().manual_seed(0)
    )
    euler = x + (torch.tensor(0.6) - torch.tensor(0.8)) * v  # float32 like the sampler
    assert torch.equal(out.prev_sample[~noise], euler[~noise])
    assert torch.all(out.std[~noise] == 0) and torch.all(out.log_prob[~noise] == 0)
    assert torch.all(out.std[noise] > 0) and not torch.equal(out.prev_sample[noise], euler[noise])


def test_gaussian_log_prob_zero_std_is_zero():
    x = torch.randn(2, 3)
    lp = gaussian_log_prob(x, x + 1, torch.tensor([0.0, 2.0]))
    assert lp[0] == 0
    expected = torch.distributions.Normal(x[1] + 1, 2.0).log_prob(x[1]).mean()
    assert torch.allclose(lp[1], expected)


def test_unknown_sampler_names_the_nearest():
    with pytest.raises(UnknownNameError, match="flow_sde"):
        get_sampler("flow_sdee")
