"""The service's options (``polyrl serve tinker --config FILE``), typed where they are read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from polyrl.core.options import Options


@dataclass
class TinkerServeConfig(Options):
    """What ``polyrl serve tinker`` loads: which base models it serves and where it listens.

    ``models`` maps the names clients give (``base_model="Qwen/Qwen3-8B"``) to local
    checkpoint directories; nothing is downloaded. Every training client on one base is a
    LoRA adapter on that base's single loaded copy."""

    models: Annotated[dict[str, str], "base model name -> local checkpoint directory"] = field(
        default_factory=dict
    )
    host: Annotated[str, "address to listen on"] = "127.0.0.1"
    port: Annotated[int, "port to listen on (0: any free port, printed at start)"] = 8000
    device: Annotated[str, "torch device of the base models"] = "cpu"
    dtype: Annotated[str, "float32 or bfloat16"] = "float32"
    checkpoint_dir: Annotated[str, "where save_state / save_weights_for_sampler write"] = (
        "tinker_checkpoints"
    )
    lora_alpha: Annotated[float, "LoRA alpha of every adapter (the scale is alpha / rank)"] = 32.0
    batch_window_ms: Annotated[
        float, "how long the worker waits for other clients' requests to join a pass"
    ] = 2.0
    max_batch_rows: Annotated[int, "most datums of several clients merged into one pass"] = 256
    seed: Annotated[int, "sampling stream seed of requests that give none"] = 0
    sampler_snapshots: Annotated[
        int,
        "snapshot samplers (save_weights_and_get_sampling_client) kept per training client; "
        "older ones are freed, a request to one gets an error saying so (0: keep all)",
    ] = 8
