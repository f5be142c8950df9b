"""Vision-language RL: VL data, Qwen-VL policies and engines, image-aware rewards.

Importing the package registers its parts in the core's registries:

- task ``vl_shapes`` (synthetic coloured shapes drawn with Pillow) and model builder
  ``tiny_qwen2_5_vl`` (a tiny Qwen2.5-VL built offline)
- dataset kind ``vl``, policy kind ``qwen_vl``, engine ``hf_vl``, workflow ``vl_single_turn``
- rewards ``grounding_iou`` and ``clip_score`` (batched)
"""

from polyrl.multimodal import data, engine, policy, rewards, shapes, tiny, workflow  # noqa: F401
