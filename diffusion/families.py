"""What a model family is, the registry of families, and how a checkpoint finds its own.

A family is the part of the diffusion policy that knows one diffusers architecture: it
loads the trainable transformer and the frozen text encoders, VAE and scheduler of a
checkpoint, and gives the engine, the policy and the pre-training the few operations they
need (:class:`Family`). The four built-in families (SD3, FLUX.1, Qwen-Image, Wan 2.1) live
in :mod:`polyrl.diffusion.models` (SD3 and the base they share), :mod:`.packed` (FLUX.1,
Qwen-Image) and :mod:`.wan` and register themselves in :data:`FAMILIES`; a checkpoint's
family is the one whose :meth:`Family.matches` accepts its ``transformer/config.json``
(:func:`detect_family`). A new architecture is one more class with this protocol,
registered as ``FAMILIES.register("name", MyFamily)`` when its plugin is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from diffusers import ConfigMixin
from torch import Tensor, nn

from polyrl.core.registry import Registry


@dataclass
class Schedule:
    sigmas: Tensor  # [N+1] float32, sigmas[0] = 1 (unless shifted), sigmas[N] = 0
    timesteps: Tensor  # [N] float32, what the transformer is given


class Family(Protocol):
    """What the policy, the engine and the pre-training use of a model family.

    A family class is built as ``family(path, *, dtype, device, load_t5=True,
    max_sequence_length=None)`` (None: the family's default length; ``load_t5=False``:
    SD3 without T5, refused by families whose embeddings come from that encoder).

    Latents are always in the VAE's layout (``[C, h, w]``, a video family's ``[C, F, h, w]``);
    any packing into tokens happens inside :meth:`velocity` alone, so samplers, records and
    log-probs never see it. Embeddings are float32: ``encode`` returns a sequence and a
    "pooled" slot per prompt (a family without a pooled embedding puts its mask there, or an
    empty ``[n, 0]``) so every family fits one record layout.
    """

    name: ClassVar[str]
    # guidance_scale > 1 is classifier-free guidance (two branches, by the policy); False:
    # the scale is an input of the transformer (FLUX-dev's guidance embedding)
    classifier_free: ClassVar[bool]
    video: ClassVar[bool]  # latents carry a frame axis; engine.args.frames is required
    lora_targets: ClassVar[list[str]]  # PEFT target_modules when the recipe keeps the default

    path: str
    device: torch.device
    dtype: torch.dtype
    max_sequence_length: int
    transformer: nn.Module  # the part that trains
    scheduler: Any
    vae: nn.Module

    @classmethod
    def matches(cls, transformer_config: dict[str, Any]) -> bool:
        """Whether a checkpoint whose ``transformer/config.json`` is this is of the family."""
        ...

    @staticmethod
    def load_tokenizer(path: str) -> Any:
        """The tokenizer the prompt data is checked with (no model loads)."""
        ...

    @classmethod
    def pipeline_class(cls) -> Any:
        """The diffusers pipeline whose ``save_lora_weights`` writes this family's LoRA."""
        ...

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(embeddings [n, S, D], pooled slot [n, P]) of each prompt."""
        ...

    def velocity(
        self,
        model: nn.Module,
        x: Tensor,
        timesteps: Tensor,
        emb: Tensor,
        pooled: Tensor,
        guidance: Tensor | None = None,
    ) -> Tensor:
        """``model``'s prediction v = ε - x0 for latents ``x`` at ``timesteps``."""
        ...

    @staticmethod
    def rescale_cfg(guided: Tensor, cond: Tensor) -> Tensor:
        """The guided velocity after the family's own rescale (most families: unchanged)."""
        ...

    def latent_shape(self, height: int, width: int, frames: int = 0) -> tuple[int, ...]:
        """The latents' shape for a picture (video: ``frames`` frames) of that size."""
        ...

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        """The σ's and timesteps of a ``steps``-step sampling, as the family's pipeline sets them."""
        ...

    def decode(self, latents: Tensor, chunk: int = 16) -> Tensor:
        """Pixels in [0, 1] (float32, CPU) of final latents: [B, 3, H, W] (video: [B, 3, F, H, W])."""
        ...

    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """Latents of pixels in [0, 1] (images [B, 3, H, W]; video: [B, 3, F, H, W])."""
        ...


# name -> family class; a checkpoint's family is the one whose ``matches`` accepts it
FAMILIES: Registry[type[Family]] = Registry("diffusion model family")


class _TransformerConfig(ConfigMixin):
    config_name = "config.json"  # what diffusers models save their config as


def transformer_config(path: str) -> dict[str, Any]:
    """The checkpoint's ``transformer/config.json`` (a local folder or a hub id)."""
    try:
        return dict(_TransformerConfig.load_config(path, subfolder="transformer"))
    except Exception as e:  # noqa: BLE001 - any loader failure: say where we looked
        raise FileNotFoundError(
            f"{path!r} is not a diffusers checkpoint with a transformer/ folder (local path or "
            f"hub id): {type(e).__name__}: {e}"
        ) from None


def detect_family(path: str) -> str:
    """The registered name of the family of the checkpoint at ``path``."""
    cfg = transformer_config(path)
    found = [name for name in FAMILIES if FAMILIES.get(name).matches(cfg)]
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{path!r}: families {found} all claim this checkpoint; register one")
    raise ValueError(
        f"{path!r}: unsupported transformer class {cfg.get('_class_name', '')!r} (supported: "
        + ", ".join(getattr(FAMILIES.get(n), "transformer_class", n) for n in FAMILIES)
        + ")"
    )
