"""Model families: what the diffusion policy needs from a diffusers checkpoint.

A family loads the trainable transformer plus its frozen parts (text encoders, VAE,
scheduler) and offers four operations: encode prompts, predict the velocity, give the
σ schedule, decode latents to images. Stable Diffusion 3 / 3.5 is implemented here
(``StableDiffusion3Pipeline`` components: ``SD3Transformer2DModel``, CLIP-L/G + optional
T5 text encoders, ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``). FLUX
(``FluxTransformer2DModel``: packed 2x2 latents, image/text position ids, guidance
embedding instead of classifier-free guidance) would be a second family with the same
four operations; it is not written yet.

A checkpoint's VAE is diffusers' ``AutoencoderKL`` or, in tiny CPU demos,
:class:`~polyrl.diffusion.patch_vae.PatchVAE` (pixel unshuffle, no weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

PATCH_VAE_CLASS = "PatchVAE"


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


@dataclass
class Schedule:
    sigmas: Tensor  # [N+1] float32, sigmas[0] = 1 (unless shifted), sigmas[N] = 0
    timesteps: Tensor  # [N] float32, what the transformer is given


class SD3Family:
    """Stable Diffusion 3 / 3.5 from a local folder or hub id in diffusers layout.

    The transformer trains; text encoders and VAE are frozen and never see gradients.
    ``text_encoder_3: false`` skips T5 (SD3 then pads with zeros, as diffusers does).
    """

    name = "sd3"

    def __init__(self, path: str, *, dtype: torch.dtype, device: torch.device,
                 load_t5: bool = True, max_sequence_length: int = 256) -> None:
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )

        self.path, self.device, self.dtype = path, device, dtype
        self.max_sequence_length = max_sequence_length
        quiet_diffusers()
        self.transformer = SD3Transformer2DModel.from_pretrained(
            path, subfolder="transformer", **dtype_kw(dtype)).to(device)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = load_vae(path, dtype).to(device).eval().requires_grad_(False)
        index = StableDiffusion3Pipeline.load_config(path)
        has_t5 = (index.get("text_encoder_3") or [None])[0] is not None
        extra = {} if (load_t5 and has_t5) else {"text_encoder_3": None, "tokenizer_3": None}
        # The pipeline object only encodes prompts (it reads the transformer's config for
        # the T5 padding width); no VAE in it.
        self.text = StableDiffusion3Pipeline.from_pretrained(
            path, transformer=self.transformer, vae=None, scheduler=self.scheduler,
            **dtype_kw(dtype), **extra)
        self.text.to(device)
        for enc in (self.text.text_encoder, self.text.text_encoder_2, self.text.text_encoder_3):
            if enc is not None:
                enc.eval().requires_grad_(False)
        self.text.set_progress_bar_config(disable=True)
        patch = self.transformer.config.patch_size
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.multiple = self.vae_scale * patch

    @staticmethod
    def load_tokenizer(path: str):
        from transformers import CLIPTokenizer

        return CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")

    # --- the four operations ---------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(embeddings [n, S, D], pooled [n, P]) in float32 on the device."""
        emb, _, pooled, _ = self.text.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return emb.float(), pooled.float()

    def velocity(self, model: nn.Module, x: Tensor, timesteps: Tensor, emb: Tensor,
                 pooled: Tensor) -> Tensor:
        """The transformer's prediction v = ε - x0 for latents ``x`` at ``timesteps``."""
        out = model(hidden_states=x.to(self.dtype), timestep=timesteps.to(self.dtype),
                    encoder_hidden_states=emb.to(self.dtype),
                    pooled_projections=pooled.to(self.dtype), return_dict=False)[0]
        return out

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        if height % self.multiple or width % self.multiple:
            raise ValueError(f"height and width must be multiples of {self.multiple} "
                             f"(VAE factor {self.vae_scale} x patch size), got {height}x{width}")
        c = self.transformer.config.in_channels
        return c, height // self.vae_scale, width // self.vae_scale

    def schedule(self, steps: int, latent_shape: tuple[int, int, int]) -> Schedule:
        """The scheduler's σ's for ``steps`` steps (diffusers' own ``set_timesteps``)."""
        kwargs = {}
        if self.scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
                calculate_shift,
            )

            p = self.transformer.config.patch_size
            seq = (latent_shape[1] // p) * (latent_shape[2] // p)
            c = self.scheduler.config
            kwargs["mu"] = calculate_shift(seq, c.get("base_image_seq_len", 256),
                                           c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        self.scheduler.set_timesteps(steps, device="cpu", **kwargs)
        return Schedule(self.scheduler.sigmas.float().clone(),
                        self.scheduler.timesteps.float().clone())

    @torch.no_grad()
    def decode(self, latents: Tensor, chunk: int = 16) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] (float32, CPU) from final latents."""
        cfg = self.vae.config
        out = []
        for start in range(0, latents.shape[0], chunk):
            z = latents[start:start + chunk].to(self.device)
            z = z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
            img = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1).cpu())
        return torch.cat(out) if out else torch.zeros((0, 3, 1, 1))

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Latents of images [B, 3, H, W] in [0, 1] (for pre-training and tests)."""
        cfg = self.vae.config
        z = self.vae.encode((images * 2 - 1).to(self.device, self.vae.dtype)).latent_dist.sample()
        return ((z.float() - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor)


FAMILIES = {"sd3": SD3Family}


def detect_family(path: str) -> str:
    """The family of a checkpoint from its transformer config (SD3 unless FLUX)."""
    from diffusers import SD3Transformer2DModel

    try:
        cfg = SD3Transformer2DModel.load_config(path, subfolder="transformer")
    except Exception as e:  # noqa: BLE001 - any loader failure: say where we looked
        raise FileNotFoundError(
            f"{path!r} is not a diffusers checkpoint with a transformer/ folder (local path or "
            f"hub id): {type(e).__name__}: {e}") from None
    name = cfg.get("_class_name", "")
    if name == "SD3Transformer2DModel":
        return "sd3"
    if name == "FluxTransformer2DModel":
        raise NotImplementedError(f"{path!r} is a FLUX checkpoint; the FLUX family is not "
                                  "implemented yet (only SD3 / SD3.5)")
    raise ValueError(f"{path!r}: unsupported transformer class {name!r} (supported: "
                     "SD3Transformer2DModel)")
