"""Tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models built offline (tokenizer, processor, model).

One code path for the three families (``family``: ``qwen2_vl``, ``qwen2_5_vl``,
``qwen3_vl``; registered builders ``tiny_qwen_vl`` and ``tiny_qwen2_vl`` /
``tiny_qwen2_5_vl`` / ``tiny_qwen3_vl``). The tokenizer is a byte-level BPE trained on a
task's corpus (the core's :func:`~polyrl.core.demo.tiny.build_tokenizer`) with Qwen-VL's vision
tokens added (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``)
and a chat template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` and a video part as
``<|vision_start|><|video_pad|><|vision_end|>`` (as all three families' templates do). The
processor is the family's real one (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``,
``Qwen3VLProcessor`` with ``Qwen3VLVideoProcessor``; patch 14, or 16 for Qwen3-VL; merge 2)
and the model the family's real ``*ForConditionalGeneration`` with small sizes.
Configuration rules a tiny Qwen-VL must keep (a wrong one fails deep inside the forward):

- ``mrope_section`` sums to ``head_dim / 2`` (head_dim = hidden_size / num_heads);
- the vision tower's output size (``out_hidden_size``; Qwen2-VL: vision ``hidden_size``,
  with ``embed_dim`` the tower's own width) equals the text ``hidden_size``;
- Qwen2.5-VL: every ``fullatt_block_indexes`` entry is below the vision ``depth``;
- Qwen3-VL: ``head_dim`` is explicit, ``deepstack_visual_indexes`` are below ``depth``,
  ``num_position_embeddings`` is a square (the learned position grid).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from polyrl.core.config import doc
from polyrl.core.demo.tiny import TextSizes, build_tokenizer, seeded_model, text_config
from polyrl.core.options import Options
from polyrl.core.registry import MODELS, TASKS
from polyrl.core.runner.builds import build_once

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json")


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}


def _check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown Qwen-VL family {family!r}; use one of {', '.join(FAMILIES)}")
    return family


def mrope_section(head_dim: int) -> list[int]:
    """Qwen's 1 : 1.5 : 1.5 split of the rotary half-dimension over (time, height, width)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_processor(
    corpus: list[str],
    *,
    vocab_size: int = 320,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112,
    family: str = "qwen2_5_vl",
):
    """The real processor of ``family`` around a tokenizer trained on ``corpus``: its image
    processor (patch 14, or 16 for Qwen3-VL; merge 2) and its video processor (Qwen3-VL's
    own class, which the processor requires)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    patch = PATCH_SIZE[_check_family(family)]
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    sizes: dict[str, Any] = {"patch_size": patch, "merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen3_vl":  # Qwen3-VL normalises to [-1, 1], not with CLIP's statistics
        sizes |= {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, **sizes)
    if family == "qwen3_vl":  # Qwen3-VL's video processor takes the limits as a size dict
        video_processor = Qwen3VLVideoProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **sizes
        )
    else:
        video_processor = Qwen2VLVideoProcessor(
            min_pixels=min_pixels, max_pixels=max_pixels, **sizes
        )
    cls = {
        "qwen2_vl": Qwen2VLProcessor,
        "qwen2_5_vl": Qwen2_5_VLProcessor,
        "qwen3_vl": Qwen3VLProcessor,
    }[family]
    return cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=VL_CHAT_TEMPLATE,
    )


def _vl_config(family: str, text: dict, o: VLSizes, *, head_dim: int, ids: dict[str, int]):
    """The family's config class with the shared text sizes and a tiny vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    vision_depth, vision_hidden_size = o.vision_depth, o.vision_hidden_size
    vision_heads, vision_intermediate_size = o.vision_heads, o.vision_intermediate_size
    tie_word_embeddings = o.tie_word_embeddings

    hidden = text["hidden_size"]
    patch = {"patch_size": PATCH_SIZE[family], "spatial_merge_size": 2, "temporal_patch_size": 2}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)}
    tokens = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": tie_word_embeddings,
    }
    tower = {  # Qwen2.5-VL's and Qwen3-VL's vision sizes (Qwen2-VL names them otherwise)
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": vision_intermediate_size,
        "num_heads": vision_heads,
        "out_hidden_size": hidden,
        **patch,
    }
    if family == "qwen3_vl":  # explicit head_dim, interleaved M-RoPE, deepstack from block 0
        text = {
            **text,
            "head_dim": head_dim,
            "rope_parameters": {**rope, "mrope_interleaved": True},
        }
        vision = {**tower, "deepstack_visual_indexes": [0], "num_position_embeddings": 64}
        return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    text = {
        **text,
        "rope_parameters": rope,
        "max_window_layers": text["num_hidden_layers"],
        "tie_word_embeddings": tie_word_embeddings,
    }
    if family == "qwen2_vl":  # Qwen2-VL's vision hidden_size is the merger's output size
        if vision_intermediate_size % vision_hidden_size:
            raise ValueError(
                f"Qwen2-VL: vision_intermediate_size={vision_intermediate_size} "
                f"must be a multiple of vision_hidden_size={vision_hidden_size}"
            )
        vision = {
            "depth": vision_depth,
            "embed_dim": vision_hidden_size,
            "hidden_size": hidden,
            "num_heads": vision_heads,
            "mlp_ratio": vision_intermediate_size // vision_hidden_size,
            **patch,
        }
        return Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    vision = {**tower, "fullatt_block_indexes": [vision_depth - 1], "window_size": 112}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)


