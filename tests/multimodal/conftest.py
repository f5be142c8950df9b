"""Fixtures of the multimodal tests: one tiny Qwen2.5-VL per session, its policy, images."""

from __future__ import annotations

import pytest
import torch

TINY_VL = {
    "corpus": "vl_shapes",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "vision_depth": 1,
    "vision_hidden_size": 32,
    "seed": 0,
}


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> str:
    """A tiny Qwen2.5-VL + processor (tokenizer trained on the vl_shapes corpus)."""
    import polyrl.multimodal  # noqa: F401
    from polyrl.multimodal.tiny import tiny_qwen2_5_vl

    path = tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl"
    tiny_qwen2_5_vl(path, **TINY_VL)
    return str(path)


@pytest.fixture
def make_policy(tiny_vl_dir):
    """Build a qwen_vl policy on the tiny model; keyword overrides go to PolicyConfig."""
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy

    def make(need_reference: bool = False, **overrides):
        cfg = from_dict(PolicyConfig, {"model": tiny_vl_dir, "kind": "qwen_vl", **overrides})
        return QwenVLPolicy("main", cfg, total_steps=10, need_reference=need_reference)

    return make


@pytest.fixture
def vl_rows():
    """In-memory VL rows: one image, two images of other sizes, a text-only row."""
    from PIL import Image

    def img(w, h, colour):
        return Image.new("RGB", (w, h), colour)

    return [
        {
            "prompt": "<image>What colour is the square?",
            "images": [img(56, 56, (200, 30, 30))],
            "answer": "red",
        },
        {
            "prompt": "Compare <image> and <image>. How many circles?",
            "images": [img(84, 112, (30, 30, 200)), img(112, 56, (30, 160, 40))],
            "answer": "2",
        },
        {"prompt": "How many circles?", "images": [], "answer": "0"},
        {
            "prompt": "<image>Where is the red square?",
            "images": [img(140, 84, (240, 220, 20))],
            "answer": "[1,2,3,4]",
        },
    ]


@pytest.fixture
def vl_dataset(make_policy, vl_rows):
    """(policy, VLDataset) over ``vl_rows``."""
    from polyrl.core.rollout.data import DataConfig
    from polyrl.multimodal.data import VLDataset

    policy = make_policy()
    cfg = DataConfig(kind="vl", args={"min_pixels": 56 * 56, "max_pixels": 112 * 112})
    return policy, VLDataset(cfg, policy.tokenizer, name="t", rows=vl_rows)


@pytest.fixture
def grouped_sequences():
    """``(items, visions, odd) -> (prompt_ids, prompt_mask, response_ids, response_mask,
    row_visions)``: each prompt twice (a group of 2 sharing its VisionInputs), responses of
    different lengths, the second one replaced by ``odd`` (e.g. sampled vision-token ids)."""
    from polyrl.core.record import pad_left, pad_right

    def make(items, visions, odd):
        rows = [k for k in range(len(items)) for _ in range(2)]
        responses = [[5 + (r % 7)] * (1 + r % 4) for r in range(len(rows))]
        responses[1] = list(odd)
        prompt_ids, prompt_mask = pad_left([items[k].prompt_ids for k in rows], 0)
        response_ids = pad_right(responses, 0, torch.long)
        response_mask = pad_right([[1] * len(r) for r in responses], 0, torch.long)
        return prompt_ids, prompt_mask, response_ids, response_mask, [visions[k] for k in rows]

    return make
