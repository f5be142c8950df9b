"""Example recipes loaded with test paths: run, data and model directories under tmp_path."""

from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def vl_team_recipe(tmp_path: Path, models: Path, *overrides: str):
    """``examples/vl_team_colour.yaml`` as a Config: run and data in ``tmp_path``, the looker
    and solver models in ``models/looker`` and ``models/solver``; ``overrides`` win."""
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.registry import load_plugins

    load_plugins()
    return load(
        Config,
        EXAMPLES / "vl_team_colour.yaml",
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            f"task.dir={tmp_path}/data",
            f"rollout.args.image_root={tmp_path}/data",
            f"policies.looker.model={models}/looker",
            f"policies.solver.model={models}/solver",
            *overrides,
        ],
    )
