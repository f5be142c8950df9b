"""Stochastic samplers for flow-matching models that record per-step log-probabilities.

Conventions (those of diffusers' flow-matching scheduler and of Flow-GRPO, arXiv
2505.05470; diffusion/README.md, "Samplers", lists the same formulas): the noise level σ
runs from 1 (pure noise) to 0 (data); ``x = (1 - σ)·x0 + σ·ε``; the model predicts the
velocity ``v = ε - x0``; one step goes from σ to σ' < σ with ``dt = σ' - σ < 0``. A step
is Gaussian, ``x' ~ N(μ(x, v), std²)``, and its log-probability is the Gaussian
log-density of ``x'`` averaged over the latent's elements, computed in float32.

Samplers (registered in :data:`SAMPLERS`):

- ``flow_sde`` (Flow-GRPO): Euler–Maruyama of the reverse SDE with diffusion
  ``g = a·√(σ/(1-σ))``; at σ = 1 the denominator uses the next σ instead (``1 - σ'``).
- ``dance_sde`` (DanceGRPO): the same SDE with a constant diffusion ``g = η``.
- ``cps`` (coefficient-preserving): ``std = σ'·sin(aπ/2)``,
  ``μ = x̂0·(1 - σ') + x̂1·√(σ'² - std²)`` with ``x̂0 = x - σv``, ``x̂1 = x + (1 - σ)v``;
  its last step (σ' = 0) has std 0 and is deterministic.
- ``ode``: the deterministic Euler step ``x' = x + dt·v`` (diffusers'
  ``FlowMatchEulerDiscreteScheduler.step``).

For the SDEs, ``μ = x + dt·[v + g²/(2σ)·(x + (1 - σ)·v)]`` and ``std = g·√(-dt)``.
Noise is switched per row and step (``noise`` mask): a step without noise is the plain
Euler step, has std 0 and log-probability 0, so one trajectory can mix ODE and SDE steps
(MixGRPO, Flow-GRPO-Fast). A step with std 0 is never trained.

Log-prob conventions (``logprob``, :data:`LOGPROB_FORMS`): ``gaussian`` is the density above
(Flow-GRPO's ``sde`` step, DanceGRPO); ``neg_mse`` is ``-mean((x' - μ)²)``, without the
``1/(2·std²)`` factor and the constants, as Flow-GRPO's ``cps`` step
(``sd3_sde_with_logprob``, ``sde_type='cps'``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from polyrl.core.registry import Registry

SAMPLERS: Registry = Registry("sampler")

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# log-prob of a noisy step: the Gaussian log-density, or Flow-GRPO CPS's negative MSE
LOGPROB_FORMS = ("gaussian", "neg_mse")


@dataclass
class StepOutput:
    """One denoising step of a batch of rows (``B`` rows, latent shape ``L``)."""

    prev_sample: Tensor  # [B, *L] float32: the next latent x'
    mean: Tensor  # [B, *L] float32: μ
    std: Tensor  # [B] float32: the Gaussian's standard deviation (0: deterministic)
    log_prob: Tensor  # [B] float32: log N(x'; μ, std²) averaged over L; 0 where std == 0


def _rows(t: Tensor | float, like: Tensor) -> Tensor:
    """A per-row value (scalar or [B]) as float32 [B, 1, 1, ...] broadcasting over ``like``."""
    t = torch.as_tensor(t, dtype=torch.float32, device=like.device)
    if t.dim() == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x; mean, std²) in float32, averaged over all but the first dim; 0 where std == 0.

    ``std`` is per row ([B] or broadcastable to ``x``'s leading dim).
    """
    x, mean = x.float(), mean.float()
    s = _rows(std, x)
    positive = s > 0
    safe = torch.where(positive, s, torch.ones_like(s))
    lp = -((x.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _LOG_SQRT_2PI
    lp = torch.where(positive, lp, torch.zeros_like(lp))
    return lp.flatten(1).mean(1)


def neg_mse_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """-mean((x - mean)²) in float32 over all but the first dim; 0 where std == 0.

    Flow-GRPO's CPS log-prob: the density's exponent without ``1/(2·std²)`` and constants.
    """
    x, mean = x.float(), mean.float()
    positive = _rows(std, x) > 0
    lp = torch.where(positive, -((x.detach() - mean) ** 2), torch.zeros_like(x))
    return lp.flatten(1).mean(1)


def step_log_prob(x: Tensor, mean: Tensor, std: Tensor, form: str = "gaussian") -> Tensor:
    """The log-prob of ``x`` under a step, in the convention ``form`` (:data:`LOGPROB_FORMS`)."""
    if form == "gaussian":
        return gaussian_log_prob(x, mean, std)
    if form == "neg_mse":
        return neg_mse_log_prob(x, mean, std)
    raise ValueError(f"log-prob form {form!r} is not one of {LOGPROB_FORMS}")


class Sampler:
    """A Gaussian step rule: subclasses give the mean and std of a noisy step."""

    name = "base"
    stochastic = True  # False: this rule never adds noise (the ODE)

    def mean_std(
        self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(μ [B,*L], std [B,1,..]) of a noisy step; all inputs float32, σ's as [B,1,..]."""
        raise NotImplementedError

    def noise_coefficient(self, std: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
        """Flow-GRPO's ``std_dev_t`` of a step with std ``std`` ([B]; σ's [B]): the diffusion
        coefficient g before the √(-dt) factor of an Euler–Maruyama step, ``std / √(-dt)``.
        Its KL divides by its square (``policies.<name>.args.kl_form: flow_grpo``)."""
        dt = (sigma - sigma_next).float().clamp(min=0)
        return torch.where(dt > 0, std / dt.clamp(min=1e-30).sqrt(), torch.zeros_like(std))

    def step(
        self,
        x: Tensor,
        v: Tensor,
        sigma: Tensor | float,
        sigma_next: Tensor | float,
        *,
        noise_level: Tensor | float = 0.0,
        noise: Tensor | bool = True,
        generator: torch.Generator | None = None,
        prev_sample: Tensor | None = None,
        eps: Tensor | None = None,
        logprob: str = "gaussian",
    ) -> StepOutput:
        """One step from ``x`` (at σ) to σ'. With ``prev_sample`` given (recomputing a
        recorded transition) nothing is sampled and its log-probability is returned.

        ``noise`` (bool or [B] bool): rows that take a stochastic step; the others take the
        deterministic Euler step. ``eps`` overrides the standard normal draw. ``logprob``:
        the log-prob convention (:data:`LOGPROB_FORMS`).
        """
        x32, v32 = x.float(), v.float()
        s, s_next = _rows(sigma, x32), _rows(sigma_next, x32)
        a = _rows(noise_level, x32)
        dt = s_next - s
        euler = x32 + dt * v32
        noisy = (
            _rows(torch.as_tensor(noise, device=x.device), x32).bool()
            if self.stochastic
            else torch.zeros_like(s, dtype=torch.bool)
        )
        if bool(noisy.any()):
            mean, std = self.mean_std(x32, v32, s, s_next, a)
            std = torch.where(noisy, std, torch.zeros_like(std))
            mean = torch.where(noisy, mean, euler)
        else:
            mean, std = euler, torch.zeros_like(s)
        if prev_sample is None:
            if bool((std > 0).any()):
                if eps is None:
                    eps = torch.randn(
                        x32.shape,
                        generator=generator,
                        dtype=torch.float32,
                        device=generator.device if generator is not None else x32.device,
                    ).to(x32.device)
                prev_sample = mean + std * eps.float()
            else:
                prev_sample = mean
        prev_sample = prev_sample.float().detach()
        return StepOutput(
            prev_sample, mean, std.flatten(), step_log_prob(prev_sample, mean, std, logprob)
        )


class FlowSDE(Sampler):
    """Flow-GRPO's SDE: g = a·√(σ/(1-σ)), with 1 - σ' in the denominator at σ = 1."""

    name = "flow_sde"

    def mean_std(self, x, v, sigma, sigma_next, noise_level):
        denom = 1 - torch.where(sigma >= 1, sigma_next, sigma)
        g = noise_level * torch.sqrt(sigma / denom)
        return _sde_mean_std(x, v, sigma, sigma_next, g)


class DanceSDE(Sampler):
    """DanceGRPO's SDE: constant diffusion g = η (``noise_level``)."""

    name = "dance_sde"

    def mean_std(self, x, v, sigma, sigma_next, noise_level):
        return _sde_mean_std(x, v, sigma, sigma_next, noise_level.expand_as(sigma))


def _sde_mean_std(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, g: Tensor
) -> tuple[Tensor, Tensor]:
    dt = sigma_next - sigma
    # σ = 0 never starts a step; guard the division anyway (g is then 0 for flow_sde)
    drift = (g**2 / (2 * sigma.clamp(min=1e-12))) * (x + (1 - sigma) * v)
    mean = x + dt * (v + drift)
    std = g * torch.sqrt((-dt).clamp(min=0))
    return mean, std


class CPS(Sampler):
    """Coefficient-preserving sampling: std = σ'·sin(aπ/2); keeps the noise coefficient σ'."""

    name = "cps"

    def mean_std(self, x, v, sigma, sigma_next, noise_level):
        std = sigma_next * torch.sin(noise_level * math.pi / 2)
        x0 = x - sigma * v
        x1 = x + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + x1 * torch.sqrt((sigma_next**2 - std**2).clamp(min=0))
        return mean, std

    def noise_coefficient(self, std, sigma, sigma_next):
        """CPS's ``std_dev_t`` in Flow-GRPO is the step's std itself (no √(-dt) factor)."""
        return std


class ODE(Sampler):
    """The deterministic Euler step (no noise, log-probability 0)."""

    name = "ode"
    stochastic = False

    def mean_std(self, x, v, sigma, sigma_next, noise_level):
        return x + (sigma_next - sigma) * v, torch.zeros_like(sigma)


for _cls in (FlowSDE, DanceSDE, CPS, ODE):
    SAMPLERS.register(_cls.name, _cls())
del _cls


def get_sampler(name: str) -> Sampler:
    """The registered sampler ``name`` (an unknown name fails naming the nearest one)."""
    sampler = SAMPLERS.get(name)
    if isinstance(sampler, type) and issubclass(sampler, Sampler):  # 'pkg.mod:MySampler'
        sampler = sampler()
    if not isinstance(sampler, Sampler):
        raise TypeError(f"sampler {name!r} resolved to {type(sampler).__name__}, not a Sampler")
    return sampler


__all__ = [
    "CPS",
    "LOGPROB_FORMS",
    "ODE",
    "SAMPLERS",
    "DanceSDE",
    "FlowSDE",
    "Sampler",
    "StepOutput",
    "gaussian_log_prob",
    "get_sampler",
    "neg_mse_log_prob",
    "step_log_prob",
]
