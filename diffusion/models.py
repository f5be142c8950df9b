"""Model families: what the diffusion policy needs from a diffusers checkpoint.

A family loads the trainable transformer plus its frozen parts (text encoders, VAE,
scheduler) and offers four operations: encode prompts, predict the velocity, give the
σ schedule, decode latents to images. Four families:

- :class:`SD3Family`: Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline`` components:
  ``SD3Transformer2DModel``, CLIP-L/G + optional T5 text encoders, ``AutoencoderKL``,
  ``FlowMatchEulerDiscreteScheduler``); ``guidance_scale`` is classifier-free guidance.
- :class:`FluxFamily`: FLUX.1 (``FluxPipeline`` components: ``FluxTransformer2DModel``,
  CLIP-L pooled + T5 sequence embeddings); ``guidance_scale`` is the value given to the
  guidance embedding (FLUX-dev; schnell has none), never classifier-free guidance.
- :class:`QwenImageFamily`: Qwen-Image (``QwenImagePipeline`` components:
  ``QwenImageTransformer2DModel``, a Qwen2.5-VL text encoder, ``AutoencoderKLQwenImage``);
  ``guidance_scale`` is the pipeline's true CFG (``true_cfg_scale``) with its norm rescale.
- :class:`WanFamily`: Wan 2.1 text-to-video (``WanPipeline`` components:
  ``WanTransformer3DModel``, UMT5, ``AutoencoderKLWan``); latents ``[C, F, h, w]``.

Latents are always in the VAE's layout: ``[C, h, w]`` (images), ``[C, F, h, w]`` (Wan's
videos). FLUX and Qwen-Image pack 2x2 patches into tokens
inside their ``velocity`` only (a pure permutation), so samplers, records and
log-probs (averages over elements) never see the packing.

A checkpoint's VAE is diffusers' ``AutoencoderKL`` or, in tiny CPU demos,
:class:`~polyrl.diffusion.patch_vae.PatchVAE` (pixel unshuffle, no weights).

Each family keeps the :class:`~polyrl.diffusion.families.Family` protocol and is
registered in :data:`~polyrl.diffusion.families.FAMILIES` under its ``name``; a
checkpoint's family is the one whose ``matches`` accepts its transformer's config (here:
its class name), found by :func:`~polyrl.diffusion.families.detect_family`. What loading
and latents have in common is :class:`DiffusersFamily`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

# detect_family is re-exported for callers that import it from here
from polyrl.diffusion.families import FAMILIES, Family, Schedule, detect_family  # noqa: F401

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


def pack_latents(x: Tensor) -> Tensor:
    """[B, C, h, w] -> FLUX tokens [B, (h/2)(w/2), 4C] (2x2 patches, diffusers' order)."""
    b, c, h, w = x.shape
    return (
        x.view(b, c, h // 2, 2, w // 2, 2)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(b, (h // 2) * (w // 2), c * 4)
    )


def unpack_latents(tokens: Tensor, h: int, w: int) -> Tensor:
    """The inverse of :func:`pack_latents`: tokens -> [B, C, h, w]."""
    b, _, d = tokens.shape
    return (
        tokens.view(b, h // 2, w // 2, d // 4, 2, 2)
        .permute(0, 3, 1, 4, 2, 5)
        .reshape(b, d // 4, h, w)
    )


def image_ids(h2: int, w2: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """FLUX image position ids [h2*w2, 3]: (0, row, column) of each packed token."""
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] += torch.arange(h2)[:, None]
    ids[..., 2] += torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3).to(device=device, dtype=dtype)


def shifted_schedule(
    scheduler: Any,
    calculate_shift: Any,
    steps: int,
    latent_shape: tuple[int, int, int],
    flow_sigmas: bool = False,
) -> Schedule:
    """The σ's a FLUX-style pipeline sets: linear in 1..1/steps, shifted by the image's
    token count (dynamic shifting); with ``flow_sigmas`` the scheduler makes its own."""
    c = scheduler.config
    seq = (latent_shape[1] // 2) * (latent_shape[2] // 2)
    mu = calculate_shift(
        seq,
        c.get("base_image_seq_len", 256),
        c.get("max_image_seq_len", 4096),
        c.get("base_shift", 0.5),
        c.get("max_shift", 1.15),
    )
    if flow_sigmas:
        scheduler.set_timesteps(steps, device="cpu", mu=mu)
    else:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device="cpu", mu=mu)
    return Schedule(scheduler.sigmas.float().clone(), scheduler.timesteps.float().clone())


class PackedFamily(DiffusersFamily):
    """A family whose transformer sees 2x2 latent patches packed into tokens (FLUX,
    Qwen-Image): sides are multiples of twice the VAE factor, and the latent channels are a
    quarter of the transformer's input width."""

    def setup(self) -> None:
        super().setup()
        self.multiple = self.vae_scale * 2  # 2x2 packing

    def latent_shape(self, height: int, width: int, frames: int = 0) -> tuple[int, int, int]:
        self.check_size(height, width, f"2 for {self.label}'s 2x2 packing")
        c = self.transformer.config.in_channels // 4
        return c, height // self.vae_scale, width // self.vae_scale


class FluxFamily(PackedFamily):
    """FLUX.1 (dev or schnell) from a local folder or hub id in diffusers layout.

    Prompts: CLIP-L's pooled embedding plus T5's token embeddings (``max_sequence_length``
    tokens; text position ids are zeros). The transformer sees packed 2x2 latent tokens
    with image position ids and ``timestep / 1000``; FLUX-dev also gets the row's
    ``guidance`` through its guidance embedding (no classifier-free guidance, so one
    transformer call per step); schnell has no guidance embedding and ignores it. The σ's
    are the pipeline's: ``linspace(1, 1/N, N)`` shifted by the scheduler with
    ``mu = calculate_shift(packed sequence length)`` (dynamic shifting).
    """

    name = "flux"
    label = "FLUX"
    transformer_class = "FluxTransformer2DModel"
    pipeline_name = "FluxPipeline"
    classifier_free = False  # guidance_scale is the distilled guidance embedding's input
    text_source = "T5"

    def setup(self) -> None:
        super().setup()
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)

    load_tokenizer = staticmethod(SD3Family.load_tokenizer)  # CLIP's tokenizer/ too

    # --- the four operations ---------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(T5 embeddings [n, S, D], CLIP pooled [n, P]) in float32 on the device."""
        emb, pooled, _ = self.text.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return emb.float(), pooled.float()

    def velocity(self, model, x, timesteps, emb, pooled, guidance=None) -> Tensor:
        """v for unpacked latents ``x`` [B, C, h, w] (packed for the call, unpacked after)."""
        _, _, h, w = x.shape
        g = None
        if self.guidance_embeds:
            if guidance is None:
                raise ValueError("this FLUX transformer has a guidance embedding: give guidance")
            g = guidance.to(device=x.device, dtype=torch.float32)
        out = model(
            hidden_states=pack_latents(x).to(self.dtype),
            timestep=timesteps.to(self.dtype) / 1000,
            guidance=g,
            pooled_projections=pooled.to(self.dtype),
            encoder_hidden_states=emb.to(self.dtype),
            txt_ids=torch.zeros(emb.shape[1], 3, device=x.device, dtype=self.dtype),
            img_ids=image_ids(h // 2, w // 2, x.device, self.dtype),
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        """σ's and timesteps exactly as ``FluxPipeline.__call__`` sets them."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        return shifted_schedule(
            self.scheduler,
            calculate_shift,
            steps,
            latent_shape,
            flow_sigmas=self.scheduler.config.get("use_flow_sigmas", False),
        )


def _frame_vae(path: str, dtype: torch.dtype, cls_name: str) -> nn.Module:
    """A video-layout checkpoint's VAE: diffusers' ``cls_name`` or, in tiny CPU demos, the
    frame-wise :class:`~polyrl.diffusion.patch_vae.PatchVideoVAE`."""
    import diffusers

    cls = getattr(diffusers, cls_name)
    cfg = cls.load_config(path, subfolder="vae")
    if cfg.get("_class_name") == PATCH_VIDEO_VAE_CLASS:
        from polyrl.diffusion.patch_vae import PatchVideoVAE

        return PatchVideoVAE.from_pretrained(path, subfolder="vae")
    return cls.from_pretrained(path, subfolder="vae", **dtype_kw(dtype))


def load_video_vae(path: str, dtype: torch.dtype) -> nn.Module:
    """A Wan checkpoint's VAE: ``AutoencoderKLWan`` or the tiny demos' PatchVideoVAE."""
    return _frame_vae(path, dtype, "AutoencoderKLWan")


def load_qwen_vae(path: str, dtype: torch.dtype) -> nn.Module:
    """A Qwen-Image checkpoint's VAE: ``AutoencoderKLQwenImage`` or the tiny demos'
    PatchVideoVAE (Qwen-Image decodes one-frame videos)."""
    return _frame_vae(path, dtype, "AutoencoderKLQwenImage")


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


class QwenImageFamily(PackedFamily):
    """Qwen-Image from a local folder or hub id in ``QwenImagePipeline``'s layout.

    Prompts: the pipeline's own ``encode_prompt`` (its prompt template, the template's
    leading tokens dropped, the text encoder's last hidden states, one mask per prompt).
    Prompts differ in length, so each embedding is zero-padded to ``max_sequence_length``
    and its mask (1 = token, 0 = padding) travels in the pooled slot (Qwen-Image has no
    pooled embedding). :meth:`velocity` trims a batch to its longest prompt and passes no
    mask when none is needed, as the pipeline does. The transformer sees 2x2-packed latent
    tokens, ``img_shapes`` and ``timestep / 1000``; its rotary positions come from
    ``img_shapes`` and the text length. Guidance is the pipeline's true CFG: two calls,
    ``v_u + w (v_c - v_u)`` rescaled per packed token to the conditional velocity's norm
    (:meth:`rescale_cfg`). σ's are the pipeline's: ``linspace(1, 1/N, N)`` shifted with
    ``mu = calculate_shift(packed tokens)`` (the checkpoint's scheduler: dynamic
    shifting, exponential time shift, terminal stretch). Latents are ``[C, h, w]``; the VAE
    sees them with a frame axis, de-normalised by its ``latents_mean`` / ``latents_std``.
    """

    name = "qwen_image"
    label = "Qwen-Image"
    transformer_class = "QwenImageTransformer2DModel"
    pipeline_name = "QwenImagePipeline"
    classifier_free = True  # guidance_scale is QwenImagePipeline's true_cfg_scale
    text_source = "its Qwen2.5-VL text encoder"

    def check(self, path: str) -> None:
        pipeline = self.pipeline_class().load_config(path).get("_class_name")
        if pipeline != self.pipeline_name:
            raise ValueError(
                f"{path!r}: model_index.json names {pipeline!r}; the qwen_image family is "
                "Qwen-Image's text-to-image pipeline (QwenImagePipeline) only, not its edit, "
                "layered or ControlNet variants"
            )

    load_vae = staticmethod(load_qwen_vae)

    def setup(self) -> None:
        # QwenImagePipeline's own rule for the VAE's spatial factor
        self.vae_scale = 2 ** len(self.vae.temperal_downsample)
        self.multiple = self.vae_scale * 2  # 2x2 packing
        self.read_stats()

    @staticmethod
    def load_tokenizer(path: str):
        tok = DiffusersFamily.load_tokenizer(path)
        # the family wraps prompts in the pipeline's template itself: the prompt data must
        # stay plain text, not the text encoder's chat format
        tok.chat_template = None
        return tok

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(embeddings [n, S, D], masks [n, S]) in float32, S = ``max_sequence_length``."""
        emb, mask = self.text.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        n, s, d = emb.shape
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones((n, s), dtype=torch.long, device=emb.device)
        out = emb.new_zeros((n, self.max_sequence_length, d), dtype=torch.float32)
        out[:, :s] = emb.float()
        keep = mask.new_zeros((n, self.max_sequence_length), dtype=torch.float32)
        keep[:, :s] = mask.float()
        return out, keep

    def velocity(self, model, x, timesteps, emb, pooled, guidance=None) -> Tensor:
        """v for latents ``x`` [B, C, h, w]; ``pooled`` is the text mask (``guidance`` unused:
        true CFG is done by the policy)."""
        _, _, h, w = x.shape
        mask = pooled > 0.5
        longest = int(mask.sum(1).max()) if mask.shape[0] else 0
        emb, mask = emb[:, :longest], mask[:, :longest]
        out = model(
            hidden_states=pack_latents(x).to(self.dtype),
            timestep=timesteps.to(self.dtype) / 1000,
            encoder_hidden_states=emb.to(self.dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    @staticmethod
    def rescale_cfg(guided: Tensor, cond: Tensor) -> Tensor:
        """QwenImagePipeline's true-CFG rescale: each packed token of the guided velocity
        scaled to the norm of the conditional one (over its 4C packed values)."""
        h, w = guided.shape[-2:]
        g, c = pack_latents(guided), pack_latents(cond)
        g = g * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(g, dim=-1, keepdim=True))
        return unpack_latents(g, h, w)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        """σ's and timesteps exactly as ``QwenImagePipeline.__call__`` sets them."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        return shifted_schedule(self.scheduler, calculate_shift, steps, latent_shape)

    @torch.no_grad()
    def decode(self, latents: Tensor, chunk: int = 16) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] (float32, CPU), decoded as the pipeline does:
        ``latents / (1 / std) + mean`` on a one-frame video, the frame taken back."""
        out = []
        for start in range(0, latents.shape[0], chunk):
            z = latents[start : start + chunk].to(self.device).float().unsqueeze(2)
            mean, std = self._stats(z)
            z = z / (1.0 / std) + mean
            img = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1).cpu())
        return torch.cat(out) if out else torch.zeros((0, 3, 1, 1))

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """Normalised latents [B, C, h, w] of images [B, 3, H, W] in [0, 1] (the mode)."""
        x = (pixels * 2 - 1).to(self.device, self.vae.dtype).unsqueeze(2)
        z = self.vae.encode(x).latent_dist.mode().float()
        mean, std = self._stats(z)
        return ((z - mean) * (1.0 / std))[:, :, 0]


for _family in (SD3Family, FluxFamily, WanFamily, QwenImageFamily):
    FAMILIES.register(_family.name, _family)
