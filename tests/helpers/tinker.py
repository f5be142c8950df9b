"""The Tinker service on a tiny offline model, and the official client pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

API_KEY = "tml-local"  # the client insists on a key; the local service does not check it


@contextmanager
def tinker_service(model_dir: str, tmp_path, **options: Any) -> Iterator[tuple[Any, Any]]:
    """(ServiceClient, Running): the service serving ``model_dir`` as base model ``tiny``."""
    import tinker

    from polyrl.marl.tinker_api.config import TinkerServeConfig
    from polyrl.marl.tinker_api.server import start

    cfg = TinkerServeConfig(
        models={"tiny": model_dir}, port=0, checkpoint_dir=str(tmp_path / "ckpt"), **options
    )
    # the client closed before the service stops: its session heartbeat thread ends with it
    # (left open, it logs a failed heartbeat every 10 s for the rest of the process)
    with (
        start(cfg) as running,
        tinker.ServiceClient(base_url=running.url, api_key=API_KEY) as client,
    ):
        yield client, running


def sft_datum(tokens: list[int], prompt_len: int) -> Any:
    """Tinker's documented SFT datum: inputs shifted against targets, prompt weight 0."""
    from tinker import types

    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def pretrained_tiny(tmp_path_factory) -> str:
    """A tiny Qwen2 briefly pretrained on the arithmetic corpus: LoRA moves only the inner
    layers, so the base must already have an unembedding that can sharpen (a random one
    caps how far any adapter can move the loss)."""
    from polyrl.core.demo.tiny import tiny_qwen2

    path = tmp_path_factory.mktemp("tinker") / "tiny-pretrained"
    tiny_qwen2(
        path,
        corpus="arithmetic",
        hidden_size=64,
        num_layers=2,
        num_heads=1,
        head_dim=64,
        intermediate_size=128,
        pretrain_steps=30,
        pretrain_lr=3e-3,
    )
    return str(path)
