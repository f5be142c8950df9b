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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from polyrl.core.config import ConfigError
from polyrl.core.interfaces import EngineCaps
from polyrl.core.observe.timeline import span
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.paint import ImageRequest, Painting
from polyrl.diffusion import member
from polyrl.diffusion.policy import DiffusionPolicy
from polyrl.diffusion.samplers import get_sampler
from polyrl.diffusion.sampling import (  # noqa: F401  (sampling_options: the engine's, checked)
    ENGINE_NAME,
    check_sampling,
    sampling_options,
)
from polyrl.diffusion.selection import StepSelection, noise_mask, select_steps


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
    # forward-process policies (NFT): each row's seed of its training noise
    train_seed: Tensor | None = None
    # rollout.partial: the weights version of every step [B, N] (one per sampling pass)
    versions: Tensor | None = None

    @property
    def alive(self) -> Tensor:
        return torch.tensor([not e for e in self.errors], dtype=torch.bool)


@runtime_checkable
class Denoises(Protocol):
    """What the diffusion workflows drive: an engine (or the Ray backend's handle on one,
    which forwards ``remote_methods``) that samples denoising trajectories and decodes
    latents to pixels."""

    def sample(self, prompts: list[str], **options: Any) -> Trajectories: ...  # see below

    def decode(self, latents: Tensor) -> Tensor: ...


