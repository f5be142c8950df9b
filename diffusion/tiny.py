"""Tiny SD3, FLUX, Qwen-Image and Wan-architecture models built offline, for tests and CPU demos.

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

``pretrain_steps > 0`` (SD3, Qwen-Image) then trains the transformer with flow matching on synthetic images
of coloured blobs (:mod:`.colour`), so it draws blobs before RL starts. With
``label_noise = p`` the blob's colour disagrees with the prompt in a fraction p of the
training images, so the pre-trained model follows the prompt only part of the time and
GRPO has something to fix.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Annotated

import torch

from polyrl.core.registry import MODELS, TASKS

SPECIALS = ("<|startoftext|>", "<|endoftext|>")
COMPLETE = "model_index.json"


def build_clip_tokenizer(texts: list[str], max_length: int = 8):
    """A CLIP BPE tokenizer that keeps every word of ``texts`` as one token.

    Letters (with and without the end-of-word mark) are the base alphabet, so any
    lower-case text still tokenizes; each corpus word gets the merges that build it.
    """
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIALS)}
    for c in letters:
        vocab.setdefault(c, len(vocab))
    for c in letters:
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    words = sorted({w for t in texts for w in t.lower().split() if w.isalpha()})
    for w in words:
        pieces = list(w[:-1]) + [w[-1] + "</w>"]
        cur = pieces[0]
        for p in pieces[1:]:
            if (cur, p) not in merges:
                merges.append((cur, p))
            cur += p
            vocab.setdefault(cur, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def build_t5_tokenizer(texts: list[str]):
    """A T5 (Unigram) tokenizer with every word of ``texts`` as one piece, plus letters."""
    from transformers import T5Tokenizer

    words = sorted({w for t in texts for w in t.lower().split() if w.isalpha()})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(chr(c), -5.0) for c in range(ord("a"), ord("z") + 1)]
    vocab += [("\u2581" + w, -1.0) for w in words]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _t5_encoder(vocab_size: int, hidden: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=vocab_size,
        d_model=hidden,
        d_kv=hidden // 2,
        d_ff=2 * hidden,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T5EncoderModel(cfg).eval()


def _text_encoder(
    vocab_size: int, hidden: int, proj: int, max_length: int, seed: int, projection: bool = True
):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_length,
        projection_dim=proj,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def write_tiny_sd3(
    path: Path,
    texts: list[str],
    *,
    image_size: int,
    vae_patch: int,
    layers: int,
    heads: int,
    head_dim: int,
    text_hidden: int,
    max_length: int,
    shift: float,
    seed: int,
) -> None:
    """Write an untrained tiny SD3 checkpoint to ``path`` (a new directory); the sizes'
    defaults and docs are :func:`tiny_sd3`'s."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from polyrl.diffusion.patch_vae import PatchVAE

    tok = build_clip_tokenizer(texts, max_length)
    enc1 = _text_encoder(len(tok), text_hidden, text_hidden // 2, max_length, seed + 1)
    enc2 = _text_encoder(len(tok), text_hidden, text_hidden // 2, max_length, seed + 2)
    latent = image_size // vae_patch
    channels = 3 * vae_patch * vae_patch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
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
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    transformer.save_pretrained(path / "transformer")
    scheduler.save_pretrained(path / "scheduler")
    PatchVAE(patch=vae_patch).save_pretrained(path / "vae")
    for sub, enc in (("text_encoder", enc1), ("text_encoder_2", enc2)):
        enc.save_pretrained(path / sub)
    for sub in ("tokenizer", "tokenizer_2"):
        tok.save_pretrained(path / sub)
    index = {
        "_class_name": "StableDiffusion3Pipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "vae": ["polyrl.diffusion.patch_vae", "PatchVAE"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": [None, None],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": [None, None],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    }
    # written last, by the caller's rename: its presence marks a complete checkpoint
    (path / "model_index.json.tmp").write_text(json.dumps(index, indent=2))


def write_tiny_flux(
    path: Path,
    texts: list[str],
    *,
    image_size: int,
    vae_patch: int,
    layers: int,
    single_layers: int,
    heads: int,
    head_dim: int,
    text_hidden: int,
    t5_hidden: int,
    max_length: int,
    guidance_embeds: bool,
    seed: int,
) -> None:
    """Write an untrained tiny FLUX checkpoint (``FluxPipeline`` layout) to ``path``; the
    sizes' defaults and docs are :func:`tiny_flux`'s."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from polyrl.diffusion.patch_vae import PatchVAE

    if head_dim % 4 or head_dim < 8:
        raise ValueError(f"tiny_flux head_dim must be a multiple of 4 and >= 8, got {head_dim}")
    clip_tok = build_clip_tokenizer(texts, max_length)
    t5_tok = build_t5_tokenizer(texts)
    clip = _text_encoder(
        len(clip_tok), text_hidden, text_hidden, max_length, seed + 1, projection=False
    )
    t5 = _t5_encoder(len(t5_tok), t5_hidden, seed + 2)
    channels = 3 * vae_patch * vae_patch
    # rotary axes (index, row, column): even sizes summing to the head dim
    side = (head_dim // 4 + 1) // 2 * 2
    axes = (head_dim - 2 * side, side, side)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
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
            axes_dims_rope=axes,
        )
    # FLUX.1-dev's scheduler settings
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    transformer.save_pretrained(path / "transformer")
    scheduler.save_pretrained(path / "scheduler")
    PatchVAE(patch=vae_patch).save_pretrained(path / "vae")
    clip.save_pretrained(path / "text_encoder")
    t5.save_pretrained(path / "text_encoder_2")
    clip_tok.save_pretrained(path / "tokenizer")
    t5_tok.save_pretrained(path / "tokenizer_2")
    index = {
        "_class_name": "FluxPipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "vae": ["polyrl.diffusion.patch_vae", "PatchVAE"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    }
    (path / "model_index.json.tmp").write_text(json.dumps(index, indent=2))


def _umt5_encoder(vocab_size: int, hidden: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(
        vocab_size=vocab_size,
        d_model=hidden,
        d_kv=hidden // 2,
        d_ff=2 * hidden,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UMT5EncoderModel(cfg).eval()


def write_tiny_wan(
    path: Path,
    texts: list[str],
    *,
    vae: str,
    vae_patch: int,
    layers: int,
    heads: int,
    head_dim: int,
    text_hidden: int,
    shift: float,
    seed: int,
) -> None:
    """Write an untrained tiny Wan 2.1 checkpoint (``WanPipeline`` layout) to ``path``; the
    sizes' defaults and docs are :func:`tiny_wan`'s."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    from polyrl.diffusion.wan import PatchVideoVAE

    if head_dim < 6 or head_dim % 2:
        raise ValueError(f"tiny_wan head_dim must be even and >= 6, got {head_dim}")
    tok = build_t5_tokenizer(texts)
    enc = _umt5_encoder(len(tok), text_hidden, seed + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 3)
        if vae == "patch":
            vae_model, vae_class = PatchVideoVAE(patch=vae_patch), "polyrl.diffusion.wan"
        elif vae == "wan":  # random weights: a layout check, not a usable autoencoder
            levels = int(math.log2(vae_patch))
            if 2**levels != vae_patch or levels < 1:
                raise ValueError(f"tiny_wan vae_patch must be a power of 2 >= 2, got {vae_patch}")
            vae_model = AutoencoderKLWan(
                base_dim=8,
                z_dim=4,
                dim_mult=[1] + [2] * levels,
                num_res_blocks=1,
                temperal_downsample=[False] * levels,
                # per-channel statistics like Wan's own (not 0 and 1), so the
                # normalisation is exercised
                latents_mean=[round(0.1 * k - 0.15, 2) for k in range(4)],
                latents_std=[round(1.0 + 0.25 * k, 2) for k in range(4)],
                scale_factor_temporal=1,
                scale_factor_spatial=vae_patch,
            )
            vae_class = "diffusers"
        else:
            raise ValueError(f"tiny_wan vae must be 'patch' or 'wan', got {vae!r}")
        channels = vae_model.config.z_dim
        torch.manual_seed(seed)
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
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    transformer.save_pretrained(path / "transformer")
    scheduler.save_pretrained(path / "scheduler")
    vae_model.save_pretrained(path / "vae")
    enc.save_pretrained(path / "text_encoder")
    tok.save_pretrained(path / "tokenizer")
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "vae": [vae_class, type(vae_model).__name__],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "boundary_ratio": None,
        "expand_timesteps": False,
    }
    (path / "model_index.json.tmp").write_text(json.dumps(index, indent=2))


def build_qwen_tokenizer(texts: list[str]):
    """A Qwen2 byte-level BPE tokenizer trained on ``QwenImagePipeline``'s prompt template
    filled with ``texts``: every word of the template and of the prompts is one token (as in
    Qwen's own vocabulary), so dropping the template's leading tokens, as the pipeline does,
    drops exactly the template's system part; any other text still tokenizes by bytes."""
    import re

    from diffusers import QwenImagePipeline
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    # the template and its drop index live on a pipeline instance
    pipe = QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
    )
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Qwen2's own pre-tokenizer (its split pattern, byte-level), from an empty tokenizer
    bare = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = bare._tokenizer.pre_tokenizer
    split = re.compile("|".join(map(re.escape, specials)))
    corpus = [seg for t in texts for seg in split.split(template.format(t)) if seg]
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=1 << 20, min_frequency=1, initial_alphabet=alphabet, show_progress=False
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    head = template.split("{}")[0]
    if len(tok(head).input_ids) != drop:
        raise RuntimeError(
            f"the tiny Qwen tokenizer splits QwenImagePipeline's template prefix into "
            f"{len(tok(head).input_ids)} tokens, the pipeline drops {drop}"
        )
    return tok


def _qwen_vl_encoder(vocab_size: int, hidden: int, seed: int, bos: int, eos: int):
    """A tiny Qwen2.5-VL (text model of ``hidden`` width; a one-block vision tower that
    text-only prompts never use)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = 2
    half = hidden // heads // 2  # rotary pairs per head, split over (t, h, w) as mrope does
    section = [half - 2 * (half // 3), half // 3, half // 3]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rope_scaling={"type": "mrope", "mrope_section": section},
            bos_token_id=bos,
            eos_token_id=eos,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=2,
            window_size=8,
            fullatt_block_indexes=[0],
        ),
        image_token_id=vocab_size,
        video_token_id=vocab_size + 1,
        vision_start_token_id=vocab_size + 2,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def write_tiny_qwen_image(
    path: Path,
    texts: list[str],
    *,
    vae: str,
    vae_patch: int,
    layers: int,
    heads: int,
    head_dim: int,
    text_hidden: int,
    seed: int,
) -> None:
    """Write an untrained tiny Qwen-Image checkpoint (``QwenImagePipeline`` layout) to
    ``path``; the sizes' defaults and docs are :func:`tiny_qwen_image`'s."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )

    from polyrl.diffusion.wan import PatchVideoVAE

    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"tiny_qwen_image head_dim must be even and >= 6, got {head_dim}")
    levels = int(math.log2(vae_patch))
    if 2**levels != vae_patch or levels < 1:
        raise ValueError(f"tiny_qwen_image vae_patch must be a power of 2 >= 2, got {vae_patch}")
    tok = build_qwen_tokenizer(texts)
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    enc = _qwen_vl_encoder(len(tok), text_hidden, seed + 1, *ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 3)
        if vae == "patch":
            vae_model, vae_class = PatchVideoVAE(patch=vae_patch), "polyrl.diffusion.wan"
        elif vae == "qwen":  # random weights: a layout check, not a usable autoencoder
            vae_model = AutoencoderKLQwenImage(
                base_dim=8,
                z_dim=4,
                dim_mult=[1] + [2] * levels,
                num_res_blocks=1,
                temperal_downsample=[False] * levels,
                # per-channel statistics unlike 0 and 1, so the normalisation is exercised
                latents_mean=[round(0.1 * k - 0.15, 2) for k in range(4)],
                latents_std=[round(1.0 + 0.25 * k, 2) for k in range(4)],
            )
            vae_class = "diffusers"
        else:
            raise ValueError(f"tiny_qwen_image vae must be 'patch' or 'qwen', got {vae!r}")
        channels = vae_model.config.z_dim
        # rotary axes (frame, row, column): even sizes summing to the head dim
        side = (head_dim // 3 + 1) // 2 * 2
        axes = (head_dim - 2 * side, side, side)
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * channels,
            out_channels=channels,
            num_layers=layers,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=text_hidden,
            axes_dims_rope=axes,
        )
    # Qwen-Image's scheduler settings (dynamic, exponential shift; terminal sigma 0.02)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    transformer.save_pretrained(path / "transformer")
    scheduler.save_pretrained(path / "scheduler")
    vae_model.save_pretrained(path / "vae")
    enc.save_pretrained(path / "text_encoder")
    tok.save_pretrained(path / "tokenizer")
    index = {
        "_class_name": "QwenImagePipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "vae": [vae_class, type(vae_model).__name__],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
    }
    (path / "model_index.json.tmp").write_text(json.dumps(index, indent=2))


