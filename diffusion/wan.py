"""Wan 2.1 text-to-video: its model family, and the import path tiny checkpoints name.

:class:`WanFamily` loads a checkpoint in ``WanPipeline``'s layout (``WanTransformer3DModel``,
UMT5, ``AutoencoderKLWan``); latents are ``[C, F, h, w]``. The rest of video follows the
plugin's layers as the image families do:

- the frame-wise VAE of tiny CPU demos: :class:`polyrl.diffusion.patch_vae.PatchVideoVAE`;
- the ``colour_video`` task: :mod:`polyrl.diffusion.colour_video`;
- the ``video_colour``, ``video_colour_accuracy`` and ``temporal_consistency`` rewards:
  :mod:`polyrl.diffusion.rewards`;
- the ``text_to_video`` workflow: :class:`polyrl.diffusion.workflow.TextToVideo`;
- the ``tiny_wan`` builder and its pre-training: :mod:`polyrl.diffusion.tiny`.

Tiny Wan and Qwen-Image checkpoints name their VAE ``["polyrl.diffusion.wan",
"PatchVideoVAE"]`` in ``model_index.json``, and diffusers' pipelines take it from there
(from an imported module only: ``polyrl.diffusion`` imports this one), so this module
exports it too.
"""

from __future__ import annotations

from typing import Any

import torch

# diffusers looks a component's loader base class up in the module the index names, so
# ModelMixin must be a name here too
from diffusers import ModelMixin
from torch import Tensor, nn

from polyrl.diffusion.families import FAMILIES, Schedule
from polyrl.diffusion.models import DiffusersFamily, frame_vae
from polyrl.diffusion.patch_vae import PatchVideoVAE

__all__ = ["ModelMixin", "PatchVideoVAE", "WanFamily", "load_video_vae"]


def load_video_vae(path: str, dtype: torch.dtype) -> nn.Module:
    """A Wan checkpoint's VAE: ``AutoencoderKLWan`` or the tiny demos' PatchVideoVAE."""
    return frame_vae(path, dtype, "AutoencoderKLWan")


class WanFamily(DiffusersFamily):
    """Wan 2.1 text-to-video from a local folder or hub id in ``WanPipeline``'s layout.

    Latents are ``[C, F, h, w]`` (``F = (frames - 1) / temporal factor + 1`` latent
    frames), the layout ``WanTransformer3DModel`` reads and ``AutoencoderKLWan`` decodes;
    samplers and log-probs treat them like image latents (averages over every element).
    Prompts: UMT5 token embeddings, zero-padded to ``max_sequence_length`` (no pooled
    embedding: an empty one keeps the record's layout). Guidance is classifier-free, each
    branch its own transformer call, as ``WanPipeline`` does. The VAE's latents are
    normalised per channel by its ``latents_mean`` / ``latents_std``.

    The σ schedule is the flow-matching Euler scheduler's with the checkpoint's shift
    (``shift`` of a ``FlowMatchEulerDiscreteScheduler``, which ``WanPipeline`` then steps
    exactly; ``flow_shift`` of the UniPC scheduler Wan's hub checkpoints ship, whose
    multistep updates an SDE sampler does not use).
    """

    name = "wan"
    label = "Wan"
    transformer_class = "WanTransformer3DModel"
    pipeline_name = "WanPipeline"
    classifier_free = True
    video = True  # latents carry a frame axis; engine.args.frames is required
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]  # self- and cross-attention
    text_source = "UMT5"

    @staticmethod
    def load_scheduler(path: str) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        cfg = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")
        if cfg.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
            return FlowMatchEulerDiscreteScheduler.from_config(cfg)
        # UniPC (Wan's hub checkpoints): the Euler scheduler with its flow shift
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=cfg.get("num_train_timesteps", 1000),
            shift=cfg.get("flow_shift", 3.0),
        )

    load_vae = staticmethod(load_video_vae)

    def setup(self) -> None:
        vc = self.vae.config
        self.temporal = int(vc.scale_factor_temporal)
        self.vae_scale = int(vc.scale_factor_spatial)
        self.multiple = self.vae_scale * self.transformer.config.patch_size[1]
        self.read_stats()

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(UMT5 embeddings [n, S, D], an empty pooled [n, 0]) in float32 on the device."""
        emb, _ = self.text.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return emb.float(), emb.new_zeros((emb.shape[0], 0)).float()

    def velocity(self, model, x, timesteps, emb, pooled, guidance=None) -> Tensor:
        """v for latents ``x`` [B, C, F, h, w] (``pooled`` and ``guidance`` unused)."""
        return model(
            hidden_states=x.to(self.dtype),
            timestep=timesteps.to(self.dtype),
            encoder_hidden_states=emb.to(self.dtype),
            return_dict=False,
        )[0]

    def latent_frames(self, frames: int) -> int:
        if frames < 1 or (frames - 1) % self.temporal:
            raise ValueError(
                f"engine.args.frames={frames}: this VAE folds {self.temporal} frames into one "
                f"latent frame after the first, so frames must be 1 + a multiple of "
                f"{self.temporal}"
            )
        return (frames - 1) // self.temporal + 1

    def latent_shape(self, height: int, width: int, frames: int = 0) -> tuple[int, ...]:
        self.check_size(height, width, "patch size")
        c = self.transformer.config.in_channels
        return c, self.latent_frames(frames), height // self.vae_scale, width // self.vae_scale

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        """The σ's of ``WanPipeline``'s ``scheduler.set_timesteps(steps)`` (Euler, shifted)."""
        self.scheduler.set_timesteps(steps, device="cpu")
        return Schedule(
            self.scheduler.sigmas.float().clone(), self.scheduler.timesteps.float().clone()
        )

    @torch.no_grad()
    def decode(self, latents: Tensor, chunk: int = 16) -> Tensor:
        """Videos [B, 3, frames, H, W] in [0, 1] (float32, CPU) from final latents, as
        ``WanPipeline`` decodes them (``latents * std + mean``)."""
        out = []
        for start in range(0, latents.shape[0], chunk):
            z = latents[start : start + chunk].to(self.device).float()
            mean, std = self._stats(z)
            video = self.vae.decode((z * std + mean).to(self.vae.dtype), return_dict=False)[0]
            out.append((video.float() / 2 + 0.5).clamp(0, 1).cpu())
        return torch.cat(out) if out else torch.zeros((0, 3, 1, 1, 1))

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """Normalised latents of videos [B, 3, frames, H, W] in [0, 1] (the posterior's mode)."""
        z = self.vae.encode((pixels * 2 - 1).to(self.device, self.vae.dtype)).latent_dist.mode()
        mean, std = self._stats(z)
        return (z.float() - mean) / std


FAMILIES.register(WanFamily.name, WanFamily)