class DiffusionEngine:
    """Samples with the policy's transformer and the configured SDE sampler.

    Its keyword parameters are its options (``policies.<name>.engine.args``), checked by
    :func:`check_sampling` when the recipe loads and again here."""

    # the policy's own module and dtype; serves the core's image requests (PaintsImages);
    # rollout.partial; the Ray backend forwards ``remote_methods`` to the engine actor
    caps = EngineCaps(
        exact_logprobs=True,
        paints_images=True,
        partial_rollouts=True,
        remote_methods=("sample", "decode", "paint", "prompt_limit"),
    )

    def __init__(
        self,
        policy: DiffusionPolicy,
        *,
        seed: int = 0,
        sampler: Annotated[
            str,
            "SDE sampler: flow_sde (Flow-GRPO), dance_sde (DanceGRPO), cps "
            "(coefficient-preserving), or 'pkg.mod:MySampler'; ode is deterministic, so "
            "it only evaluates",
        ] = "flow_sde",
        noise_level: Annotated[
            float, "flow_sde: a in g = a*sqrt(sigma/(1-sigma)); cps: a in [0, 1]; dance_sde: eta"
        ] = 0.7,
        steps: Annotated[int, "denoising steps per training rollout (>= 2)"] = 10,
        eval_steps: Annotated[int | None, "denoising steps for evaluation (null: steps)"] = None,
        guidance_scale: Annotated[
            float,
            "SD3, Wan: classifier-free guidance weight (<= 1 turns it off); Qwen-Image: "
            "QwenImagePipeline's true_cfg_scale (CFG rescaled to the conditional norm; 4 "
            "typical, <= 1 off); FLUX-dev: the guidance embedding's value (3.5 typical); "
            "FLUX-schnell: unused",
        ] = 4.5,
        negative_prompt: Annotated[
            str, "prompt of the unconditional branch (SD3, Wan, Qwen-Image: ' ' in its examples)"
        ] = "",
        height: Annotated[int, "image height in pixels"] = 512,
        width: Annotated[int, "image width in pixels"] = 512,
        frames: Annotated[
            int, "video frames per sample (a video model: Wan); 0 for an image model"
        ] = 0,
        same_noise: Annotated[bool, "all samples of one prompt start from the same noise"] = False,
        train_steps: Annotated[
            StepSelection, "which denoising steps train (the last one never does)"
        ] = StepSelection(),
        batch_size: Annotated[int, "rows per transformer forward while sampling"] = 32,
        cfg_batch: Annotated[
            bool,
            "sampling: guidance's two branches in one transformer call (as diffusers' "
            "pipeline); false: two calls laid out as in training, so recomputed log-probs "
            "match bit for bit",
        ] = True,
        decode_batch: Annotated[int, "images per VAE decode call"] = 16,
        logprob: Annotated[
            str,
            "log-prob of a noisy step: gaussian (the Gaussian log-density averaged over "
            "latent elements; Flow-GRPO's flow_sde, DanceGRPO) or neg_mse (-mean((x' - mu)^2), "
            "no 1/(2 std^2) factor nor constants; Flow-GRPO's cps). The trainer recomputes "
            "with the same convention",
        ] = "gaussian",
    ) -> None:
        if not isinstance(policy, DiffusionPolicy):
            raise TypeError(
                f"the {ENGINE_NAME!r} engine needs a diffusion policy, got {type(policy).__name__}"
            )
        self.policy = policy
        self.sampler, self.noise_level, self.steps = sampler, noise_level, steps
        self.eval_steps, self.guidance_scale = eval_steps, guidance_scale
        self.negative_prompt, self.height, self.width = negative_prompt, height, width
        self.frames = frames
        self.same_noise, self.train_steps, self.batch_size = same_noise, train_steps, batch_size
        self.cfg_batch, self.decode_batch = cfg_batch, decode_batch
        self.logprob = logprob
        check_sampling(self, "engine.args", policy.forward_process)
        video = policy.family.video
        if video != (frames > 0):
            raise ConfigError(
                f"engine.args.frames={frames}, but {policy.path!r} is "
                + ("a video model: set frames (e.g. 5)" if video else "an image model: set 0")
            )
        self.seed = seed
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.rollouts = 0  # training rollouts so far (moves the sliding window)
        self.refresh: Callable[[], int] | None = None  # set_refresh: rollout.partial

    def sync(self) -> None:  # same module as the trainer's
        return None

    # interfaces.PartialRollouts (rollout.partial): a sampling pass takes the newest
    # published weights at its start and keeps them to its end, so each trajectory is
    # sampled by one version (recorded on every step, ``token_version``); a publish during
    # a pass reaches the next one. Its steps are not split across versions: the trained
    # steps' log-probs and the ratio's denominator stay those of one policy.
    def set_refresh(self, refresh: Callable[[], int] | None) -> None:
        self.refresh = refresh

    def decode(self, latents: Tensor) -> Tensor:
        """Images [B, 3, H, W] (videos: [B, 3, frames, H, W]) in [0, 1] from final latents:
        the engine decodes, so under the Ray backend the VAE runs on the engine actor, next
        to the sampler."""
        return self.policy.family.decode(latents, chunk=self.decode_batch)

    def paint(self, requests: Sequence[ImageRequest]) -> list[list[Painting]]:
        """A flush of a team's image requests in one call (diffusion/member.py)."""
        return member.paint(self, requests, self.sample, self.decode)

    def prompt_limit(self) -> int:
        """Tokens of a prompt the first text encoder takes; longer prompts are cut."""
        return int(self.policy.tokenizer.model_max_length)

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state(), "rollouts": self.rollouts}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["rng"])
        self.rollouts = int(state.get("rollouts", 0))

    def sample(self, prompts: list[str], **options: Any) -> Trajectories:
        """:meth:`_sample` as one ``generate`` span of the timeline (traces, and the engine
        busy figures of the Prometheus endpoint)."""
        n = len(prompts) * options.get("n", 1)
        with span("generate", engine=self.policy.name, requests=n):
            return self._sample(prompts, **options)

    @torch.no_grad()
    def _sample(
        self,
        prompts: list[str],
        *,
        n: int = 1,
        deterministic: bool = False,
        steps: int | None = None,
        velocity_hook=None,
        generator: torch.Generator | None = None,
    ) -> Trajectories:
        """``n`` trajectories per prompt (prompt 0's first). ``deterministic``: the ODE at
        ``eval_steps`` (evaluation); it neither trains nor moves the sliding window.
        ``velocity_hook(step, first_row, v) -> v`` lets tests tamper with predictions;
        ``generator``: the noise of a seeded call (the engine's RNG does not advance).

        Deterministic calls draw their starting noise from a fixed seed, so every evaluation
        starts from the same noise; training calls use (and advance) the engine's RNG."""
        version = self.refresh() if self.refresh is not None else None  # partial: newest
        policy = self.policy
        gen = torch.Generator().manual_seed(self.seed + 7919) if deterministic else self.gen
        if generator is not None:  # a seeded image request: its own noise
            gen = generator
        dev = policy.device
        sampler = get_sampler(self.sampler)
        if steps is None:
            steps = (self.eval_steps or self.steps) if deterministic else self.steps
        idx = torch.arange(len(prompts)).repeat_interleave(n)
        b = idx.numel()
        emb, pooled = policy.encode(list(prompts))
        emb, pooled = emb[idx], pooled[idx]
        if policy.family.classifier_free:
            neg_emb, neg_pooled = policy.encode([self.negative_prompt])
            neg_emb = neg_emb.expand(b, *neg_emb.shape[1:]).clone()
            neg_pooled = neg_pooled.expand(b, *neg_pooled.shape[1:]).clone()
        else:  # no unconditional branch (FLUX): empty placeholders keep the record's layout
            neg_emb, neg_pooled = emb[:, :0].clone(), pooled[:, :0].clone()
        shape = policy.family.latent_shape(self.height, self.width, self.frames)
        sched = policy.family.schedule(steps, shape)
        sigmas, timesteps = sched.sigmas, sched.timesteps
        if self.same_noise:
            x = torch.randn((len(prompts), *shape), generator=gen)[idx]
        else:
            x = torch.randn((b, *shape), generator=gen)
        if deterministic:
            trained = torch.zeros((b, steps), dtype=torch.bool)
            noisy = trained.clone()
        else:
            trained = select_steps(
                self.train_steps, b, steps, rollout=self.rollouts, generator=self.gen
            )
            noisy = noise_mask(self.train_steps, trained)
        guidance = torch.full((b,), float(self.guidance_scale))
        level = torch.full((b,), float(self.noise_level))
        latents = torch.zeros((b, steps + 1, *shape), dtype=torch.float32)
        latents[:, 0] = x
        logp = torch.zeros((b, steps), dtype=torch.float32)
        stds = torch.zeros((b, steps), dtype=torch.float32)
        alive = torch.ones(b, dtype=torch.bool)
        errors = [""] * b
        chunk = self.batch_size
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
                    batched=self.cfg_batch,
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
                    logprob=self.logprob,
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
        train_seed = None
        if policy.forward_process:  # trained steps need no noise; seeds from the count
            loss_mask = trained & alive[:, None]
            base = (self.seed * 1_000_003 + self.rollouts) * 65_536
            train_seed = base + torch.arange(b, dtype=torch.long)
        else:
            loss_mask = trained & (stds > 0) & alive[:, None]
        if not deterministic:
            self.rollouts += 1
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
            sampler=self.sampler,
            errors=errors,
            train_seed=train_seed,
            versions=None if version is None else torch.full((b, steps), version),
        )


ENGINES.register(ENGINE_NAME, DiffusionEngine)