@dataclass
class VLSizes(TextSizes):
    """A tiny Qwen-VL model's sizes (:func:`build_tiny_vl`): the language model's (its
    ``hidden_size`` is the vision tower's output width too, and must divide by
    ``num_heads``), its MLP width, and the vision tower's."""

    intermediate_size: int = doc(128, "language model MLP width")
    vision_depth: int = doc(1, "vision tower blocks")
    vision_hidden_size: int = doc(32, "vision tower width")
    vision_heads: int = doc(1, "vision tower attention heads")
    vision_intermediate_size: int = doc(64, "vision tower MLP width")


def build_tiny_vl(processor, *, family: str = "qwen2_5_vl", **sizes: Any):
    """A float32 Qwen-VL model of ``family`` sized to the processor's tokenizer
    (``sizes``: :class:`VLSizes`)."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    cls = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
    }[_check_family(family)]
    o = VLSizes(**sizes)
    if o.hidden_size % o.num_heads:
        raise ValueError(
            f"hidden_size={o.hidden_size} must be divisible by num_heads={o.num_heads}"
        )
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    text = text_config(len(tok), o, o.intermediate_size, pad_id=pad_id, eos_id=eos_id)
    config = _vl_config(family, text, o, head_dim=o.hidden_size // o.num_heads, ids=ids)
    return seeded_model(cls, config, o.seed, pad_id=pad_id, eos_ids=[eos_id])


def build_tiny_qwen2_5_vl(processor, **kwargs: Any):
    """A float32 ``Qwen2_5_VLForConditionalGeneration`` (see :func:`build_tiny_vl`)."""
    return build_tiny_vl(processor, family="qwen2_5_vl", **kwargs)


def is_complete(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return all((p / name).is_file() for name in MODEL_FILES)


def _built_family(path: Path) -> str | None:
    """The ``model_type`` of a built model at ``path`` (the family names are model types)."""
    return json.loads((path / "config.json").read_text()).get("model_type")


@dataclass
class VLProcessorBuild(Options):
    """``build_args`` that make a tiny Qwen-VL's processor (:func:`build_processor`)."""

    corpus: str = doc("vl_shapes", "task whose corpus() trains the tokenizer")
    vocab_size: int = doc(320, "BPE vocabulary size (the vision tokens come on top)")
    min_pixels: int = doc(56 * 56, "the processor's least pixels per resized image")
    max_pixels: int = doc(112 * 112, "the processor's most pixels per resized image")


@dataclass
class TinyVLOptions(VLSizes, VLProcessorBuild):
    """``build_args`` of ``tiny_qwen2_vl``, ``tiny_qwen2_5_vl`` and ``tiny_qwen3_vl``."""


@dataclass
class TinyQwenVLOptions(TinyVLOptions):
    """``build_args`` of ``tiny_qwen_vl``: a tiny model of any of the three families."""

    family: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] = doc(
        "qwen2_5_vl", "Qwen-VL family: qwen2_vl, qwen2_5_vl or qwen3_vl"
    )


@MODELS.register("tiny_qwen_vl", options=TinyQwenVLOptions)
def tiny_qwen_vl(path: str | Path, *, family: str = "qwen2_5_vl", **options: Any) -> Path:
    """Build a tiny Qwen-VL of ``family`` + its processor at ``path`` (once), its tokenizer
    trained on the texts of task ``corpus``; ``options`` are :class:`TinyVLOptions`. Written
    to a temp dir and renamed into place, so a crash or a concurrent builder never leaves
    half a model; a complete model of another family at ``path`` is an error, not silently
    reused."""
    _check_family(family)
    o = TinyVLOptions(**options)
    path = Path(path).expanduser()
    if is_complete(path):
        built = _built_family(path)
        if built != family:
            raise FileExistsError(
                f"{path} holds a {built} model, not {family}; remove it or choose another path"
            )
        return path

    def write(tmp: Path) -> None:
        processor = build_processor(
            TASKS.get(o.corpus).corpus(),
            vocab_size=o.vocab_size,
            min_pixels=o.min_pixels,
            max_pixels=o.max_pixels,
            family=family,
        )
        model_kwargs = {f.name: getattr(o, f.name) for f in dataclasses.fields(VLSizes)}
        build_tiny_vl(processor, family=family, **model_kwargs).save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return build_once(path, write, is_complete)


@MODELS.register("tiny_qwen2_vl", options=TinyVLOptions)
def tiny_qwen2_vl(path: str | Path, **options: Any) -> Path:
    """A tiny Qwen2-VL (patch 14, no window attention); see :func:`tiny_qwen_vl`."""
    return tiny_qwen_vl(path, family="qwen2_vl", **options)


@MODELS.register("tiny_qwen2_5_vl", options=TinyVLOptions)
def tiny_qwen2_5_vl(path: str | Path, **options: Any) -> Path:
    """A tiny Qwen2.5-VL (patch 14, window attention); see :func:`tiny_qwen_vl`."""
    return tiny_qwen_vl(path, family="qwen2_5_vl", **options)


@MODELS.register("tiny_qwen3_vl", options=TinyVLOptions)
def tiny_qwen3_vl(path: str | Path, **options: Any) -> Path:
    """A tiny Qwen3-VL (patch 16, deepstack, interleaved M-RoPE); see :func:`tiny_qwen_vl`."""
    return tiny_qwen_vl(path, family="qwen3_vl", **options)
