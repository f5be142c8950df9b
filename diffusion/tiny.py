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

Every builder is its options and its parts: it builds the untrained parts from seeded
random weights (:func:`seeded`) as a :class:`Checkpoint`, and the one scaffold,
:func:`build_tiny`, does the rest: the vocabulary from the task's prompts, the saving in
the pipeline's layout, the optional pre-training, all in a temp dir renamed into place.

``pretrain_steps > 0`` (SD3, Qwen-Image, Wan) then trains the transformer with flow
matching (:func:`flow_matching`, one loop for every family) on synthetic images of
coloured blobs (:mod:`.colour`) or colour-over-time videos (:mod:`.colour_video`), so it
draws them before RL starts. With ``label_noise = p`` the colour disagrees with the prompt
in a fraction p of the training pictures, so the pre-trained model follows the prompt only
part of the time and GRPO has something to fix.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import torch
from torch import Tensor

from polyrl.core.builds import build_once
from polyrl.core.registry import MODELS, TASKS

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
    renamed into place once complete (:func:`polyrl.core.builds.build_once`)."""
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


def _t5_encoder(vocab_size: int, hidden: int, seed: int, umt5: bool = False):
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
    with seeded(seed):
        return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def _tiny_video_vae(builder: str, kind: str, patch: int, real: str, **settings: Any):
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


# ------------------------------------------------------------------------- the writers

EULER = "FlowMatchEulerDiscreteScheduler"  # every tiny checkpoint's scheduler class


def _scheduler(dynamic: bool = False, **settings: Any):
    """The flow-matching Euler scheduler; ``dynamic``: shifted by the image's token count,
    with the base settings FLUX.1 and Qwen-Image share."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dynamic:
        settings.update(use_dynamic_shifting=True, base_shift=0.5, base_image_seq_len=256)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **settings)


