"""polyrl.diffusion: text-to-image RL (Flow-GRPO / DanceGRPO style) on diffusers models.

Importing it registers its parts in the core's registries: the ``diffusion`` and
``diffusion_nft`` policy kinds, the ``diffusion`` engine, the ``diffusion_nft`` policy loss, the ``text_to_image`` workflow, the ``per_prompt`` credit scheme, the
``gaussian_mean`` KL estimator, image rewards (``colour``, ``colour_accuracy``,
``jpeg_compressibility``, ``jpeg_incompressibility``, ``t2i_clip_score``, ``aesthetic``,
``pickscore``, ``hpsv2``), the ``tiny_sd3``, ``tiny_flux`` and ``tiny_qwen_image`` model
builders and the ``colour`` task; for video (Wan): the ``text_to_video`` workflow, the
``colour_video`` task, the ``video_colour``, ``video_colour_accuracy`` and
``temporal_consistency`` rewards and the ``tiny_wan`` builder.
Samplers live in this plugin's own registry, :data:`SAMPLERS` (``flow_sde``,
``dance_sde``, ``cps``, ``ode``); model families in :data:`FAMILIES` (``sd3``, ``flux``,
``qwen_image``, ``wan``; :mod:`.families`).
"""

from polyrl.diffusion import (  # noqa: F401
    colour,
    colour_video,
    credit,
    engine,
    models,
    nft,
    packed,
    policy,
    rewards,
    samplers,
    selection,
    tiny,
    wan,  # tiny checkpoints name their PatchVideoVAE there; diffusers loads imported modules only
    workflow,
)
from polyrl.diffusion.families import FAMILIES  # noqa: F401
from polyrl.diffusion.samplers import SAMPLERS  # noqa: F401
