"""Vision-language RL: VL data, Qwen-VL policies and engines, image-aware rewards.

Importing the package registers its parts in the core's registries:

- tasks ``vl_shapes`` (synthetic coloured shapes drawn with Pillow) and ``vl_zoom`` (read a
  dot only a zoom resolves; environment ``vl_zoom``, :mod:`~polyrl.multimodal.zoom`), builder
  ``tiny_qwen2_5_vl`` (a tiny Qwen2.5-VL built offline)
- dataset kind ``vl``, policy kind ``qwen_vl``, engines ``hf_vl`` and ``vllm_vl`` (vLLM with
  images; vllm itself is imported only when such an engine is built), workflow
  ``vl_single_turn``
- rewards ``grounding_iou`` and ``clip_score`` (batched)
"""

from polyrl.multimodal import (  # noqa: F401
    data,
    engine,
    policy,
    rewards,
    shapes,
    tiny,
    vllm_engine,
    workflow,
    zoom,
)
