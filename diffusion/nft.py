"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): RL on the forward process.

No sampler log-probs: each collected clean latent ``x0`` is noised again,
``x_t = (1 - σ)·x0 + σ·ε`` with fresh ``ε`` at the trained steps' σ, and the velocity is
trained with flow matching towards two implicit policies built from the old (sampling)
velocity ``v_old`` and the trained one ``vθ``:

    v⁺ = (1 - β)·v_old + β·vθ,        v⁻ = (1 + β)·v_old - β·vθ,
    L  = [r·‖x̂0(v⁺) - x0‖²/w⁺ + (1 - r)·‖x̂0(v⁻) - x0‖²/w⁻] / β,    x̂0(v) = x_t - σ·v,

with the optimality weight ``r = clip(A / adv_clip, -1, 1)/2 + 1/2`` in [0, 1] from the
row's advantage, and DiffusionNFT's adaptive weights ``w = mean|x̂0 - x0|`` (no gradient)
over the latent's elements; the per-step loss is scaled by ``adv_clip`` (as its
``adv_clip_max``). Training is CFG-free (the conditional velocity alone) and any sampler,
the ODE included, collects the data.

Here ``v_old`` is the policy that sampled the batch, i.e. the weights before the update: the
recipe takes one optimizer step per rollout (``ppo_epochs = minibatches = 1``), so within
the update's forward ``v_old = vθ`` detached. In that regime the gradient is
``(2r - 1)·∇‖x̂0(vθ) - x0‖²/w`` whatever β (β shapes the loss only once θ moves away from
the old policy: DiffusionNFT's EMA-lagged old policy, not implemented here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from polyrl.core.config import ConfigError, doc
from polyrl.core.registry import POLICIES, POLICY_LOSSES
from polyrl.core.train.algorithms import aggregate
from polyrl.diffusion.policy import DiffusionPolicy, DiffusionPolicyOptions

NFT_LOSS = "diffusion_nft"


def optimality(advantages: Tensor, adv_clip: float) -> Tensor:
    """DiffusionNFT's r in [0, 1]: ``clip(A, -c, c) / c / 2 + 1/2``."""
    return (advantages.clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0, 1)


def nft_loss(
    v: Tensor,
    v_old: Tensor,
    x0: Tensor,
    xt: Tensor,
    sigma: Tensor,
    r: Tensor,
    *,
    beta: float,
    adaptive: bool = True,
) -> Tensor:
    """Per-row NFT loss [B] (before the ``adv_clip`` scale) from velocities [B,*L], clean and
    noised latents [B,*L], σ [B] and r [B]; ``v_old`` carries no gradient."""
    v, v_old, x0, xt = v.float(), v_old.detach().float(), x0.float(), xt.float()
    s = sigma.float().reshape(-1, *([1] * (v.dim() - 1)))
    dims = tuple(range(1, v.dim()))

    def weighted_error(velocity: Tensor) -> Tensor:
        err = xt - s * velocity - x0
        if adaptive:
            w = err.detach().abs().mean(dims, keepdim=True).clamp(min=1e-5)
            return (err**2 / w).mean(dims)
        return (err**2).mean(dims)

    positive = weighted_error(beta * v + (1 - beta) * v_old)
    negative = weighted_error((1 + beta) * v_old - beta * v)
    r = r.float()
    return (r * positive + (1 - r) * negative) / beta


@dataclass
class NftOptions(DiffusionPolicyOptions):
    """Options of the ``diffusion_nft`` policy kind: the diffusion policy's and NFT's."""

    beta: float = doc(1.0, "β of the implicit policies v± (DiffusionNFT: 1.0; 0.1 for OCR)")
    adv_clip: float = doc(
        5.0,
        "advantage where r reaches 0 or 1 (r = clip(A/adv_clip, -1, 1)/2 + 1/2); the loss "
        "is scaled by it, as DiffusionNFT's adv_clip_max",
    )
    adaptive_weight: bool = doc(
        True,
        "divide each squared x0 error by its mean absolute error (no gradient), as DiffusionNFT",
    )

    def check(self, where: str, source: str = "<config>") -> None:
        if not self.beta > 0 or not self.adv_clip > 0:
            raise ConfigError(f"{where}: beta and adv_clip must be > 0 (in {source})")


def nft_policy_loss(logprobs, old_logprobs, advantages, mask, cfg, agg, *, weights=None):
    """Minimises the ``diffusion_nft`` policy's per-step NFT loss, which that policy returns
    negated in place of log-probs (it needs the velocities, which only the policy has)."""
    loss = -aggregate(logprobs, mask, agg)
    return loss, {"nft/loss": float(loss.detach())}


def _noise(seeds: Tensor, step: int, shape: tuple, device) -> Tensor:
    """Each row's forward-process noise at ``step``, from the seed the engine recorded: the
    same whichever micro-batch or process recomputes it."""
    rows = [
        torch.randn(shape, generator=torch.Generator().manual_seed(int(s) * 1009 + step))
        for s in seeds.tolist()
    ]
    return torch.stack(rows).to(device)


class DiffusionNftPolicy(DiffusionPolicy):
    """A diffusion policy trained with DiffusionNFT's forward-process objective.

    Its ``logprobs`` are not log-probs: for each trained step (``loss_mask``) the negated NFT
    loss of the row's clean latent noised at that step's σ (:func:`nft_loss`, scaled by
    ``adv_clip``), which the ``diffusion_nft`` policy loss minimises; the row's advantage
    (the credit's output) gives r. Sampling is the diffusion policy's, with any sampler."""

    forward_process = True  # the engine marks trained steps of any sampler, records seeds
    kl_estimators = ()  # NFT takes no KL term here

    def logprobs(self, batch, temperature: float = 1.0, with_entropy: bool = False):
        o = self.args
        batch = batch.to(self.device)
        mask = batch["loss_mask"].bool()
        b, n = mask.shape
        out = torch.zeros((b, n), dtype=torch.float32, device=self.device)
        x0_all = batch["latents"][:, -1].float()
        for t in range(n):
            rows = mask[:, t].nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            x0 = x0_all[rows]
            sigma = batch["sigmas"][rows, t].float()
            eps = _noise(batch["train_seed"][rows], t, tuple(x0.shape[1:]), self.device)
            s = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
            xt = (1 - s) * x0 + s * eps
            v = self.conditional_velocity(
                xt,
                batch["timesteps"][rows, t],
                batch["prompt_embeds"][rows],
                batch["pooled_prompt_embeds"][rows],
                batch["guidance"][rows],
            )
            r = optimality(batch["advantages"][rows, t].float(), o.adv_clip)
            loss = nft_loss(v, v, x0, xt, sigma, r, beta=o.beta, adaptive=o.adaptive_weight)
            out = out.index_put((rows, torch.full_like(rows, t)), -o.adv_clip * loss)
        return self._with_graph(out), None

    def conditional_velocity(self, x, timesteps, emb, pooled, guidance):
        """CFG-free: the conditional velocity alone (FLUX keeps its guidance embedding)."""
        if self.family.classifier_free:
            return self.family.velocity(self.model, x, timesteps, emb, pooled).float()
        return self.family.velocity(self.model, x, timesteps, emb, pooled, guidance).float()


POLICY_LOSSES.register(NFT_LOSS, nft_policy_loss)
POLICIES.register("diffusion_nft", DiffusionNftPolicy, options=NftOptions)

__all__ = [
    "NFT_LOSS",
    "DiffusionNftPolicy",
    "NftOptions",
    "nft_loss",
    "nft_policy_loss",
    "optimality",
]
