"""Recipes for the Ray backend tests: an FSDP2 group of two workers on the tiny model."""

from __future__ import annotations

LORA = "policies.main.lora={r: 4, alpha: 8.0, target_modules: [q_proj, v_proj, up_proj]}"


def ray_config(model_dir: str, *extra: str):
    """A Config training ``policies.main`` on ``model_dir`` with two Ray workers; ``extra``
    are key=value overrides."""
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    return load(
        Config,
        None,
        [
            f"policies.main.model={model_dir}",
            "policies.main.optim.lr=1e-3",
            "policies.main.micro_batch_size=4",
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 2}",
            *extra,
        ],
    )
