"""``PatchVAE``: an honest stand-in for a VAE in tiny CPU demos.

It folds each f x f pixel patch into channels (``pixel_unshuffle``) and unfolds it back
(``pixel_shuffle``), so ``decode(encode(x)) == x`` and no autoencoder has to be trained
first. It is a diffusers model (``ModelMixin`` + ``ConfigMixin``, no weights), so
``save_pretrained``/``from_pretrained`` and diffusers' own pipeline loading handle it
(``model_index.json`` names it ``["polyrl.diffusion.patch_vae", "PatchVAE"]``), and it has
the slice of ``AutoencoderKL``'s interface that SD3 code uses: ``config.scaling_factor``,
``config.shift_factor``, ``config.block_out_channels`` (its length sets the pipeline's VAE
scale factor), ``encode(x).latent_dist.sample()`` and ``decode(z).sample``.
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
        z = nn.functional.pixel_unshuffle(x, self.patch) if self.patch > 1 else x
        out = SimpleNamespace(latent_dist=_Dist(z))
        return out if return_dict else (out.latent_dist,)

    def decode(self, z: Tensor, return_dict: bool = True, **_: Any):
        x = nn.functional.pixel_shuffle(z, self.patch) if self.patch > 1 else z
        return SimpleNamespace(sample=x) if return_dict else (x,)
