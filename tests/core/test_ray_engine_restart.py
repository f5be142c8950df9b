"""A Ray engine actor killed mid-generate (SIGKILL of its process) under
``distributed.args.max_restarts``: restarted in the run from the current weights and RNG
state, the interrupted call sent again, so the run ends as an uninterrupted one does."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.rollouts import LOW_DIGIT
from tests.helpers.runs import assert_same_tensors, assert_weights_moved, metrics, metrics_by_step

ARGS = [
    "distributed.backend=ray",
    "train.steps=2",  # (the first test sets its own)
    "eval.data.limit=8",
    f"reward.terms=[{LOW_DIGIT}]",  # rewards that differ within a group: the weights move
    "rollout.max_new_tokens=12",  # a generate long enough to be caught in flight
]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _title(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _engine_pid() -> int | None:
    """This process's engine actor (a descendant through Ray's raylet: not another test
    session's); Ray titles an actor's process ``ray::<class>[.<method running>]``."""
    kids, todo = _children(), [os.getpid()]
    while todo:
        for pid in kids.get(todo.pop(), []):
            if _title(pid).startswith(b"ray::EngineWorker"):
                return pid
            todo.append(pid)
    return None


class EngineKiller(threading.Thread):
    """SIGKILLs the engine actor's process while it runs its ``nth`` generate (the first
    is the evaluation before step 1, then one per batch), so after an update: the weights
    a fresh actor must be given have moved."""

    def __init__(self, nth: int) -> None:
        super().__init__(daemon=True)
        self.nth, self.done = nth, threading.Event()
        self.killed: int | None = None

    def run(self) -> None:
        pid, seen, was = None, 0, False
        while not self.done.is_set():
            pid = pid or _engine_pid()
            title = _title(pid) if pid else b""
            if not title:  # not started yet, or an earlier run's actor that has gone
                pid = None
                time.sleep(0.05)
                continue
            now = title.startswith(b"ray::EngineWorker.generate")
            seen += now and not was
            was = now
            if now and seen == self.nth:
                os.kill(pid, signal.SIGKILL)
                self.killed = pid
                return
            time.sleep(0.001)


def _train_killing(cfg, nth: int):
    from polyrl.core.loop import train

    killer = EngineKiller(nth)
    killer.start()
    try:
        return train(cfg), killer
    finally:
        killer.done.set()
        killer.join()


def _exported(run) -> dict[str, torch.Tensor]:
    return load_file(run.path / "export" / "main" / "model.safetensors")


def test_max_restarts_is_a_count():
    from polyrl.core.config import ConfigError, from_dict
    from polyrl.core.distributed.ray_backend import RayArgs

    assert from_dict(RayArgs, {"max_restarts": 2}, "distributed.args").max_restarts == 2
    with pytest.raises(ConfigError, match=r"distributed.args.max_restarts=-1 .*must be >= 0"):
        from_dict(RayArgs, {"max_restarts": -1}, "distributed.args")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("staleness", "steps", "nth"),
    [(0, 2, 3), (1, 3, 4)],  # sync: step 2's batch; async: batch 3, made with version 1
    ids=["sync", "async"],
)
def test_an_engine_killed_mid_generate_is_restarted_and_the_run_is_unchanged(
    ray_cluster, make_config, tiny_model_dir, tmp_path, staleness, steps, nth
):
    """The killed run restarts its engine once and ends bitwise equal (exported weights,
    every metric but wall-clock ones) to an uninterrupted run, whose weights moved."""
    from polyrl.core.loop import train

    args = [
        *ARGS,
        "distributed.args={workers_per_policy: 1, max_restarts: 2}",
        f"rollout.max_staleness={staleness}",
        f"train.steps={steps}",
    ]
    ref = train(make_config(*args, f"run.dir={tmp_path}/reference"))
    run, killer = _train_killing(make_config(*args, f"run.dir={tmp_path}/killed"), nth)
    assert killer.killed is not None, "no generate was caught in flight"
    counts = [r["faults/engine_restarts"] for r in metrics(run.path) if "main/loss" in r]
    assert counts[-1] == 1 and counts == sorted(counts), counts  # once
    assert all(r["faults/engine_restarts"] == 0 for r in metrics(ref.path) if "main/loss" in r)

    def without_faults(run_dir: Path) -> dict[int, dict]:
        by_step = metrics_by_step(run_dir)
        return {
            s: {k: v for k, v in m.items() if not k.startswith("faults/")}
            for s, m in by_step.items()
        }

    assert without_faults(run.path) == without_faults(ref.path)
    assert_same_tensors(_exported(run), _exported(ref), "exported weights")
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = [k for k, v in _exported(ref).items() if not torch.equal(v, start[k].to(v.dtype))]
    assert len(moved) > len(start) // 2, moved  # what the fresh actor was given had moved
    assert_weights_moved(start, _exported(ref), 1e-5)  # 1.0e-4 (sync), 1.5e-4 (async)


@pytest.mark.slow
def test_without_restarts_a_killed_engine_ends_the_run_naming_the_option(
    ray_cluster, make_config, tmp_path
):
    """``max_restarts: 0`` (the default): the run stops with one line naming the actor,
    the call and the option, and has removed its placement group by then."""
    from polyrl.core.distributed.ray_backend import ActorError

    def live() -> set[str]:
        table = ray_cluster.util.placement_group_table()
        return {g for g, info in table.items() if info["state"] in ("CREATED", "PENDING")}

    before, live_before = set(ray_cluster.util.placement_group_table()), live()
    try:
        with pytest.raises(ActorError) as err:
            _train_killing(make_config(*ARGS, "distributed.args={workers_per_policy: 1}"), 3)
        first, why = str(err.value).splitlines()[0], str(err.value.__cause__)  # Ray's account
        assert first.startswith("engine for policy 'main' died during generate;"), why
        assert "distributed.args.max_restarts is 0" in first
        assert set(ray_cluster.util.placement_group_table()) - before  # the run made one
        assert live() == live_before  # and train removed it on the failure
    finally:  # a group left by a failure of the above, so later tests can place theirs
        from ray.util.placement_group import PlacementGroup, PlacementGroupID

        for pg in live() - live_before:
            ray_cluster.util.remove_placement_group(
                PlacementGroup(PlacementGroupID(bytes.fromhex(pg)))
            )
