"""The tiny offline models the session fixtures build: one builder, the sizes as arguments."""

from __future__ import annotations

from pathlib import Path

# The arithmetic model of ``tiny_model_dir`` (tests/conftest.py).
ARITHMETIC = {
    "corpus": "arithmetic",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
}
# The grid-world model of the agents tests (``grid_model_dir``).
GRIDWORLD = {
    "corpus": "gridworld",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 1,
    "head_dim": 64,
    "intermediate_size": 256,
}
# The signaling-game model of the marl tests (``signaling_model_dir``).
SIGNALING = {**GRIDWORLD, "corpus": "signaling", "vocab_size": 200, "intermediate_size": 128}


def tiny_text_model(
    tmp_path_factory, name: str, sizes: dict, plugin: str | None = None, seed: int = 0
) -> str:
    """Build a tiny Qwen2 + tokenizer (``polyrl.core.demo.tiny.tiny_qwen2``) in a fresh session
    temp folder; ``sizes`` are its keyword arguments (corpus, widths); ``plugin`` is the
    package whose task owns the corpus, imported first so the task is registered."""
    import importlib

    from polyrl.core.demo.tiny import tiny_qwen2

    if plugin:
        importlib.import_module(plugin)
    path = Path(tmp_path_factory.mktemp("models")) / name
    tiny_qwen2(path, **sizes, seed=seed)
    return str(path)
