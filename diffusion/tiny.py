"""Tiny SD3, FLUX, Qwen-Image and Wan models built offline, for tests and CPU demos.

Nothing is downloaded. The checkpoint has diffusers' SD3 layout (``model_index.json``,
``transformer/``, ``scheduler/``, ``text_encoder/``, ``text_encoder_2/``, ``tokenizer/``,
``tokenizer_2/``, ``vae/``), so the policy loads it exactly like a real SD3:

- ``transformer``: a small ``SD3Transformer2DModel`` (the part GRPO trains);
- two tiny ``CLIPTextModelWithProjection`` text encoders with random frozen weights, and a
  word-level ``CLIPTokenizer`` whose vocabulary comes from a task's prompts (no T5);
- ``vae``: a :class:`~polyrl.diffusion.patch_vae.PatchVAE` (pixel unshuffle, no weights)
  instead of an ``AutoencoderKL`` -- an honest shortcut: a tiny autoencoder would have to
  be trained first, and the reward only looks at colours;
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with SD3's shift of 3.

``tiny_flux`` writes the same kind of checkpoint in ``FluxPipeline``'s layout: a small
``FluxTransformer2DModel`` (guidance embedding on, like FLUX-dev), a tiny ``CLIPTextModel``
(pooled embedding) with the word-level CLIP tokenizer, a tiny ``T5EncoderModel`` with a
Unigram ``T5Tokenizer`` holding the same words, the PatchVAE, and FLUX-dev's scheduler
settings (dynamic shifting).

``tiny_qwen_image`` writes one in ``QwenImagePipeline``'s layout: a small
``QwenImageTransformer2DModel``, a tiny ``Qwen2_5_VLForConditionalGeneration`` (built from
transformers' config classes) with a Qwen2 byte-level BPE tokenizer trained on the
pipeline's prompt template and the task's prompts, the frame-wise PatchVideoVAE (or a tiny
random ``AutoencoderKLQwenImage``), and Qwen-Image's scheduler settings.

``tiny_wan`` writes one in ``WanPipeline``'s layout: a small ``WanTransformer3DModel``, a
tiny ``UMT5EncoderModel`` with the Unigram tokenizer, the frame-wise PatchVideoVAE (or a
tiny random ``AutoencoderKLWan``), and the flow-matching Euler scheduler.

Every builder is its options and its parts: it builds the untrained parts
(:mod:`.tiny_parts`) from seeded random weights as a
:class:`~polyrl.diffusion.tiny_parts.Checkpoint`, and the one scaffold,
:func:`~polyrl.diffusion.tiny_parts.build_tiny`, does the rest: the vocabulary from the
task's prompts, the saving in the pipeline's layout, the optional pre-training, all in a
temp dir renamed into place.

``pretrain_steps > 0`` (SD3, Qwen-Image, Wan) then trains the transformer with flow
matching (:mod:`.pretrain`, one loop for every family) on synthetic images of coloured
blobs (:mod:`.colour`) or colour-over-time videos (:mod:`.colour_video`), so it draws
them before RL starts. With ``label_noise = p`` the colour disagrees with the prompt
in a fraction p of the training pictures, so the pre-trained model follows the prompt only
part of the time and GRPO has something to fix.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Annotated

from polyrl.core.registry import MODELS
from polyrl.diffusion.pretrain import Pretraining, pretrain_colour, pretrain_colour_video
from polyrl.diffusion.tiny_parts import (
    EULER,
    Checkpoint,
    build_clip_tokenizer,
    build_qwen_tokenizer,
    build_t5_tokenizer,
    build_tiny,
    flow_scheduler,
    qwen_vl_encoder,
    rope_axes,
    seeded,
    t5_encoder,
    text_encoder,
    tiny_video_vae,
)

# What the builders' options mean (the builders share most of them).
_IMAGE = Annotated[int, "image side in pixels"]
_PATCH = Annotated[int, "PatchVAE patch side: latents are (3*patch^2, side/patch, side/patch)"]
_HEADS = Annotated[int, "attention heads"]
_HEAD_DIM = Annotated[int, "width of one attention head"]
_TEXT = Annotated[int, "hidden size of the tiny CLIP text encoder(s)"]
_MAX_LEN = Annotated[int, "CLIP tokens per prompt"]
_CORPUS = Annotated[str, "task whose prompts make the tokenizers' vocabulary (corpus())"]
_SEED = Annotated[int, "seed of the random weights and of the pre-training"]
_LOG_EVERY = Annotated[int, "print the pre-training loss every this many steps (0: never)"]
_LR = Annotated[float, "pre-training learning rate (AdamW)"]
_BLOB_STEPS = Annotated[
    int, "flow-matching pre-training steps on the colour task's blobs (0: untrained)"
]
_BLOB_BATCH = Annotated[int, "images per pre-training step"]
_BLOB_NOISE = Annotated[
    float, "share of pre-training images whose colour disagrees with their caption"
]


@MODELS.register("tiny_sd3")
def tiny_sd3(
    path: str | Path,
    *,
    corpus: _CORPUS = "colour",
    pretrain_steps: _BLOB_STEPS = 0,
    pretrain_batch: _BLOB_BATCH = 64,
    pretrain_lr: _LR = 2e-3,
    label_noise: _BLOB_NOISE = 0.0,
    seed: _SEED = 0,
    log_every: _LOG_EVERY = 0,
    image_size: _IMAGE = 16,
    vae_patch: _PATCH = 2,
    layers: Annotated[int, "SD3 transformer blocks"] = 2,
    heads: _HEADS = 2,
    head_dim: _HEAD_DIM = 16,
    text_hidden: _TEXT = 32,
    max_length: _MAX_LEN = 8,
    shift: Annotated[float, "the flow-matching scheduler's shift (SD3: 3)"] = 3.0,
) -> Path:
    """Build (once) a tiny SD3 at ``path``; pre-train it on task ``corpus``'s images.

    Written to a temp dir and renamed into place, so a crash never leaves a half-built
    model; an existing complete checkpoint is returned untouched.
    """
    from diffusers import SD3Transformer2DModel

    from polyrl.diffusion.patch_vae import PatchVAE

    def parts(texts: list[str]) -> Checkpoint:
        tok = build_clip_tokenizer(texts, max_length)
        enc1 = text_encoder(len(tok), text_hidden, text_hidden // 2, max_length, seed + 1)
        enc2 = text_encoder(len(tok), text_hidden, text_hidden // 2, max_length, seed + 2)
        latent = image_size // vae_patch
        channels = 3 * vae_patch * vae_patch
        with seeded(seed):
            transformer = SD3Transformer2DModel(
                sample_size=latent,
                patch_size=2,
                in_channels=channels,
                out_channels=channels,
                num_layers=layers,
                attention_head_dim=head_dim,
                num_attention_heads=heads,
                joint_attention_dim=2 * text_hidden,
                caption_projection_dim=heads * head_dim,
                pooled_projection_dim=text_hidden,
                pos_embed_max_size=max(latent, 4),
            )
        clip = "CLIPTextModelWithProjection"
        return Checkpoint(
            "StableDiffusion3Pipeline",
            {
                "transformer": (transformer, "diffusers", "SD3Transformer2DModel"),
                "scheduler": (flow_scheduler(shift=shift), "diffusers", EULER),
                "vae": (PatchVAE(patch=vae_patch), "polyrl.diffusion.patch_vae", "PatchVAE"),
                "text_encoder": (enc1, "transformers", clip),
                "text_encoder_2": (enc2, "transformers", clip),
                "text_encoder_3": None,
                "tokenizer": (tok, "transformers", "CLIPTokenizer"),
                "tokenizer_2": (tok, "transformers", "CLIPTokenizer"),
                "tokenizer_3": None,
                "image_encoder": None,
                "feature_extractor": None,
            },
        )

    training = Pretraining(
        pretrain_steps, pretrain_batch, pretrain_lr, label_noise, seed, log_every
    )
    return build_tiny(path, parts, "tiny_sd3", corpus, training, pretrain_colour, "colour")


@MODELS.register("tiny_flux")
def tiny_flux(
    path: str | Path,
    *,
    corpus: _CORPUS = "colour",
    seed: Annotated[int, "seed of the random weights"] = 0,
    image_size: _IMAGE = 16,
    vae_patch: _PATCH = 2,
    layers: Annotated[int, "FLUX double-stream (joint) blocks"] = 1,
    single_layers: Annotated[int, "FLUX single-stream blocks"] = 1,
    heads: _HEADS = 2,
    head_dim: Annotated[int, "width of one attention head (a multiple of 4, >= 8)"] = 16,
    text_hidden: _TEXT = 32,
    t5_hidden: Annotated[int, "hidden size of the tiny T5 encoder"] = 32,
    max_length: _MAX_LEN = 8,
    guidance_embeds: Annotated[
        bool, "a guidance embedding, as FLUX-dev (false: schnell-like)"
    ] = True,
) -> Path:
    """Build (once) an untrained tiny FLUX at ``path`` (vocabulary from task ``corpus``)."""
    from diffusers import FluxTransformer2DModel

    from polyrl.diffusion.patch_vae import PatchVAE

    def parts(texts: list[str]) -> Checkpoint:
        if head_dim % 4 or head_dim < 8:
            raise ValueError(f"tiny_flux head_dim must be a multiple of 4 and >= 8, got {head_dim}")
        clip_tok = build_clip_tokenizer(texts, max_length)
        t5_tok = build_t5_tokenizer(texts)
        clip = text_encoder(
            len(clip_tok), text_hidden, text_hidden, max_length, seed + 1, projection=False
        )
        t5 = t5_encoder(len(t5_tok), t5_hidden, seed + 2)
        channels = 3 * vae_patch * vae_patch
        with seeded(seed):
            transformer = FluxTransformer2DModel(
                patch_size=1,
                in_channels=4 * channels,
                num_layers=layers,
                num_single_layers=single_layers,
                attention_head_dim=head_dim,
                num_attention_heads=heads,
                joint_attention_dim=t5_hidden,
                pooled_projection_dim=text_hidden,
                guidance_embeds=guidance_embeds,
                axes_dims_rope=rope_axes(head_dim, 4),  # (index, row, column)
            )
        # FLUX.1-dev's scheduler settings
        scheduler = flow_scheduler(dynamic=True, shift=3.0, max_shift=1.15, max_image_seq_len=4096)
        return Checkpoint(
            "FluxPipeline",
            {
                "transformer": (transformer, "diffusers", "FluxTransformer2DModel"),
                "scheduler": (scheduler, "diffusers", EULER),
                "vae": (PatchVAE(patch=vae_patch), "polyrl.diffusion.patch_vae", "PatchVAE"),
                "text_encoder": (clip, "transformers", "CLIPTextModel"),
                "text_encoder_2": (t5, "transformers", "T5EncoderModel"),
                "tokenizer": (clip_tok, "transformers", "CLIPTokenizer"),
                "tokenizer_2": (t5_tok, "transformers", "T5TokenizerFast"),
                "image_encoder": None,
                "feature_extractor": None,
            },
        )

    return build_tiny(path, parts, "tiny_flux", corpus, Pretraining(seed=seed))


@MODELS.register("tiny_wan")
def tiny_wan(
    path: str | Path,
    *,
    corpus: _CORPUS = "colour_video",
    vae: Annotated[
        str,
        "patch: the frame-wise PatchVideoVAE (exact, no weights; demos); wan: a tiny "
        "AutoencoderKLWan with random weights (layout tests only)",
    ] = "patch",
    pretrain_steps: Annotated[
        int, "flow-matching pre-training steps on colour_video's videos (0: untrained)"
    ] = 0,
    pretrain_batch: Annotated[int, "videos per pre-training step"] = 32,
    pretrain_lr: _LR = 2e-3,
    label_noise: Annotated[
        float, "share of pre-training videos whose colours disagree with their caption"
    ] = 0.0,
    frames: Annotated[int, "frames of the pre-training videos"] = 4,
    both_orders: Annotated[
        bool, "pre-train on each colour pair in both orders (colour_video's task option)"
    ] = True,
    colours: Annotated[
        list[str] | None, "palette colours of the pre-training videos (null: all four)"
    ] = None,
    blob: Annotated[bool, "pre-training videos show a blob (false: whole coloured frames)"] = False,
    seed: _SEED = 0,
    log_every: _LOG_EVERY = 0,
    image_size: _IMAGE = 16,
    vae_patch: Annotated[int, "VAE spatial factor: latents are (C, frames, side/p, side/p)"] = 2,
    layers: Annotated[int, "Wan transformer blocks"] = 2,
    heads: _HEADS = 2,
    head_dim: Annotated[int, "width of one attention head (even, >= 6; rotary axes t, h, w)"] = 24,
    text_hidden: Annotated[int, "hidden size of the tiny UMT5 text encoder"] = 32,
    shift: Annotated[float, "the flow-matching scheduler's shift (Wan 480p: 3)"] = 3.0,
) -> Path:
    """Build (once) a tiny Wan 2.1 at ``path``; pre-train it on task ``corpus``'s videos."""
    from diffusers import WanTransformer3DModel

    def parts(texts: list[str]) -> Checkpoint:
        if head_dim < 6 or head_dim % 2:
            raise ValueError(f"tiny_wan head_dim must be even and >= 6, got {head_dim}")
        tok = build_t5_tokenizer(texts)
        enc = t5_encoder(len(tok), text_hidden, seed + 1, umt5=True)
        with seeded(seed + 3):
            vae_model, vae_library = tiny_video_vae(
                "tiny_wan",
                vae,
                vae_patch,
                "AutoencoderKLWan",
                scale_factor_temporal=1,
                scale_factor_spatial=vae_patch,
            )
        channels = vae_model.config.z_dim
        with seeded(seed):
            transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=heads,
                attention_head_dim=head_dim,
                in_channels=channels,
                out_channels=channels,
                text_dim=text_hidden,
                freq_dim=32,
                ffn_dim=2 * heads * head_dim,
                num_layers=layers,
                rope_max_seq_len=64,
            )
        return Checkpoint(
            "WanPipeline",
            {
                "transformer": (transformer, "diffusers", "WanTransformer3DModel"),
                "transformer_2": None,
                "scheduler": (flow_scheduler(shift=shift), "diffusers", EULER),
                "vae": (vae_model, vae_library, type(vae_model).__name__),
                "text_encoder": (enc, "transformers", "UMT5EncoderModel"),
                "tokenizer": (tok, "transformers", "T5TokenizerFast"),
            },
            extra={"boundary_ratio": None, "expand_timesteps": False},
        )

    videos = partial(
        pretrain_colour_video,
        frames=frames,
        size=image_size,
        both_orders=both_orders,
        colours=colours,
        blob=blob,
    )
    training = Pretraining(
        pretrain_steps, pretrain_batch, pretrain_lr, label_noise, seed, log_every
    )
    return build_tiny(path, parts, "tiny_wan", corpus, training, videos, "colour_video", vae)


