"""The mixed team of issue 40 (writer, painter, judge) one version ahead: the tiny recipe,
the checks on its metrics, and the checks on the rows the producer handed the loop. Shared by
the local tests (tests/marl/test_paint_team.py) and the Ray ones
(tests/marl/test_paint_team_ray.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).parents[2] / "examples" / "paint_team.yaml"
MEMBERS = ("writer", "painter", "judge")


def one_ahead(tmp_path: Path, *extra: str, run: str = "run") -> Any:
    """The demo recipe, tiny and untrained, one version ahead: 3 steps of 2 goals x 4
    prompts x 2 pictures (a Config; ``extra``: more overrides). Runs of one ``tmp_path``
    share its models and data; ``run``: the run directory's name in it."""
    import polyrl.diffusion  # noqa: F401
    import polyrl.marl  # noqa: F401
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    models = tmp_path / "models"
    return load(
        Config,
        EXAMPLE,
        [
            f"run.dir={tmp_path}/{run}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            f"task.dir={tmp_path}/data",
            "task.args={n_train: 32, per_colour_eval: 1}",
            f"policies.painter.model={models}/sd3",
            "policies.painter.build_args.pretrain_steps=0",
            f"policies.writer.model={models}/writer",
            f"policies.judge.model={models}/judge",
            "sft.steps=2",
            "rollout.prompts_per_step=2",
            "rollout.args.images=2",
            # the judge's rows of a goal as its group (the recipe's two answers a picture
            # agree too often for an untrained judge, whose update then has no gradient)
            "rollout.args.judge_n=1",
            "rollout.max_staleness=1",
            "train.steps=3",
            "eval.every=0",
            *extra,
        ],
    )


def step_metrics(run_dir: Path, key: str = "async/staleness_max") -> list[dict]:
    """The lines of the run's metrics.jsonl that hold ``key`` (by default: the training
    steps of an async run)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if key in m]


def check_one_ahead(run_dir: Path) -> list[dict]:
    """Every step within the bound of one version, nothing dropped, each member updated
    from its own rows; returns the steps' metrics."""
    steps = step_metrics(run_dir)
    assert len(steps) == 3
    assert max(m["async/staleness_max"] for m in steps) == 1  # one ahead, never more
    assert sum(m["async/dropped_groups"] for m in steps) == 0
    for m in steps:
        assert m["marl/paintings"] == 2 * 4 * 2  # prompts x rollout.n x images
        for name in MEMBERS:
            assert math.isfinite(m[f"{name}/loss"]) and m[f"{name}/grad_norm"] > 0, name
    return steps


def keep_records(session: Any) -> list[tuple[int, Any]]:
    """Wrap the session's producer so that each batch the loop gets is also kept here:
    ``[(step, record), ...]`` as the loop takes them."""
    records: list[tuple[int, Any]] = []
    made = session.rollouts.next

    def keep(step: int):
        record, own = made(step)
        records.append((step, record))
        return record, own

    session.rollouts.next = keep
    return records


def check_row_versions(records: list[tuple[int, Any]]) -> None:
    """Partial, one ahead: every member's rows carry the versions that sampled them (a
    painter row: one version on every denoising step), each row's ``policy_version`` is its
    oldest, within one of the weights the step updates."""
    from polyrl.core.record import strings

    assert [step for step, _ in records] == [1, 2, 3]
    for step, rec in records:
        policy = strings(rec, "policy")
        tv, mask = rec["token_version"], rec["response_mask"].bool()
        assert tv.shape == mask.shape  # every row's steps or tokens have their versions
        for name in MEMBERS:
            rows = [i for i, p in enumerate(policy) if p == name]
            assert rows, name
            for i in rows:
                got = tv[i][mask[i]]
                assert got.numel() > 0 and bool((got >= 0).all()), (step, name, i)
                assert int(rec["policy_version"][i]) == int(got.min())
                assert 0 <= step - 1 - int(got.min()) <= 1, (step, name, i)
                if name == "painter":  # one version per trajectory, on all its steps
                    assert got.numel() == rec["rollout_logprobs"][i][mask[i]].numel()
                    assert bool((got == got[0]).all()), (step, i)
