"""Model families: what the diffusion policy needs from a diffusers checkpoint.

A family loads the trainable transformer plus its frozen parts (text encoders, VAE,
scheduler) and offers four operations: encode prompts, predict the velocity, give the
σ schedule, decode latents to images. What loading and latents have in common is
:class:`DiffusersFamily` (here); four families build on it:

- :class:`SD3Family` (here): Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``
  components: ``SD3Transformer2DModel``, CLIP-L/G + optional T5 text encoders,
  ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``); ``guidance_scale`` is
  classifier-free guidance.
- :class:`~polyrl.diffusion.packed.FluxFamily`: FLUX.1 (``FluxPipeline`` components:
  ``FluxTransformer2DModel``, CLIP-L pooled + T5 sequence embeddings); ``guidance_scale``
  is the value given to the guidance embedding (FLUX-dev; schnell has none), never
  classifier-free guidance.
- :class:`~polyrl.diffusion.packed.QwenImageFamily`: Qwen-Image (``QwenImagePipeline``
  components: ``QwenImageTransformer2DModel``, a Qwen2.5-VL text encoder,
  ``AutoencoderKLQwenImage``); ``guidance_scale`` is the pipeline's true CFG
  (``true_cfg_scale``) with its norm rescale.
- :class:`~polyrl.diffusion.wan.WanFamily`: Wan 2.1 text-to-video (``WanPipeline``
  components: ``WanTransformer3DModel``, UMT5, ``AutoencoderKLWan``); latents
  ``[C, F, h, w]``.

Latents are always in the VAE's layout: ``[C, h, w]`` (images), ``[C, F, h, w]`` (Wan's
videos). FLUX and Qwen-Image pack 2x2 patches into tokens inside their ``velocity`` only
(a pure permutation), so samplers, records and log-probs (averages over elements) never
see the packing.

A checkpoint's VAE is diffusers' ``AutoencoderKL`` or, in tiny CPU demos,
:class:`~polyrl.diffusion.patch_vae.PatchVAE` (pixel unshuffle, no weights).

Each family keeps the :class:`~polyrl.diffusion.families.Family` protocol and is
registered in :data:`~polyrl.diffusion.families.FAMILIES` under its ``name``; a
checkpoint's family is the one whose ``matches`` accepts its transformer's config (here:
its class name), found by :func:`~polyrl.diffusion.families.detect_family`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from polyrl.diffusion.families import FAMILIES, Family, Schedule

PATCH_VAE_CLASS = "PatchVAE"
PATCH_VIDEO_VAE_CLASS = "PatchVideoVAE"


def dtype_kw(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s dtype keyword: ``dtype`` on new diffusers, ``torch_dtype`` before."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def quiet_diffusers() -> None:
    """No per-component loading bars (the run has its own progress bar)."""
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging as tlogging

    dlogging.disable_progress_bar()
    tlogging.disable_progress_bar()


def load_vae(path: str, dtype: torch.dtype) -> nn.Module:
    """The checkpoint's VAE: diffusers' ``AutoencoderKL`` or a :class:`PatchVAE`."""
    from diffusers import AutoencoderKL

    cfg = AutoencoderKL.load_config(path, subfolder="vae")
    if cfg.get("_class_name") == PATCH_VAE_CLASS:
        from polyrl.diffusion.patch_vae import PatchVAE

        return PatchVAE.from_pretrained(path, subfolder="vae")
    return AutoencoderKL.from_pretrained(path, subfolder="vae", **dtype_kw(dtype))


def decode_latents(
    vae: nn.Module, latents: Tensor, device: torch.device, chunk: int = 16
) -> Tensor:
    """Images [B, 3, H, W] in [0, 1] (float32, CPU) from latents [B, C, h, w]."""
    cfg = vae.config
    out = []
    for start in range(0, latents.shape[0], chunk):
        z = latents[start : start + chunk].to(device)
        z = z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
        img = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        out.append((img.float() / 2 + 0.5).clamp(0, 1).cpu())
    return torch.cat(out) if out else torch.zeros((0, 3, 1, 1))


def encode_images(vae: nn.Module, images: Tensor, device: torch.device) -> Tensor:
    """Latents [B, C, h, w] of images [B, 3, H, W] in [0, 1]."""
    cfg = vae.config
    z = vae.encode((images * 2 - 1).to(device, vae.dtype)).latent_dist.sample()
    return (z.float() - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor


# Default LoRA targets of the image families: the attention projections of the joint blocks
# (and, in FLUX, of the single-stream blocks, whose attention has to_q/k/v too).
ATTENTION_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


class DiffusersFamily(Family):
    """What the four families share: loading a checkpoint in its diffusers pipeline's layout.

    It subclasses the :class:`~polyrl.diffusion.families.Family` protocol, whose
    signatures (and types) the families' methods keep.

    The transformer (``transformer_class`` in ``transformer/``) trains; the scheduler, the
    VAE (:meth:`load_vae`) and the pipeline's text encoders are frozen and never see
    gradients. The pipeline object (``pipeline_name``, no VAE in it) only encodes prompts.
    A subclass gives its class names and the operations its architecture does its own way;
    :meth:`setup` reads its sizes once the parts are loaded.
    """

    name: ClassVar[str]
    transformer_class: ClassVar[str]  # diffusers' class, as transformer/config.json names it
    pipeline_name: ClassVar[str]  # the diffusers pipeline of the checkpoint's layout
    classifier_free: ClassVar[bool] = True
    video: ClassVar[bool] = False
    lora_targets: ClassVar[list[str]] = ATTENTION_LORA_TARGETS
    default_max_sequence_length: ClassVar[int] = 512
    label: ClassVar[str] = ""  # the family's name in messages ("FLUX")
    # where the prompt embeddings come from, for the error when the recipe turns T5 off
    # (None: T5 is optional, as SD3's third encoder)
    text_source: ClassVar[str | None] = None

    def __init__(
        self,
        path: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        load_t5: bool = True,
        max_sequence_length: int | None = None,
    ) -> None:
        import diffusers

        if not load_t5 and self.text_source is not None:
            raise ValueError(
                f"{path!r} is a {self.label} checkpoint: its prompt embeddings come from "
                f"{self.text_source}, so policies.<name>.args.text_encoder_3 cannot be false"
            )
        self.check(path)
        self.path, self.device, self.dtype = path, device, dtype
        self.max_sequence_length = max_sequence_length or self.default_max_sequence_length
        quiet_diffusers()
        self.transformer = (
            getattr(diffusers, self.transformer_class)
            .from_pretrained(path, subfolder="transformer", **dtype_kw(dtype))
            .to(device)
        )
        self.scheduler = self.load_scheduler(path)
        self.vae = self.load_vae(path, dtype).to(device).eval().requires_grad_(False)
        self.text = self.pipeline_class().from_pretrained(
            path,
            transformer=self.transformer,
            vae=None,
            scheduler=self.scheduler,
            **dtype_kw(dtype),
            **self.text_encoders(path, load_t5),
        )
        self.text.to(device)
        for attr in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            enc = getattr(self.text, attr, None)
            if enc is not None:
                enc.eval().requires_grad_(False)
        self.text.set_progress_bar_config(disable=True)
        self.setup()

    # --- hooks a family overrides --------------------------------------------------------
    @classmethod
    def matches(cls, transformer_config: dict[str, Any]) -> bool:
        return transformer_config.get("_class_name") == cls.transformer_class

    def check(self, path: str) -> None:
        """Refuse a checkpoint the family cannot serve, before anything loads."""

    @staticmethod
    def load_scheduler(path: str) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")

    @staticmethod
    def load_vae(path: str, dtype: torch.dtype) -> nn.Module:
        return load_vae(path, dtype)

    def text_encoders(self, path: str, load_t5: bool) -> dict[str, None]:
        """Pipeline components left out (SD3 without T5)."""
        return {}

    def setup(self) -> None:
        """Sizes read from the loaded parts (VAE factor, latent multiple, statistics)."""
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)

    @staticmethod
    def load_tokenizer(path: str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, subfolder="tokenizer")

    @classmethod
    def pipeline_class(cls):
        """The diffusers pipeline whose ``save_lora_weights`` writes this family's LoRA."""
        import diffusers

        return getattr(diffusers, cls.pipeline_name)

    @staticmethod
    def rescale_cfg(guided: Tensor, cond: Tensor) -> Tensor:
        """The guided velocity as it is (Qwen-Image rescales it)."""
        return guided

    def check_size(self, height: int, width: int, why: str) -> None:
        if height % self.multiple or width % self.multiple:
            raise ValueError(
                f"height and width must be multiples of {self.multiple} "
                f"(VAE factor {self.vae_scale} x {why}), got {height}x{width}"
            )

    # --- latents through an AutoencoderKL-like VAE (SD3, FLUX) ----------------------------
    @torch.no_grad()
    def decode(self, latents: Tensor, chunk: int = 16) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] (float32, CPU) from final latents."""
        return decode_latents(self.vae, latents, self.device, chunk)

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """Latents of images [B, 3, H, W] in [0, 1] (for pre-training and tests)."""
        return encode_images(self.vae, pixels, self.device)

    # --- per-channel latent statistics (Wan, Qwen-Image) ---------------------------------
    def read_stats(self) -> None:
        vc = self.vae.config
        self.latents_mean = torch.tensor(vc.latents_mean, dtype=torch.float32)
        self.latents_std = torch.tensor(vc.latents_std, dtype=torch.float32)

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, -1, 1, 1, 1)
        return (
            self.latents_mean.view(shape).to(like.device),
            self.latents_std.view(shape).to(like.device),
        )


class SD3Family(DiffusersFamily):
    """Stable Diffusion 3 / 3.5 from a local folder or hub id in diffusers layout.

    ``text_encoder_3: false`` skips T5 (SD3 then pads with zeros, as diffusers does).
    """

    name = "sd3"
    label = "SD3"
    transformer_class = "SD3Transformer2DModel"
    pipeline_name = "StableDiffusion3Pipeline"
    classifier_free = True  # guidance_scale > 1: v_u + w (v_c - v_u)
    default_max_sequence_length = 256

    def text_encoders(self, path: str, load_t5: bool) -> dict[str, None]:
        index = self.pipeline_class().load_config(path)
        has_t5 = (index.get("text_encoder_3") or [None])[0] is not None
        return {} if (load_t5 and has_t5) else {"text_encoder_3": None, "tokenizer_3": None}

    def setup(self) -> None:
        super().setup()
        self.multiple = self.vae_scale * self.transformer.config.patch_size

    @staticmethod
    def load_tokenizer(path: str):
        from transformers import CLIPTokenizer

        return CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")

    # --- the four operations ---------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(embeddings [n, S, D], pooled [n, P]) in float32 on the device."""
        emb, _, pooled, _ = self.text.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return emb.float(), pooled.float()

    def velocity(self, model, x, timesteps, emb, pooled, guidance=None) -> Tensor:
        """The transformer's prediction v = ε - x0 for latents ``x`` at ``timesteps``
        (``guidance`` is unused: SD3's guidance is classifier-free, done by the policy)."""
        out = model(
            hidden_states=x.to(self.dtype),
            timestep=timesteps.to(self.dtype),
            encoder_hidden_states=emb.to(self.dtype),
            pooled_projections=pooled.to(self.dtype),
            return_dict=False,
        )[0]
        return out

    def latent_shape(self, height: int, width: int, frames: int = 0) -> tuple[int, int, int]:
        self.check_size(height, width, "patch size")
        c = self.transformer.config.in_channels
        return c, height // self.vae_scale, width // self.vae_scale

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        """The scheduler's σ's for ``steps`` steps (diffusers' own ``set_timesteps``)."""
        kwargs = {}
        if self.scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
                calculate_shift,
            )

            p = self.transformer.config.patch_size
            seq = (latent_shape[1] // p) * (latent_shape[2] // p)
            c = self.scheduler.config
            kwargs["mu"] = calculate_shift(
                seq,
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.16),
            )
        self.scheduler.set_timesteps(steps, device="cpu", **kwargs)
        return Schedule(
            self.scheduler.sigmas.float().clone(), self.scheduler.timesteps.float().clone()
        )


def frame_vae(path: str, dtype: torch.dtype, cls_name: str) -> nn.Module:
    """A video-layout checkpoint's VAE: diffusers' ``cls_name`` or, in tiny CPU demos, the
    frame-wise :class:`~polyrl.diffusion.patch_vae.PatchVideoVAE`."""
    import diffusers

    cls = getattr(diffusers, cls_name)
    cfg = cls.load_config(path, subfolder="vae")
    if cfg.get("_class_name") == PATCH_VIDEO_VAE_CLASS:
        from polyrl.diffusion.patch_vae import PatchVideoVAE

        return PatchVideoVAE.from_pretrained(path, subfolder="vae")
    return cls.from_pretrained(path, subfolder="vae", **dtype_kw(dtype))


FAMILIES.register(SD3Family.name, SD3Family)
