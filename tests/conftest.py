"""Shared fixtures: pinned threads, an offline tiny model, one Ray cluster per session."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 + tokenizer for the arithmetic task, built once per test session."""
    from polyrl.core.tiny import tiny_qwen2

    path = tmp_path_factory.mktemp("models") / "tiny-arith"
    tiny_qwen2(path, corpus="arithmetic", hidden_size=128, num_layers=2, num_heads=2,
               head_dim=64, intermediate_size=256, seed=0)
    return str(path)
