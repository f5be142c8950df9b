"""A tiny Qwen2.5-VL built offline (tokenizer, processor and model), for tests and CPU demos.

The tokenizer is a byte-level BPE trained on a task's corpus (the core's
:func:`~polyrl.core.tiny.build_tokenizer`) with Qwen2.5-VL's vision tokens added
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``) and a chat
template that renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>`` and a
video part as ``<|vision_start|><|video_pad|><|vision_end|>`` (as Qwen2.5-VL's does). The
processor is the real ``Qwen2_5_VLProcessor``; the model is the real
``Qwen2_5_VLForConditionalGeneration`` with small sizes. Configuration rules that a tiny
Qwen2.5-VL must keep (a wrong one fails deep inside the forward pass):

- ``mrope_section`` sums to ``head_dim / 2`` (head_dim = hidden_size / num_heads);
- the vision tower's ``out_hidden_size`` equals the text ``hidden_size``;
- every ``fullatt_block_indexes`` entry is below the vision ``depth``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from polyrl.core.registry import MODELS, TASKS
from polyrl.core.tiny import build_tokenizer

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


def mrope_section(head_dim: int) -> list[int]:
    """Qwen's 1 : 1.5 : 1.5 split of the rotary half-dimension over (time, height, width)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_processor(corpus: list[str], *, vocab_size: int = 320, min_pixels: int = 56 * 56,
                    max_pixels: int = 112 * 112):
    """A ``Qwen2_5_VLProcessor`` around a tokenizer trained on ``corpus``."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels,
                                            patch_size=14, merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               video_processor=Qwen2VLVideoProcessor(
                                   min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14,
                                   merge_size=2, temporal_patch_size=2),
                               chat_template=VL_CHAT_TEMPLATE)


def build_tiny_qwen2_5_vl(processor, *, hidden_size: int = 64, num_layers: int = 2,
                          num_heads: int = 1, intermediate_size: int = 128,
                          vision_depth: int = 1, vision_hidden_size: int = 32,
                          vision_heads: int = 1, vision_intermediate_size: int = 64,
                          max_position_embeddings: int = 512, tie_word_embeddings: bool = True,
                          seed: int = 0):
    """A float32 ``Qwen2_5_VLForConditionalGeneration`` sized to the processor's tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": hidden_size,
            "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_heads,
            "max_position_embeddings": max_position_embeddings, "max_window_layers": num_layers,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": mrope_section(hidden_size // num_heads)},
            "bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
            "tie_word_embeddings": tie_word_embeddings},
        vision_config={
            "depth": vision_depth, "hidden_size": vision_hidden_size,
            "intermediate_size": vision_intermediate_size, "num_heads": vision_heads,
            "out_hidden_size": hidden_size, "fullatt_block_indexes": [vision_depth - 1],
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "window_size": 112},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id],
                                               pad_token_id=pad_id)
    return model.eval()


def is_complete(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return all((p / name).is_file() for name in MODEL_FILES)


@MODELS.register("tiny_qwen2_5_vl")
def tiny_qwen2_5_vl(path: str | Path, *, corpus: str = "vl_shapes", vocab_size: int = 320,
                    min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, seed: int = 0,
                    **model_kwargs: Any) -> Path:
    """Build a tiny Qwen2.5-VL + processor at ``path`` (once), its tokenizer trained on the
    texts of task ``corpus``. Written to a temp dir and renamed into place, so a crash or a
    concurrent builder never leaves half a model."""
    path = Path(path).expanduser()
    if is_complete(path):
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists but is not a complete model; remove it to rebuild")
    processor = build_processor(TASKS.get(corpus).corpus(), vocab_size=vocab_size,
                                min_pixels=min_pixels, max_pixels=max_pixels)
    model = build_tiny_qwen2_5_vl(processor, seed=seed, **model_kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:
            if not is_complete(path):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
