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


def _encoded(z: Tensor, return_dict: bool):
    """``encode``'s answer in diffusers' form: ``.latent_dist`` (or a tuple)."""
    out = SimpleNamespace(latent_dist=_Dist(z))
    return out if return_dict else (out.latent_dist,)


def _decoded(x: Tensor, return_dict: bool):
    """``decode``'s answer in diffusers' form: ``.sample`` (or a tuple)."""
    return SimpleNamespace(sample=x) if return_dict else (x,)


class PatchVAE(ModelMixin, ConfigMixin):
    """Pixels in [-1, 1] <-> latents by pixel (un)shuffle with factor ``patch``."""

    config_name = "config.json"

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
        self.patch = patch
        # one saved element, so the checkpoint has a weights file diffusers' loader accepts;
        # it also carries the module's dtype/device
        self.register_buffer("marker", torch.ones(1))

    def encode(self, x: Tensor, return_dict: bool = True):
        return _encoded(
            nn.functional.pixel_unshuffle(x, self.patch) if self.patch > 1 else x, return_dict
        )

    def decode(self, z: Tensor, return_dict: bool = True, **_: Any):
        return _decoded(
            nn.functional.pixel_shuffle(z, self.patch) if self.patch > 1 else z, return_dict
        )


class PatchVideoVAE(ModelMixin, ConfigMixin):
    """Videos [B, 3, F, H, W] in [-1, 1] <-> latents [B, 3p², F, H/p, W/p] by pixel
    (un)shuffle of each frame: ``decode(encode(x)) == x`` with no weights to train, so a tiny
    demo's reward sees exactly the colours the transformer drew. It has the slice of
    ``AutoencoderKLWan``'s config that ``WanPipeline`` reads (``z_dim``, ``latents_mean``,
    ``latents_std``, ``scale_factor_temporal`` = 1, ``scale_factor_spatial`` = p), and the
    ``temperal_downsample`` that ``QwenImagePipeline`` reads (the tiny Qwen-Image's VAE)."""

    config_name = "config.json"

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
        self.patch = patch
        self.register_buffer("marker", torch.ones(1))  # a weights file diffusers accepts

    @staticmethod
    def _framewise(x: Tensor, fn) -> Tensor:
        b, c, f, h, w = x.shape
        y = fn(x.transpose(1, 2).reshape(b * f, c, h, w))
        return y.reshape(b, f, *y.shape[1:]).transpose(1, 2)

    @property
    def temperal_downsample(self) -> list[bool]:
        """One entry per 2x spatial level, no temporal one: ``QwenImagePipeline`` reads its
        VAE factor as ``2 ** len(vae.temperal_downsample)`` (diffusers' spelling)."""
        return [False] * int(math.log2(self.patch))

    def encode(self, x: Tensor, return_dict: bool = True):
        z = self._framewise(x, lambda v: nn.functional.pixel_unshuffle(v, self.patch))
        return _encoded(z, return_dict)

    def decode(self, z: Tensor, return_dict: bool = True, **_: Any):
        x = self._framewise(z, lambda v: nn.functional.pixel_shuffle(v, self.patch))
        return _decoded(x, return_dict)
