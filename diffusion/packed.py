"""The families whose transformer sees 2x2 latent patches packed into tokens: FLUX.1 and
Qwen-Image.

Packing is a pure permutation done inside each family's ``velocity`` only
(:func:`pack_latents` / :func:`unpack_latents`), so samplers, records and log-probs keep
the VAE's ``[C, h, w]`` layout. Both set their σ's the FLUX way (:func:`shifted_schedule`:
shifted by the packed token count). What loading shares with the other families is
:class:`~polyrl.diffusion.models.DiffusersFamily`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from polyrl.diffusion.families import FAMILIES, Schedule
from polyrl.diffusion.models import DiffusersFamily, SD3Family, frame_vae


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


def load_qwen_vae(path: str, dtype: torch.dtype) -> nn.Module:
    """A Qwen-Image checkpoint's VAE: ``AutoencoderKLQwenImage`` or the tiny demos'
    PatchVideoVAE (Qwen-Image decodes one-frame videos)."""
    return frame_vae(path, dtype, "AutoencoderKLQwenImage")


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


for _family in (FluxFamily, QwenImageFamily):
    FAMILIES.register(_family.name, _family)
