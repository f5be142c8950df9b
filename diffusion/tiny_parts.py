"""The parts tiny diffusion checkpoints are made of, and the scaffold that writes them.

Every tiny builder (:mod:`polyrl.diffusion.tiny`) draws its untrained parts from seeded
random weights (:func:`seeded`): word-level CLIP, Unigram T5 and byte-level Qwen tokenizers
whose vocabulary is a task's prompts, one- or two-layer text encoders, the video VAEs, the
flow-matching scheduler. It hands them to :func:`build_tiny` as a :class:`Checkpoint` in its
pipeline's layout, which saves them (``model_index.json`` last), pre-trains when asked, all
in a temp dir renamed into place. Kept apart from the builders so each builder reads as its
options and its parts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core.registry import TASKS
from polyrl.core.runner.builds import build_once

if TYPE_CHECKING:
    from polyrl.diffusion.pretrain import Pretraining

SPECIALS = ("<|startoftext|>", "<|endoftext|>")
COMPLETE = "model_index.json"
DIFFUSERS_VERSION = "0.42.1"  # what the checkpoints' model_index.json records


# ---------------------------------------------------------------------- the scaffold


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Random weights drawn from ``seed``, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@dataclass
class Checkpoint:
    """A tiny model's parts, in its pipeline's layout: ``parts`` maps each component to
    (object, library, class) in ``model_index.json``'s order, None for a component the
    pipeline has and this checkpoint leaves out; ``extra``: more index keys."""

    pipeline: str
    parts: dict[str, tuple[Any, str, str] | None]
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        """Each part as ``path/<name>``, then ``model_index.json`` last."""
        index: dict[str, Any] = {
            "_class_name": self.pipeline,
            "_diffusers_version": DIFFUSERS_VERSION,
        }
        for name, part in self.parts.items():
            if part is None:
                index[name] = [None, None]
                continue
            obj, library, cls = part
            obj.save_pretrained(path / name)
            index[name] = [library, cls]
        index.update(self.extra)
        (path / COMPLETE).write_text(json.dumps(index, indent=2))


def build_tiny(
    path: str | Path,
    parts: Callable[[list[str]], Checkpoint],
    builder: str,
    corpus: str,
    training: Pretraining,
    pretrain: Callable[[Path, Pretraining], Any] | None = None,
    task: str | None = None,
    vae: str | None = None,
) -> Path:
    """What every tiny builder does: ``parts(texts)`` builds the untrained model from task
    ``corpus``'s prompts (``texts``, its tokenizers' vocabulary), which is saved, then
    pre-trained by ``pretrain(dir, training)`` when ``training.steps`` (on task ``task``
    only, and with ``vae`` given, only with the exact ``patch`` VAE), all in a temp dir
    renamed into place once complete (:func:`polyrl.core.runner.builds.build_once`)."""
    if training.steps and (corpus != task or vae not in (None, "patch")):
        raise ValueError(
            f"{builder} pre-trains on the {task} task"
            + (" with vae: patch" if vae is not None else "")
            + " only; set pretrain_steps=0"
        )

    def write(tmp: Path) -> None:
        parts(list(TASKS.get(corpus).corpus())).save(tmp)
        if training.steps:
            pretrain(tmp, training)

    return build_once(path, write, is_complete)


def is_complete(path: str | Path) -> bool:
    return (Path(path).expanduser() / COMPLETE).is_file()


# ------------------------------------------------------------- tokenizers and encoders


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


def t5_encoder(vocab_size: int, hidden: int, seed: int, umt5: bool = False):
    """A one-layer T5 encoder (UMT5's for Wan) with random weights from ``seed``."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config, model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    cfg = config(
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
    with seeded(seed):
        return model(cfg).eval()


def text_encoder(
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
    with seeded(seed):
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


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


def qwen_vl_encoder(vocab_size: int, hidden: int, seed: int, bos: int, eos: int):
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
    with seeded(seed):
        return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def tiny_video_vae(builder: str, kind: str, patch: int, real: str, **settings: Any):
    """(VAE, its library) of a video-layout tiny model: the exact frame-wise PatchVideoVAE
    (``kind`` "patch"), or diffusers' ``real`` autoencoder with random weights (a layout
    check, not a usable autoencoder; ``kind`` is ``real``'s short name, as ``wan``)."""
    import diffusers

    from polyrl.diffusion.patch_vae import PatchVideoVAE

    short = {"AutoencoderKLWan": "wan", "AutoencoderKLQwenImage": "qwen"}[real]
    if kind == "patch":
        # checkpoints name the module it was first defined in (which still exports it)
        return PatchVideoVAE(patch=patch), "polyrl.diffusion.wan"
    if kind != short:
        raise ValueError(f"{builder} vae must be 'patch' or {short!r}, got {kind!r}")
    levels = int(math.log2(patch))
    if 2**levels != patch or levels < 1:
        raise ValueError(f"{builder} vae_patch must be a power of 2 >= 2, got {patch}")
    vae = getattr(diffusers, real)(
        base_dim=8,
        z_dim=4,
        dim_mult=[1] + [2] * levels,
        num_res_blocks=1,
        temperal_downsample=[False] * levels,
        # per-channel statistics unlike 0 and 1 (as the real ones), so the normalisation
        # is exercised
        latents_mean=[round(0.1 * k - 0.15, 2) for k in range(4)],
        latents_std=[round(1.0 + 0.25 * k, 2) for k in range(4)],
        **settings,
    )
    return vae, "diffusers"


# ------------------------------------------------------------- scheduler and positions

EULER = "FlowMatchEulerDiscreteScheduler"  # every tiny checkpoint's scheduler class


def flow_scheduler(dynamic: bool = False, **settings: Any):
    """The flow-matching Euler scheduler; ``dynamic``: shifted by the image's token count,
    with the base settings FLUX.1 and Qwen-Image share."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dynamic:
        settings.update(use_dynamic_shifting=True, base_shift=0.5, base_image_seq_len=256)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **settings)


def rope_axes(head_dim: int, parts: int) -> tuple[int, int, int]:
    """Rotary axes (first axis, row, column): even sizes summing to the head dim, rows and
    columns about ``head_dim / parts`` each."""
    side = (head_dim // parts + 1) // 2 * 2
    return head_dim - 2 * side, side, side
