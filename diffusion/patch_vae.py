"""``PatchVAE``: an honest stand-in for a VAE in tiny CPU demos.

It folds each f x f pixel patch into channels (``pixel_unshuffle``) and unfolds it back
(``pixel_shuffle``), so ``decode(encode(x)) == x`` and no autoencoder has to be trained
first. It is a diffusers model (``ModelMixin`` + ``ConfigMixin``, no weights), so
``save_pretrained``/``from_pretrained`` and diffusers' own pipeline loading handle it
(``model_index.json`` names it ``["polyrl.diffusion.patch_vae", "PatchVAE"]``), and it has
the slice of ``AutoencoderKL``'s interface that SD3 code uses: ``config.scaling_factor``,
``config.shift_factor``, ``config.block_out_channels`` (its length sets the pipeline's VAE
scale factor), ``encode(x).latent_dist.sample()`` and ``decode(z).sample``.

``PatchVideoVAE`` is the same for videos, frame by frame, with the slice of
``AutoencoderKLWan``'s config that Wan and Qwen-Image code reads. Checkpoints name it
``["polyrl.diffusion.wan", "PatchVideoVAE"]``, where it was first defined (that module
still exports it).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import Tensor, nn


class _Dist:
    def __init__(self, z: Tensor) -> None:
        self.z = z

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return self.z

    def mode(self) -> Tensor:
        return self.z


class _PatchShuffle(ModelMixin, ConfigMixin):
    """What both VAEs share: (un)shuffling ``patch`` x ``patch`` pixel patches into channels
    picture by picture (:meth:`_pictures`), in diffusers' encode/decode forms."""

    config_name = "config.json"

    def _keep(self, patch: int) -> None:
        self.patch = patch
        # one saved element, so the checkpoint has a weights file diffusers' loader accepts;
        # it also carries the module's dtype/device
        self.register_buffer("marker", torch.ones(1))

    def _pictures(self, x: Tensor, fn) -> Tensor:
        """``fn`` on each picture of ``x`` (here: the batch of images itself)."""
        return fn(x) if self.patch > 1 else x

    def encode(self, x: Tensor, return_dict: bool = True):
        z = self._pictures(x, lambda v: nn.functional.pixel_unshuffle(v, self.patch))
        out = SimpleNamespace(latent_dist=_Dist(z))
        return out if return_dict else (out.latent_dist,)

    def decode(self, z: Tensor, return_dict: bool = True, **_: Any):
        x = self._pictures(z, lambda v: nn.functional.pixel_shuffle(v, self.patch))
        return SimpleNamespace(sample=x) if return_dict else (x,)


class PatchVAE(_PatchShuffle):
    """Pixels in [-1, 1] <-> latents by pixel (un)shuffle with factor ``patch``."""

    @register_to_config
    def __init__(
        self,
        patch: int = 2,
        in_channels: int = 3,
        scaling_factor: float = 1.0,
        shift_factor: float = 0.0,
        block_out_channels: list[int] | None = None,
        latent_channels: int | None = None,
    ) -> None:
        super().__init__()
        levels = int(math.log2(patch)) if patch > 1 else 0
        if 2**levels != patch:
            raise ValueError(f"PatchVAE patch must be a power of 2, got {patch}")
        self.register_to_config(
            block_out_channels=[in_channels] * (levels + 1),
            latent_channels=in_channels * patch * patch,
        )
        self._keep(patch)


class PatchVideoVAE(_PatchShuffle):
    """Videos [B, 3, F, H, W] in [-1, 1] <-> latents [B, 3p², F, H/p, W/p] by pixel
    (un)shuffle of each frame: ``decode(encode(x)) == x`` with no weights to train, so a tiny
    demo's reward sees exactly the colours the transformer drew. It has the slice of
    ``AutoencoderKLWan``'s config that ``WanPipeline`` reads (``z_dim``, ``latents_mean``,
    ``latents_std``, ``scale_factor_temporal`` = 1, ``scale_factor_spatial`` = p), and the
    ``temperal_downsample`` that ``QwenImagePipeline`` reads (the tiny Qwen-Image's VAE)."""

    @register_to_config
    def __init__(
        self,
        patch: int = 2,
        in_channels: int = 3,
        z_dim: int | None = None,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
        scale_factor_temporal: int = 1,
        scale_factor_spatial: int | None = None,
    ) -> None:
        super().__init__()
        z = in_channels * patch * patch
        self.register_to_config(
            z_dim=z,
            latents_mean=latents_mean or [0.0] * z,
            latents_std=latents_std or [1.0] * z,
            scale_factor_temporal=1,
            scale_factor_spatial=patch,
        )
        self._keep(patch)

    def _pictures(self, x: Tensor, fn) -> Tensor:
        """``fn`` on each frame of videos [B, C, F, H, W]."""
        b, c, f, h, w = x.shape
        y = fn(x.transpose(1, 2).reshape(b * f, c, h, w))
        return y.reshape(b, f, *y.shape[1:]).transpose(1, 2)

    @property
    def temperal_downsample(self) -> list[bool]:
        """One entry per 2x spatial level, no temporal one: ``QwenImagePipeline`` reads its
        VAE factor as ``2 ** len(vae.temperal_downsample)`` (diffusers' spelling)."""
        return [False] * int(math.log2(self.patch))
