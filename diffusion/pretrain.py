"""Flow-matching pre-training of the tiny diffusion models: one loop for every family.

``pretrain_steps > 0`` on a tiny builder (:mod:`polyrl.diffusion.tiny`) trains its
transformer with :func:`flow_matching` on synthetic images of coloured blobs
(:mod:`.colour`, :func:`pretrain_colour`) or colour-over-time videos (:mod:`.colour_video`,
:func:`pretrain_colour_video`), so it draws them before RL starts. With ``label_noise = p``
the colour disagrees with the prompt in a fraction p of the training pictures, so the
pre-trained model follows the prompt only part of the time and GRPO has something to fix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Pretraining:
    """Flow-matching pre-training settings: the builders' ``pretrain_*`` options."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 2e-3
    label_noise: float = 0.0
    seed: int = 0
    log_every: int = 0
    cond_dropout: float = 0.1  # share of prompts replaced by "" (for classifier-free guidance)


def flow_matching(
    fam: Any,
    path: Path,
    training: Pretraining,
    prompts: list[str],
    targets: Tensor,
    n_colours: int,
    draw: Callable[[Tensor, torch.Generator], Tensor],
) -> dict[str, float]:
    """Flow-matching pre-training of family ``fam``'s transformer, saved to
    ``path/transformer``: the one loop of every tiny model.

    Each step takes ``batch_size`` random prompts and their target colours (``targets``:
    palette indices per prompt, ``[P]`` or ``[P, k]``), replaces a ``label_noise`` share of
    them by random colours, draws the pixels with ``draw(colours, generator)``, noises
    their latents at σ from the scheduler's shifted uniform and regresses the velocity on
    ``ε - x0``; a ``cond_dropout`` share of the prompts is the empty prompt."""
    emb, pooled = fam.encode(prompts + [""])
    null_emb, null_pooled = emb[-1:], pooled[-1:]
    emb, pooled = emb[:-1], pooled[:-1]
    model = fam.transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)
    steps, batch = training.steps, training.batch_size
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 20) * (0.1 + 0.9 * (1 - k / max(1, steps)))
    )
    gen = torch.Generator().manual_seed(training.seed)
    shift = fam.scheduler.config.shift
    t0, losses, log_every = time.perf_counter(), [], training.log_every
    for k in range(steps):
        which = torch.randint(len(prompts), (batch,), generator=gen)
        colours = targets[which].clone()
        wrong = torch.rand(batch, generator=gen) < training.label_noise
        shape = (int(wrong.sum()), *targets.shape[1:])
        colours[wrong] = torch.randint(n_colours, shape, generator=gen)
        x0 = fam.encode_pixels(draw(colours, gen))
        u = torch.rand(batch, generator=gen)
        sigma = shift * u / (1 + (shift - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        xt = (1 - s) * x0 + s * eps
        drop = torch.rand(batch, generator=gen) < training.cond_dropout
        e = torch.where(drop[:, None, None], null_emb, emb[which])
        p = torch.where(drop[:, None], null_pooled, pooled[which])
        v = fam.velocity(model, xt, sigma * 1000, e, p).float()
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (k % log_every == 0 or k == steps - 1):
            recent = losses[-log_every:]
            print(
                f"pretrain step {k}: loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval().requires_grad_(False)
    model.save_pretrained(path / "transformer")
    tail = losses[-max(1, steps // 10) :]
    return {"loss_last": sum(tail) / len(tail), "seconds": time.perf_counter() - t0}


def pretrain_colour(
    path: Path, training: Pretraining, image_size: int | None = None
) -> dict[str, float]:
    """Flow-matching pre-training of ``path``'s transformer (tiny SD3 or Qwen-Image) on
    coloured-blob images (``image_size`` pixels; SD3: its transformer's sample size)."""
    from polyrl.diffusion import colour
    from polyrl.diffusion.families import detect_family
    from polyrl.diffusion.models import SD3Family
    from polyrl.diffusion.packed import QwenImageFamily

    cpu = dict(dtype=torch.float32, device=torch.device("cpu"))
    if detect_family(str(path)) == "qwen_image":
        # the colour prompts are short: 32 Qwen tokens hold any of them after the template
        fam = QwenImageFamily(str(path), max_sequence_length=32, **cpu)
        if image_size is None:
            raise ValueError("pre-training a tiny Qwen-Image needs image_size")
        size = image_size
    else:
        fam = SD3Family(str(path), load_t5=False, max_sequence_length=1, **cpu)
        size = fam.vae_scale * fam.transformer.config.sample_size
    names = list(colour.PALETTE)
    prompts = [t.format(c=c) for c in names for t in colour.TEMPLATES]
    targets = torch.tensor([names.index(colour.prompt_colour(p)) for p in prompts])

    def draw(colours: Tensor, gen: torch.Generator) -> Tensor:
        return colour.render_blobs(colours, size, gen, names)

    return flow_matching(fam, path, training, prompts, targets, len(names), draw)


def pretrain_colour_video(
    path: Path,
    training: Pretraining,
    *,
    frames: int,
    size: int,
    both_orders: bool = True,
    colours: list[str] | None = None,
    blob: bool = False,
) -> dict[str, float]:
    """Flow-matching pre-training of ``path``'s Wan transformer on colour-over-time videos.

    With ``label_noise = p`` a share p of the videos shows a random pair of colours (the
    same colour twice included) instead of the one its prompt names, so the model follows
    the prompt only part of the time and RL has something to fix."""
    from polyrl.diffusion import colour, colour_video
    from polyrl.diffusion.wan import WanFamily

    fam = WanFamily(
        str(path), dtype=torch.float32, device=torch.device("cpu"), max_sequence_length=8
    )
    names = colour.palette_names(colours)
    prompts = colour_video.corpus(both_orders, names)
    targets = torch.tensor(
        [[names.index(c) for c in colour_video.prompt_colours(p)] for p in prompts]
    )

    def draw(pair: Tensor, gen: torch.Generator) -> Tensor:
        return colour_video.render_videos(pair, frames, size, gen, names, blob)

    return flow_matching(fam, path, training, prompts, targets, len(names), draw)