@MODELS.register("tiny_qwen_image")
def tiny_qwen_image(
    path: str | Path,
    *,
    corpus: _CORPUS = "colour",
    vae: Annotated[
        str,
        "patch: the frame-wise PatchVideoVAE (exact, no weights; demos); qwen: a tiny "
        "AutoencoderKLQwenImage with random weights (layout tests only)",
    ] = "patch",
    pretrain_steps: _BLOB_STEPS = 0,
    pretrain_batch: _BLOB_BATCH = 64,
    pretrain_lr: _LR = 2e-3,
    label_noise: _BLOB_NOISE = 0.0,
    seed: _SEED = 0,
    log_every: _LOG_EVERY = 0,
    image_size: Annotated[int, "side in pixels of the pre-training images"] = 16,
    vae_patch: Annotated[
        int, "VAE spatial factor (a power of 2): latents are (C, side/p, side/p)"
    ] = 2,
    layers: Annotated[int, "Qwen-Image transformer blocks"] = 1,
    heads: _HEADS = 2,
    head_dim: Annotated[int, "width of one attention head (even, >= 6; rotary axes f, h, w)"] = 16,
    text_hidden: Annotated[int, "hidden size of the tiny Qwen2.5-VL text model"] = 32,
) -> Path:
    """Build (once) a tiny Qwen-Image at ``path`` (vocabulary from task ``corpus`` and
    QwenImagePipeline's prompt template); pre-train it on task ``corpus``'s images."""
    from diffusers import QwenImageTransformer2DModel

    def parts(texts: list[str]) -> Checkpoint:
        if head_dim % 2 or head_dim < 6:
            raise ValueError(f"tiny_qwen_image head_dim must be even and >= 6, got {head_dim}")
        levels = int(math.log2(vae_patch))
        if 2**levels != vae_patch or levels < 1:
            raise ValueError(
                f"tiny_qwen_image vae_patch must be a power of 2 >= 2, got {vae_patch}"
            )
        tok = build_qwen_tokenizer(texts)
        ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
        enc = qwen_vl_encoder(len(tok), text_hidden, seed + 1, *ids)
        with seeded(seed + 3):
            vae_model, vae_library = tiny_video_vae(
                "tiny_qwen_image", vae, vae_patch, "AutoencoderKLQwenImage"
            )
        channels = vae_model.config.z_dim
        with seeded(seed):
            transformer = QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=4 * channels,
                out_channels=channels,
                num_layers=layers,
                attention_head_dim=head_dim,
                num_attention_heads=heads,
                joint_attention_dim=text_hidden,
                axes_dims_rope=rope_axes(head_dim, 3),  # (frame, row, column)
            )
        # Qwen-Image's scheduler settings (dynamic, exponential shift; terminal sigma 0.02)
        scheduler = flow_scheduler(
            dynamic=True,
            shift=1.0,
            max_shift=0.9,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        )
        return Checkpoint(
            "QwenImagePipeline",
            {
                "transformer": (transformer, "diffusers", "QwenImageTransformer2DModel"),
                "scheduler": (scheduler, "diffusers", EULER),
                "vae": (vae_model, vae_library, type(vae_model).__name__),
                "text_encoder": (enc, "transformers", "Qwen2_5_VLForConditionalGeneration"),
                "tokenizer": (tok, "transformers", "Qwen2Tokenizer"),
            },
        )

    training = Pretraining(
        pretrain_steps, pretrain_batch, pretrain_lr, label_noise, seed, log_every
    )
    pretrain = partial(pretrain_colour, image_size=image_size)
    return build_tiny(path, parts, "tiny_qwen_image", corpus, training, pretrain, "colour", vae)
