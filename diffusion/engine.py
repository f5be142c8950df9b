"""The ``diffusion`` engine: samples denoising trajectories and records every step.

For each row it keeps the latent before and after every step, the σ's and timesteps, the
step's log-probability (float32), which steps were noisy and which ones train. It shares
the policy's module in local mode, so weight sync costs nothing; its RNG and the count of
training rollouts (which moves a sliding training window) are part of checkpoints. Under
``distributed.backend: ray`` it runs on its own actor over its own copy of the model (the
driver holds a handle with the same ``sample``/``decode``/``state_dict`` interface), and
each sync loads the trainer's weights into that copy (a LoRA adapter merged into it).

A row whose latent turns non-finite (NaN/inf) stops there: its error names the step, its
later latents are zeros, it trains nothing, and the other rows carry on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from polyrl.core.registry import ENGINES
from polyrl.diffusion.policy import ENGINE_NAME, DiffusionPolicy, DiffusionSampling
from polyrl.diffusion.samplers import get_sampler
from polyrl.diffusion.selection import noise_mask, select_steps


@dataclass
class Trajectories:
    """What one sampling call produced (``B`` rows, ``N`` steps, latent shape ``L``)."""

    latents: Tensor  # [B, N+1, *L] float32
    sigmas: Tensor  # [B, N+1]
    timesteps: Tensor  # [B, N]
    logprobs: Tensor  # [B, N] float32 (0 on deterministic steps)
    stds: Tensor  # [B, N]
    noise_mask: Tensor  # [B, N] bool
    loss_mask: Tensor  # [B, N] bool: trained steps (noisy, not last, row still finite)
    prompt_index: Tensor  # [B] which prompt each row samples
    prompt_embeds: Tensor
    pooled_prompt_embeds: Tensor
    negative_prompt_embeds: Tensor
    negative_pooled_prompt_embeds: Tensor
    guidance: Tensor  # [B]
    noise_level: Tensor  # [B]
    sampler: str
    errors: list[str] = field(default_factory=list)  # "" = fine

    @property
    def alive(self) -> Tensor:
        return torch.tensor([not e for e in self.errors], dtype=torch.bool)


class DiffusionEngine:
    """Samples with the policy's transformer and the configured SDE sampler."""

    # the Ray backend forwards these to the engine actor (core/interfaces.py RemoteMethods)
    remote_methods = ("sample", "decode")

    def __init__(self, policy: DiffusionPolicy, *, seed: int = 0, **args) -> None:
        if not isinstance(policy, DiffusionPolicy):
            raise TypeError(
                f"the {ENGINE_NAME!r} engine needs a diffusion policy, got {type(policy).__name__}"
            )
        self.policy = policy
        self.cfg: DiffusionSampling = policy.sampling
        self.seed = seed
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.rollouts = 0  # training rollouts so far (moves the sliding window)

    def sync(self) -> None:  # same module as the trainer's
        return None

    def decode(self, latents: Tensor) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] from final latents: the engine decodes, so under
        the Ray backend the VAE runs on the engine actor, next to the sampler."""
        return self.policy.decode(latents)

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state(), "rollouts": self.rollouts}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["rng"])
        self.rollouts = int(state.get("rollouts", 0))

    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        *,
        n: int = 1,
        deterministic: bool = False,
        steps: int | None = None,
        velocity_hook=None,
    ) -> Trajectories:
        """``n`` trajectories per prompt (prompt 0's first). ``deterministic``: the ODE at
        ``eval_steps`` (evaluation); it neither trains nor moves the sliding window.
        ``velocity_hook(step, first_row, v) -> v`` lets tests tamper with predictions.

        Deterministic calls draw their starting noise from a fixed seed, so every evaluation
        starts from the same noise; training calls use (and advance) the engine's RNG."""
        cfg, policy = self.cfg, self.policy
        gen = torch.Generator().manual_seed(self.seed + 7919) if deterministic else self.gen
        dev = policy.device
        sampler = get_sampler(cfg.sampler)
        if steps is None:
            steps = (cfg.eval_steps or cfg.steps) if deterministic else cfg.steps
        idx = torch.arange(len(prompts)).repeat_interleave(n)
        b = idx.numel()
        emb, pooled = policy.encode(list(prompts))
        emb, pooled = emb[idx], pooled[idx]
        if policy.family.classifier_free:
            neg_emb, neg_pooled = policy.encode([cfg.negative_prompt])
            neg_emb = neg_emb.expand(b, *neg_emb.shape[1:]).clone()
            neg_pooled = neg_pooled.expand(b, *neg_pooled.shape[1:]).clone()
        else:  # no unconditional branch (FLUX): empty placeholders keep the record's layout
            neg_emb, neg_pooled = emb[:, :0].clone(), pooled[:, :0].clone()
        shape = policy.family.latent_shape(cfg.height, cfg.width)
        sched = policy.family.schedule(steps, shape)
        sigmas, timesteps = sched.sigmas, sched.timesteps
        if cfg.same_noise:
            x = torch.randn((len(prompts), *shape), generator=gen)[idx]
        else:
            x = torch.randn((b, *shape), generator=gen)
        if deterministic:
            trained = torch.zeros((b, steps), dtype=torch.bool)
            noisy = trained.clone()
        else:
            trained = select_steps(
                cfg.train_steps, b, steps, rollout=self.rollouts, generator=self.gen
            )
            noisy = noise_mask(cfg.train_steps, trained)
        guidance = torch.full((b,), float(cfg.guidance_scale))
        level = torch.full((b,), float(cfg.noise_level))
        latents = torch.zeros((b, steps + 1, *shape), dtype=torch.float32)
        latents[:, 0] = x
        logp = torch.zeros((b, steps), dtype=torch.float32)
        stds = torch.zeros((b, steps), dtype=torch.float32)
        alive = torch.ones(b, dtype=torch.bool)
        errors = [""] * b
        chunk = cfg.batch_size
        for t in range(steps):
            new = torch.empty_like(x)
            for s in range(0, b, chunk):
                r = slice(s, s + chunk)
                xs = x[r].to(dev)
                v = policy.velocity(
                    xs,
                    timesteps[t].expand(xs.shape[0]).to(dev),
                    emb[r].to(dev),
                    pooled[r].to(dev),
                    neg_emb[r].to(dev),
                    neg_pooled[r].to(dev),
                    guidance[r].to(dev),
                    batched=cfg.cfg_batch,
                )
                if velocity_hook is not None:
                    v = velocity_hook(t, s, v)
                out = sampler.step(
                    xs,
                    v,
                    sigmas[t],
                    sigmas[t + 1],
                    noise_level=level[r].to(dev),
                    noise=(noisy[r, t] & alive[r]).to(dev),
                    generator=gen,
                )
                new[r] = out.prev_sample.cpu()
                logp[r, t] = out.log_prob.cpu()
                stds[r, t] = out.std.cpu()
            bad = alive & ~torch.isfinite(new.flatten(1)).all(1)
            for i in bad.nonzero().flatten().tolist():
                errors[i] = (
                    f"non-finite value (NaN/inf) in the sampled latent at step {t} "
                    f"(sigma {float(sigmas[t]):.4f} -> {float(sigmas[t + 1]):.4f}); "
                    "trajectory stopped, left out of the update"
                )
            alive &= ~bad
            new[~alive] = 0.0
            logp[~alive, t] = 0.0
            latents[:, t + 1] = new
            x = new
        if not deterministic:
            self.rollouts += 1
        loss_mask = trained & (stds > 0) & alive[:, None]
        return Trajectories(
            latents=latents,
            sigmas=sigmas.expand(b, -1).clone(),
            timesteps=timesteps.expand(b, -1).clone(),
            logprobs=logp,
            stds=stds,
            noise_mask=noisy,
            loss_mask=loss_mask,
            prompt_index=idx,
            prompt_embeds=emb.cpu(),
            pooled_prompt_embeds=pooled.cpu(),
            negative_prompt_embeds=neg_emb.cpu(),
            negative_pooled_prompt_embeds=neg_pooled.cpu(),
            guidance=guidance,
            noise_level=level,
            sampler=cfg.sampler,
            errors=errors,
        )


ENGINES.register(ENGINE_NAME, DiffusionEngine)
