"""A diffusion policy as a team member: its engine serves the core's image requests.

The core's episode runtime hands the ``diffusion`` engine every waiting
:class:`~polyrl.core.rollout.paint.ImageRequest` of a flush in one ``paint`` call
(:class:`~polyrl.core.rollout.paint.PaintsImages`); :func:`paint` samples all their rows in one
``sample`` pass per sampling setting (training, evaluation, one per seeded request),
decodes the images and returns, per request, its :class:`~polyrl.core.rollout.paint.Painting` s:
the image, one trajectory row in the layout the ``text_to_image`` record uses
(:func:`trajectory_tensors`, so the policy's log-prob pass, KL and guards read a team's
painter rows exactly as its own workflow's), and the prompt tokens the text encoder cut.

This module imports no other module of the plugin that imports it back: the engine calls
it, and the workflow's record builds on :func:`trajectory_tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from polyrl.core.record import set_strings
from polyrl.core.rollout.paint import ImageRequest, Painting
from polyrl.diffusion.guards import ratio_scale


def trajectory_tensors(traj: Any) -> dict[str, Tensor]:
    """The per-row tensors of a diffusion record from ``Trajectories`` (``B`` rows, ``N``
    steps): latents, σ's, timesteps, log-probs, masks, embeddings, guidance, noise level;
    under ``rollout.partial`` each step's weights version (``token_version [B, N]``)."""
    b, n = traj.logprobs.shape
    out = {
        "latents": traj.latents,
        "sigmas": traj.sigmas,
        "timesteps": traj.timesteps,
        "rollout_logprobs": traj.logprobs,
        "loss_mask": traj.loss_mask.long(),
        "response_mask": torch.ones((b, n), dtype=torch.long),
        "noise_mask": traj.noise_mask,
        "prompt_embeds": traj.prompt_embeds,
        "pooled_prompt_embeds": traj.pooled_prompt_embeds,
        "negative_prompt_embeds": traj.negative_prompt_embeds,
        "negative_pooled_prompt_embeds": traj.negative_pooled_prompt_embeds,
        "guidance": traj.guidance,
        "noise_level": traj.noise_level,
    }
    if traj.train_seed is not None:  # forward-process training (NFT): its noise seeds
        out["train_seed"] = traj.train_seed
    if traj.versions is not None:  # rollout.partial: each step's weights version
        out["token_version"] = traj.versions
    return out


def prompt_cut(tokenizer: Any, prompt: str) -> int:
    """Tokens of ``prompt`` beyond what the first text encoder takes (its tokenizer's
    ``model_max_length``, special tokens counted): the encoder drops them."""
    limit = int(getattr(tokenizer, "model_max_length", 0) or 0)
    if limit <= 0 or limit > 100_000:  # no limit declared
        return 0
    ids = tokenizer(prompt, add_special_tokens=True, truncation=False)["input_ids"]
    return max(0, len(ids) - limit)


def paint(
    engine: Any,
    requests: Sequence[ImageRequest],
    sample: Callable[..., Any],
    decode: Callable[[Tensor], Tensor],
) -> list[list[Painting]]:
    """Each request's ``n`` paintings, sampled by ``sample(prompts, n=1, deterministic=...,
    generator=...)`` (one pass per setting: training rows together, evaluation rows
    together, a seeded request alone) and decoded by ``decode``."""
    policy = engine.policy
    tok = policy.tokenizer
    texts = [
        r.prompt if isinstance(r.prompt, str) else tok.decode(r.prompt, skip_special_tokens=True)
        for r in requests
    ]
    out: list[list[Painting | None]] = [[None] * r.n for r in requests]
    settings: dict[tuple, list[tuple[int, int]]] = {}
    for i, r in enumerate(requests):
        key = (r.deterministic, r.seed, -1 if r.seed is None else i)
        settings.setdefault(key, []).extend((i, k) for k in range(r.n))
    ratio_norm = bool(policy.args.ratio_norm)
    for (deterministic, seed, _), slots in settings.items():
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        traj = sample([texts[i] for i, _ in slots], n=1, deterministic=deterministic, generator=gen)
        if ratio_norm:  # GRPO-Guard: recorded as the policy recomputes them
            traj.logprobs = traj.logprobs * ratio_scale(traj.stds, engine.logprob)
        tensors = trajectory_tensors(traj)
        alive = traj.alive
        images = torch.zeros((len(slots), 3, engine.height, engine.width))
        if engine.frames:
            images = torch.zeros((len(slots), 3, engine.frames, engine.height, engine.width))
        if bool(alive.any()):
            images[alive] = decode(traj.latents[alive, -1]).float().cpu()
        for row, (i, k) in enumerate(slots):
            td = TensorDict({key: t[row : row + 1] for key, t in tensors.items()}, batch_size=[1])
            set_strings(td, "sampler", [traj.sampler])
            out[i][k] = Painting(
                image=images[row],
                trajectory=td,
                versions=[] if traj.versions is None else traj.versions[row].tolist(),
                error=traj.errors[row],
                prompt_text=texts[i],
                cut_tokens=prompt_cut(tok, texts[i]),
            )
    return [[p for p in ps if p is not None] for ps in out]