def pretrain_colour(
    path: Path,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    label_noise: float = 0.0,
    cond_dropout: float = 0.1,
    seed: int = 0,
    log_every: int = 0,
    image_size: int | None = None,
) -> dict[str, float]:
    """Flow-matching pre-training of ``path``'s transformer (tiny SD3 or Qwen-Image) on
    coloured-blob images (``image_size`` pixels; SD3: its transformer's sample size)."""
    from polyrl.diffusion import colour
    from polyrl.diffusion.models import QwenImageFamily, SD3Family, detect_family

    cpu = dict(dtype=torch.float32, device=torch.device("cpu"))
    if detect_family(str(path)) == "qwen_image":
        # the colour prompts are short: 32 Qwen tokens hold any of them after the template
        fam = QwenImageFamily(str(path), max_sequence_length=32, **cpu)
        if image_size is None:
            raise ValueError("pre-training a tiny Qwen-Image needs image_size")
        size = image_size
    else:
        fam = SD3Family(str(path), load_t5=False, max_sequence_length=1, **cpu)
        size = fam.vae_scale * fam.transformer.config.sample_size
    names = list(colour.PALETTE)
    prompts = [t.format(c=c) for c in names for t in colour.TEMPLATES]
    emb, pooled = fam.encode(prompts + [""])
    null_emb, null_pooled = emb[-1:], pooled[-1:]
    emb, pooled = emb[:-1], pooled[:-1]
    prompt_colour = torch.tensor([names.index(colour.prompt_colour(p)) for p in prompts])
    model = fam.transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 20) * (0.1 + 0.9 * (1 - k / max(1, steps)))
    )
    gen = torch.Generator().manual_seed(seed)
    shift = fam.scheduler.config.shift
    t0, losses = time.perf_counter(), []
    for k in range(steps):
        which = torch.randint(len(prompts), (batch_size,), generator=gen)
        img_colour = prompt_colour[which].clone()
        wrong = torch.rand(batch_size, generator=gen) < label_noise
        img_colour[wrong] = torch.randint(len(names), (int(wrong.sum()),), generator=gen)
        x0 = fam.encode_images(colour.render_blobs(img_colour, size, gen, names))
        u = torch.rand(batch_size, generator=gen)
        sigma = shift * u / (1 + (shift - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma[:, None, None, None]
        xt = (1 - s) * x0 + s * eps
        drop = torch.rand(batch_size, generator=gen) < cond_dropout
        e = torch.where(drop[:, None, None], null_emb, emb[which])
        p = torch.where(drop[:, None], null_pooled, pooled[which])
        v = fam.velocity(model, xt, sigma * 1000, e, p).float()
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (k % log_every == 0 or k == steps - 1):
            print(
                f"pretrain step {k}: loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f}"
                f" ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval().requires_grad_(False)
    model.save_pretrained(path / "transformer")
    tail = losses[-max(1, steps // 10) :]
    return {"loss_last": sum(tail) / len(tail), "seconds": time.perf_counter() - t0}


def is_complete(path: str | Path) -> bool:
    return (Path(path).expanduser() / COMPLETE).is_file()


def _build_once(path: str | Path, write) -> Path:
    """Run ``write(tmp_dir)`` in a temp dir next to ``path`` and rename it into place, so a
    crash never leaves a half-built model; an existing complete checkpoint is returned."""
    path = Path(path).expanduser()
    if is_complete(path):
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists but is not a complete model; remove it to rebuild")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        try:
            os.replace(tmp, path)
        except OSError:
            if not is_complete(path):  # a concurrent builder that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# What the builders' options mean (both builders share most of them).
_IMAGE = Annotated[int, "image side in pixels"]
_PATCH = Annotated[int, "PatchVAE patch side: latents are (3*patch^2, side/patch, side/patch)"]
_HEADS = Annotated[int, "attention heads"]
_HEAD_DIM = Annotated[int, "width of one attention head"]
_TEXT = Annotated[int, "hidden size of the tiny CLIP text encoder(s)"]
_MAX_LEN = Annotated[int, "CLIP tokens per prompt"]
_CORPUS = Annotated[str, "task whose prompts make the tokenizers' vocabulary (corpus())"]


@MODELS.register("tiny_sd3")
def tiny_sd3(
    path: str | Path,
    *,
    corpus: _CORPUS = "colour",
    pretrain_steps: Annotated[
        int, "flow-matching pre-training steps on the colour task's blobs (0: untrained)"
    ] = 0,
    pretrain_batch: Annotated[int, "images per pre-training step"] = 64,
    pretrain_lr: Annotated[float, "pre-training learning rate (AdamW)"] = 2e-3,
    label_noise: Annotated[
        float, "share of pre-training images whose colour disagrees with their caption"
    ] = 0.0,
    seed: Annotated[int, "seed of the random weights and of the pre-training"] = 0,
    log_every: Annotated[int, "print the pre-training loss every this many steps (0: never)"] = 0,
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
    if corpus != "colour" and pretrain_steps:
        raise ValueError("tiny_sd3 pre-trains on the colour task only; set pretrain_steps=0")
    shape = dict(
        image_size=image_size,
        vae_patch=vae_patch,
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        text_hidden=text_hidden,
        max_length=max_length,
        shift=shift,
    )

    def write(tmp: Path) -> None:
        write_tiny_sd3(tmp, list(TASKS.get(corpus).corpus()), seed=seed, **shape)
        os.replace(tmp / "model_index.json.tmp", tmp / COMPLETE)
        if pretrain_steps:
            pretrain_colour(
                tmp,
                steps=pretrain_steps,
                batch_size=pretrain_batch,
                lr=pretrain_lr,
                label_noise=label_noise,
                seed=seed,
                log_every=log_every,
            )

    return _build_once(path, write)


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
    shape = dict(
        image_size=image_size,
        vae_patch=vae_patch,
        layers=layers,
        single_layers=single_layers,
        heads=heads,
        head_dim=head_dim,
        text_hidden=text_hidden,
        t5_hidden=t5_hidden,
        max_length=max_length,
        guidance_embeds=guidance_embeds,
    )

    def write(tmp: Path) -> None:
        write_tiny_flux(tmp, list(TASKS.get(corpus).corpus()), seed=seed, **shape)
        os.replace(tmp / "model_index.json.tmp", tmp / COMPLETE)

    return _build_once(path, write)


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
    pretrain_lr: Annotated[float, "pre-training learning rate (AdamW)"] = 2e-3,
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
    seed: Annotated[int, "seed of the random weights and of the pre-training"] = 0,
    log_every: Annotated[int, "print the pre-training loss every this many steps (0: never)"] = 0,
    image_size: _IMAGE = 16,
    vae_patch: Annotated[int, "VAE spatial factor: latents are (C, frames, side/p, side/p)"] = 2,
    layers: Annotated[int, "Wan transformer blocks"] = 2,
    heads: _HEADS = 2,
    head_dim: Annotated[int, "width of one attention head (even, >= 6; rotary axes t, h, w)"] = 24,
    text_hidden: Annotated[int, "hidden size of the tiny UMT5 text encoder"] = 32,
    shift: Annotated[float, "the flow-matching scheduler's shift (Wan 480p: 3)"] = 3.0,
) -> Path:
    """Build (once) a tiny Wan 2.1 at ``path``; pre-train it on task ``corpus``'s videos."""
    if pretrain_steps and (corpus != "colour_video" or vae != "patch"):
        raise ValueError(
            "tiny_wan pre-trains on the colour_video task with vae: patch only; set "
            "pretrain_steps=0"
        )
    shape = dict(
        vae=vae,
        vae_patch=vae_patch,
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        text_hidden=text_hidden,
        shift=shift,
    )

    def write(tmp: Path) -> None:
        write_tiny_wan(tmp, list(TASKS.get(corpus).corpus()), seed=seed, **shape)
        os.replace(tmp / "model_index.json.tmp", tmp / COMPLETE)
        if pretrain_steps:
            from polyrl.diffusion.wan import pretrain_colour_video

            pretrain_colour_video(
                tmp,
                steps=pretrain_steps,
                frames=frames,
                size=image_size,
                both_orders=both_orders,
                colours=colours,
                blob=blob,
                batch_size=pretrain_batch,
                lr=pretrain_lr,
                label_noise=label_noise,
                seed=seed,
                log_every=log_every,
            )

    return _build_once(path, write)


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
    pretrain_steps: Annotated[
        int, "flow-matching pre-training steps on the colour task's blobs (0: untrained)"
    ] = 0,
    pretrain_batch: Annotated[int, "images per pre-training step"] = 64,
    pretrain_lr: Annotated[float, "pre-training learning rate (AdamW)"] = 2e-3,
    label_noise: Annotated[
        float, "share of pre-training images whose colour disagrees with their caption"
    ] = 0.0,
    seed: Annotated[int, "seed of the random weights and of the pre-training"] = 0,
    log_every: Annotated[int, "print the pre-training loss every this many steps (0: never)"] = 0,
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
    if pretrain_steps and (corpus != "colour" or vae != "patch"):
        raise ValueError(
            "tiny_qwen_image pre-trains on the colour task with vae: patch only; set "
            "pretrain_steps=0"
        )
    shape = dict(
        vae=vae,
        vae_patch=vae_patch,
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        text_hidden=text_hidden,
    )

    def write(tmp: Path) -> None:
        write_tiny_qwen_image(tmp, list(TASKS.get(corpus).corpus()), seed=seed, **shape)
        os.replace(tmp / "model_index.json.tmp", tmp / COMPLETE)
        if pretrain_steps:
            pretrain_colour(
                tmp,
                steps=pretrain_steps,
                batch_size=pretrain_batch,
                lr=pretrain_lr,
                label_noise=label_noise,
                seed=seed,
                log_every=log_every,
                image_size=image_size,
            )

    return _build_once(path, write)
