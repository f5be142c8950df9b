"""A supervised warm start for a diffusion policy: flow matching on given images.

For each step a batch of (prompt, image) pairs is drawn, the image is encoded to a clean
latent ``x0`` by the family's VAE, noised at ``σ = shift·u / (1 + (shift - 1)·u)`` with
``u ~ U(0, 1)`` (the scheduler's shift, as SD3's training) and fresh ``ε``,
``x_σ = (1 - σ)·x0 + σ·ε``, and the conditional velocity (no guidance) is regressed on
``ε - x0``: ``L = mean((vθ(x_σ, σ) - (ε - x0))²)``. The optimizer is the core's warm-start
AdamW (``sft_optimizer``: constant rate; the RL optimizer is untouched, a frozen reference
copy takes the warmed weights).

The ``text_to_image`` workflow runs it before the first rollout when
``rollout.args.sft_steps > 0`` (``sft_data``: a JSON-lines file of ``{"prompt": ...,
"image": path}`` rows, paths relative to the file).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from polyrl.core.config import ConfigError


def load_pairs(path: str | Path) -> tuple[list[str], Tensor]:
    """(prompts, images [N,3,H,W] in [0, 1]) from a JSON-lines file of prompt/image rows."""
    from PIL import Image

    from polyrl.diffusion.rewards import image_tensor

    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"rollout.args.sft_data={str(path)!r}: no such file")
    prompts, images = [], []
    for k, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or "prompt" not in row or "image" not in row:
            raise ConfigError(
                f"{path}:{k + 1}: a warm-start row is {{'prompt': str, 'image': path}}"
            )
        img = Path(row["image"]).expanduser()
        img = img if img.is_absolute() else path.parent / img
        if not img.is_file():
            raise ConfigError(f"{path}:{k + 1}: image {str(img)!r} does not exist")
        prompts.append(str(row["prompt"]))
        images.append(image_tensor(Image.open(img)))
    if not prompts:
        raise ConfigError(f"rollout.args.sft_data={str(path)!r} has no rows")
    sizes = {tuple(im.shape) for im in images}
    if len(sizes) > 1:
        raise ConfigError(f"{path}: warm-start images differ in size: {sorted(sizes)}")
    return prompts, torch.stack(images)


def flow_matching_loss(policy, x0: Tensor, prompts: list[str], gen: torch.Generator) -> Tensor:
    """The mean flow-matching loss of ``policy``'s conditional velocity on clean latents
    ``x0`` [B,*L] of ``prompts``, at shifted-uniform σ and noise drawn from ``gen``."""
    fam = policy.family
    b = x0.shape[0]
    shift = float(getattr(fam.scheduler.config, "shift", 1.0))
    u = torch.rand(b, generator=gen)
    sigma = shift * u / (1 + (shift - 1) * u)
    eps = torch.randn(x0.shape, generator=gen)
    s = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
    xt = ((1 - s) * x0 + s * eps).to(policy.device)
    timesteps = (sigma * fam.scheduler.config.num_train_timesteps).to(policy.device)
    emb, pooled = policy.encode(prompts)
    if fam.classifier_free:
        v = fam.velocity(policy.model, xt, timesteps, emb, pooled)
    else:  # FLUX: its guidance embedding takes the engine's guidance scale
        from polyrl.diffusion.engine import sampling_options

        g = torch.full((b,), float(sampling_options(policy.cfg).guidance_scale))
        v = fam.velocity(policy.model, xt, timesteps, emb, pooled, g.to(policy.device))
    return ((v.float() - (eps - x0).to(v.device)) ** 2).mean()


def warm_start(
    policy,
    prompts: list[str],
    images: Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float | None,
    seed: int = 0,
) -> list[float]:
    """``steps`` flow-matching steps of ``policy`` on (prompt, image) pairs drawn with
    replacement; returns the loss of every step."""
    gen = torch.Generator().manual_seed(seed)
    x0_all = policy.family.encode_pixels(images).float().cpu()
    params = [p for p in policy.model.parameters() if p.requires_grad]
    losses: list[float] = []
    with policy.sft_optimizer(lr):
        policy.model.train(True)
        for _ in range(steps):
            idx = torch.randint(len(prompts), (batch_size,), generator=gen)
            loss = flow_matching_loss(policy, x0_all[idx], [prompts[i] for i in idx], gen)
            policy.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if policy.cfg.optim.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, policy.cfg.optim.max_grad_norm)
            policy.optimizer.step()
            losses.append(float(loss.detach()))
        policy.model.train(False)
        policy.optimizer.zero_grad(set_to_none=True)
    return losses


__all__ = ["flow_matching_loss", "load_pairs", "warm_start"]
