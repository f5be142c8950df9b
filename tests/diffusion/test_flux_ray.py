"""FLUX under the Ray backend: the tiny FLUX recipe's first update equals local mode's.

The same recipe opens one session per backend. The Ray engine actor holds its own copy of
the tiny FLUX with the local engine's seed, so it samples the local trajectories; the
policy trains on a 2-rank FSDP2 group. The first update (two mini-batches, LoRA, the
Gaussian-mean KL, FLUX's guidance embedding as an input) must give local mode's loss
within 1e-4, and the engine actor must sample with the trained weights after the sync.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_flux_first_update_under_ray_matches_local(first_update_under_ray, tiny_flux_dir):
    record = first_update_under_ray(
        f"policies.main.model={tiny_flux_dir}",
        "policies.main.engine.args={height: 16, width: 16, steps: 4, guidance_scale: 3.5, "
        "train_steps: {mode: window, window_start: 0, window_size: 2}}",
        "policies.main.args={max_sequence_length: 8}",
    )
    assert record["negative_prompt_embeds"].shape[1] == 0  # FLUX: no unconditional branch