def _rope_axes(head_dim: int, parts: int) -> tuple[int, int, int]:
    """Rotary axes (first axis, row, column): even sizes summing to the head dim, rows and
    columns about ``head_dim / parts`` each."""
    side = (head_dim // parts + 1) // 2 * 2
    return head_dim - 2 * side, side, side


# ------------------------------------------------------------------------ pre-training


@dataclass(frozen=True)
class Pretraining:
    """Flow-matching pre-training settings: the builders' ``pretrain_*`` options."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 2e-3
    label_noise: float = 0.0
    seed: int = 0
    log_every: int = 0
    cond_dropout: float = 0.1  # share of prompts replaced by "" (for classifier-free guidance)


def flow_matching(
    fam: Any,
    path: Path,
    training: Pretraining,
    prompts: list[str],
    targets: Tensor,
    n_colours: int,
    draw: Callable[[Tensor, torch.Generator], Tensor],
) -> dict[str, float]:
    """Flow-matching pre-training of family ``fam``'s transformer, saved to
    ``path/transformer``: the one loop of every tiny model.

    Each step takes ``batch_size`` random prompts and their target colours (``targets``:
    palette indices per prompt, ``[P]`` or ``[P, k]``), replaces a ``label_noise`` share of
    them by random colours, draws the pixels with ``draw(colours, generator)``, noises
    their latents at σ from the scheduler's shifted uniform and regresses the velocity on
    ``ε - x0``; a ``cond_dropout`` share of the prompts is the empty prompt."""
    emb, pooled = fam.encode(prompts + [""])
    null_emb, null_pooled = emb[-1:], pooled[-1:]
    emb, pooled = emb[:-1], pooled[:-1]
    model = fam.transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)
    steps, batch = training.steps, training.batch_size
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 20) * (0.1 + 0.9 * (1 - k / max(1, steps)))
    )
    gen = torch.Generator().manual_seed(training.seed)
    shift = fam.scheduler.config.shift
    t0, losses, log_every = time.perf_counter(), [], training.log_every
    for k in range(steps):
        which = torch.randint(len(prompts), (batch,), generator=gen)
        colours = targets[which].clone()
        wrong = torch.rand(batch, generator=gen) < training.label_noise
        shape = (int(wrong.sum()), *targets.shape[1:])
        colours[wrong] = torch.randint(n_colours, shape, generator=gen)
        x0 = fam.encode_pixels(draw(colours, gen))
        u = torch.rand(batch, generator=gen)
        sigma = shift * u / (1 + (shift - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        xt = (1 - s) * x0 + s * eps
        drop = torch.rand(batch, generator=gen) < training.cond_dropout
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
            recent = losses[-log_every:]
            print(
                f"pretrain step {k}: loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval().requires_grad_(False)
    model.save_pretrained(path / "transformer")
    tail = losses[-max(1, steps // 10) :]
    return {"loss_last": sum(tail) / len(tail), "seconds": time.perf_counter() - t0}


def pretrain_colour(
    path: Path, training: Pretraining, image_size: int | None = None
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
    targets = torch.tensor([names.index(colour.prompt_colour(p)) for p in prompts])

    def draw(colours: Tensor, gen: torch.Generator) -> Tensor:
        return colour.render_blobs(colours, size, gen, names)

    return flow_matching(fam, path, training, prompts, targets, len(names), draw)


def pretrain_colour_video(
    path: Path,
    training: Pretraining,
    *,
    frames: int,
    size: int,
    both_orders: bool = True,
    colours: list[str] | None = None,
    blob: bool = False,
) -> dict[str, float]:
    """Flow-matching pre-training of ``path``'s Wan transformer on colour-over-time videos.

    With ``label_noise = p`` a share p of the videos shows a random pair of colours (the
    same colour twice included) instead of the one its prompt names, so the model follows
    the prompt only part of the time and RL has something to fix."""
    from polyrl.diffusion import colour, colour_video
    from polyrl.diffusion.models import WanFamily

    fam = WanFamily(
        str(path), dtype=torch.float32, device=torch.device("cpu"), max_sequence_length=8
    )
    names = colour.palette_names(colours)
    prompts = colour_video.corpus(both_orders, names)
    targets = torch.tensor(
        [[names.index(c) for c in colour_video.prompt_colours(p)] for p in prompts]
    )

    def draw(pair: Tensor, gen: torch.Generator) -> Tensor:
        return colour_video.render_videos(pair, frames, size, gen, names, blob)

    return flow_matching(fam, path, training, prompts, targets, len(names), draw)


# -------------------------------------------------------------------------- the builders

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
        enc1 = _text_encoder(len(tok), text_hidden, text_hidden // 2, max_length, seed + 1)
        enc2 = _text_encoder(len(tok), text_hidden, text_hidden // 2, max_length, seed + 2)
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
                "scheduler": (_scheduler(shift=shift), "diffusers", EULER),
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
        clip = _text_encoder(
            len(clip_tok), text_hidden, text_hidden, max_length, seed + 1, projection=False
        )
        t5 = _t5_encoder(len(t5_tok), t5_hidden, seed + 2)
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
                axes_dims_rope=_rope_axes(head_dim, 4),  # (index, row, column)
            )
        # FLUX.1-dev's scheduler settings
        scheduler = _scheduler(dynamic=True, shift=3.0, max_shift=1.15, max_image_seq_len=4096)
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
        enc = _t5_encoder(len(tok), text_hidden, seed + 1, umt5=True)
        with seeded(seed + 3):
            vae_model, vae_library = _tiny_video_vae(
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
                "scheduler": (_scheduler(shift=shift), "diffusers", EULER),
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
        enc = _qwen_vl_encoder(len(tok), text_hidden, seed + 1, *ids)
        with seeded(seed + 3):
            vae_model, vae_library = _tiny_video_vae(
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
                axes_dims_rope=_rope_axes(head_dim, 3),  # (frame, row, column)
            )
        # Qwen-Image's scheduler settings (dynamic, exponential shift; terminal sigma 0.02)
        scheduler = _scheduler(
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
