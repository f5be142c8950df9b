"""polyrl.marl.tinker_api: a Tinker-compatible training service (``polyrl serve tinker``).

Loops written for the official ``tinker`` client (and the tinker-cookbook) train here with
only the base URL and model name changed. Every training client is a LoRA adapter on ONE
loaded copy of its base model, so clients that call ``forward_backward`` together share one
pass (:mod:`polyrl.marl.multi_lora`) and their samplers share one decode loop (routed
by the same module); each keeps its own Adam state. It lives in ``marl`` because
it is built from marl's multi-adapter passes (plugins never import each other).

Modules: :mod:`.config` (the service's options), :mod:`.losses` (Tinker's built-in losses),
:mod:`.wire` (protobuf in and out), :mod:`.base` (one base model and its adapters),
:mod:`.service` (state, futures, the batching worker), :mod:`.routes` (the HTTP API),
:mod:`.server` (run it). Needs the ``serve`` extra (``pip install polyrl[serve]``).
"""

from __future__ import annotations

from polyrl.core.registry import SERVICES


def serve_tinker(config: str, overrides: list[str]) -> int:
    from polyrl.marl.tinker_api.server import serve

    return serve(config, overrides)


SERVICES.register("tinker", serve_tinker)
