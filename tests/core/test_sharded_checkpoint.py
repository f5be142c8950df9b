"""Sharded checkpoints (core/runner/checkpoint.py): each FSDP rank writes its own shards, and the
directory loads into local mode and into a different world size, exactly."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.train.algorithms import AlgorithmConfig
from tests.helpers.distributed import LORA, ray_config
from tests.helpers.trainer import sampled_record


def _assert_same_state(a: dict, b: dict) -> None:
    """Weights, optimizer moments and schedule equal bit for bit (the local layout)."""
    assert a["weights"].keys() == b["weights"].keys()
    for k, v in a["weights"].items():
        assert torch.equal(b["weights"][k], v), k
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(b["optimizer"]["state"][i][k]), torch.as_tensor(v))
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"]


def _group(cfg, backend, world: int):
    import dataclasses

    backend.args = dataclasses.replace(backend.args, workers_per_policy=world)
    return backend.make_policy(
        "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
    )


@pytest.fixture(scope="module")
def trained(ray_cluster, tiny_model_dir, tmp_path_factory):
    """A 2-rank group after two updates, its gathered state, and its shards on disk."""
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend

    cfg = ray_config(tiny_model_dir)
    local = LocalBackend(cfg).make_policy(
        "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
    )
    batches = [sampled_record(local, seed=s) for s in (0, 1)]
    backend = RayBackend(cfg)
    two = _group(cfg, backend, 2)
    try:
        for b in batches:
            backend.update(two, b, AlgorithmConfig(), temperature=1.0, generator=torch.Generator())
        path = tmp_path_factory.mktemp("ckpt") / "policy_main"
        two.save_sharded(path)
        yield cfg, backend, two, two.state_dict(), path
    finally:
        two.group.shutdown()
        backend.shutdown()


@pytest.mark.ray
def test_each_rank_writes_its_shards_and_local_mode_reads_them(trained):
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.runner.checkpoint import SavedDirectory, load_part

    cfg, _, two, full, path = trained
    assert two.sharded_checkpoint  # the default under Ray
    shards = sorted(path.glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    total = sum(v.numel() * v.element_size() for v in full["weights"].values())
    total += sum(
        v.numel() * v.element_size()
        for st in full["optimizer"]["state"].values()
        for v in st.values()
    )
    for p in shards:  # no rank wrote the whole state (weights + 2 Adam moments)
        assert p.stat().st_size < 0.7 * total, (p.name, p.stat().st_size, total)
    assert sum(p.stat().st_size for p in shards) > 0.9 * total

    local = LocalBackend(cfg).make_policy(
        "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
    )
    load_part(local, SavedDirectory(path), "main")
    _assert_same_state(full, local.state_dict())


@pytest.mark.ray
def test_shards_load_into_another_world_size(trained, tmp_path):
    """2 ranks -> 1 rank -> (its own shards) -> 2 ranks: the state survives exactly."""
    cfg, backend, two, full, path = trained
    one = _group(cfg, backend, 1)
    try:
        one.load_sharded(path)
        _assert_same_state(full, one.state_dict())
        one.save_sharded(tmp_path / "one")
        assert [p.name for p in (tmp_path / "one").glob("*.distcp")] == ["__0_0.distcp"]
    finally:
        one.group.shutdown()
    fresh = _group(cfg, backend, 2)
    try:
        fresh.load_sharded(tmp_path / "one")
        _assert_same_state(full, fresh.state_dict())
    finally:
        fresh.group.shutdown()


@pytest.mark.parametrize("lora", [False, True])
def test_local_policy_round_trips_through_shards(tiny_model_dir, tmp_path, lora):
    """Without a process group the same code writes and reads one process's whole state:
    under LoRA the adapter alone (the base is not in the files), after a warm start the
    reference too; an unstepped optimizer stays unstepped."""
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.runner.checkpoint import SavedDirectory, load_part, read_full, save_policy
    from polyrl.core.train import trainer

    cfg = ray_config(tiny_model_dir, *([LORA] if lora else []))
    kw = {"total_steps": 10, "need_reference": True, "shared": {}}

    def fresh():
        return LocalBackend(cfg).make_policy("main", cfg.policies["main"], **kw)

    a = fresh()
    save_policy(a, tmp_path / "start", lora=lora)
    trainer.update(a, sampled_record(a, seed=0), AlgorithmConfig(), generator=torch.Generator())
    if not lora:  # (under LoRA the reference is the base with the adapter off)
        a.reference.load_state_dict(a.model.state_dict())  # as a warm start's end does
        a.reference_warmed = True
    save_policy(a, tmp_path / "trained", lora=lora)

    files = read_full(SavedDirectory(tmp_path / "trained"))
    assert set(files["weights"]) == set(a.trainable_state())
    assert all(("lora_" in k) == lora for k in files["weights"])

    b = fresh()
    load_part(b, SavedDirectory(tmp_path / "trained"), "main")
    _assert_same_state(a.state_dict(), b.state_dict())
    assert b.reference_warmed != lora
    if not lora:
        assert set(files["reference"]) == set(a.reference.state_dict())
        for k, v in a.reference.state_dict().items():
            assert torch.equal(b.reference.state_dict()[k], v), k

    c = fresh()
    load_part(c, SavedDirectory(tmp_path / "start"), "main")
    assert c.optimizer.state_dict()["state"] == {} and not c.reference_warmed
    other = ray_config(tiny_model_dir, *([] if lora else [LORA]))
    d = LocalBackend(other).make_policy("main", other.policies["main"], **kw)
    with pytest.raises(RuntimeError, match="written (with|without) LoRA"):
        load_part(d, SavedDirectory(tmp_path / "trained"), "main")
