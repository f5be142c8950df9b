"""Where the Wan 2.1 text-to-video parts live (this module only keeps an old import path).

Video follows the plugin's layers as the image families do:

- the family (``WanTransformer3DModel``, UMT5, ``AutoencoderKLWan``):
  :class:`polyrl.diffusion.models.WanFamily`;
- the frame-wise VAE of tiny CPU demos: :class:`polyrl.diffusion.patch_vae.PatchVideoVAE`;
- the ``colour_video`` task: :mod:`polyrl.diffusion.colour_video`;
- the ``video_colour``, ``video_colour_accuracy`` and ``temporal_consistency`` rewards:
  :mod:`polyrl.diffusion.rewards`;
- the ``text_to_video`` workflow: :class:`polyrl.diffusion.workflow.TextToVideo`;
- the ``tiny_wan`` builder and its pre-training: :mod:`polyrl.diffusion.tiny`.

Tiny Wan and Qwen-Image checkpoints name their VAE ``["polyrl.diffusion.wan",
"PatchVideoVAE"]`` in ``model_index.json``, and diffusers' pipelines take it from there
(from an imported module only: ``polyrl.diffusion`` imports this one), so this module
still exports it.
"""

# diffusers looks a component's loader base class up in the module the index names, so
# ModelMixin must be a name here too
from diffusers import ModelMixin

from polyrl.diffusion.patch_vae import PatchVideoVAE

__all__ = ["ModelMixin", "PatchVideoVAE"]
