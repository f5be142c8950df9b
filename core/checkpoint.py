"""Sharded policy checkpoints with ``torch.distributed.checkpoint`` (DCP).

Under ``distributed.backend: ray`` (``distributed.args.checkpoint: sharded``, the default)
each FSDP rank writes its own shards of a policy's weights, optimizer moments and (after a
warm start) reference into ``policy_<name>/`` of the checkpoint being written, so no rank
ever holds the full state; rank 0 adds ``meta.pt`` (the schedule, and what the state holds).
The checkpoint directory is still written under ``step_N.tmp`` and renamed when complete
(:meth:`polyrl.core.run.RunDir.save`), so a run killed mid-write resumes from the previous
one. DCP keys every tensor by its parameter name, so the same directory loads into any
world size, and into a local (unsharded) policy: :func:`load_policy` reads it there.
The Hugging Face export still gathers the weights once, at the end of a run.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

META = "meta.pt"


@dataclass(frozen=True)
class DirectoryPart:
    """A checkpoint part that writes itself into a directory (``write(path)``) instead of
    being pickled into ``<name>.pt``; :meth:`RunDir.load_latest` returns such a part as a
    :class:`SavedDirectory`."""

    write: Callable[[Path], None]


@dataclass(frozen=True)
class SavedDirectory:
    """A checkpoint part stored as a directory (a sharded policy state)."""

    path: Path


@runtime_checkable
class LoadsShards(Protocol):
    """A policy handle that reads a sharded checkpoint itself (the Ray policy: each rank
    reads its own shards)."""

    def load_sharded(self, path: Path) -> None: ...


@runtime_checkable
class WritesShards(Protocol):
    """A policy handle that can write its checkpoint as shards (``sharded_checkpoint``)."""

    sharded_checkpoint: bool

    def save_sharded(self, path: Path) -> None: ...


def policy_part(policy: Any) -> Any:
    """What a checkpoint holds for ``policy``: its shards when it writes them, else its
    full state dict."""
    if isinstance(policy, WritesShards) and policy.sharded_checkpoint:
        return DirectoryPart(policy.save_sharded)
    return policy.state_dict()


@contextlib.contextmanager
def _single_process_ok():
    """Without a process group DCP reads in this process alone, as local mode means to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, q in model.named_parameters() if q.requires_grad}


def _weights(model: torch.nn.Module, lora: bool) -> dict[str, Any]:
    """The model's (possibly sharded) state dict; under LoRA the trainable adapter alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_options(ignore_frozen_params=lora))
    if lora:  # ignore_frozen_params keeps a frozen weight tied to another (lm_head)
        keep = _trainable(model)
        weights = {k: v for k, v in weights.items() if k in keep}
    return weights


def _state(policy: Any, lora: bool, stepped: bool, warmed: bool) -> dict[str, Any]:
    """What DCP writes or fills in: tensors keyed by parameter name, sharded under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = {"weights": _weights(policy.model, lora)}
    if stepped:  # an empty optimizer is filled by a zero-lr step first (then overwritten)
        state["optimizer"] = get_optimizer_state_dict(policy.model, policy.optimizer)
    if warmed:
        state["reference"] = _weights(policy.reference, False)
    return state


def save_policy(policy: Any, path: Path, *, lora: bool, rank: int = 0) -> None:
    """Write ``policy``'s shards into ``path``; every rank of its group calls it (DCP's
    save is a collective), rank 0 also writes ``meta.pt``. Local mode calls it with a plain
    model and rank 0."""
    import torch.distributed.checkpoint as dcp

    optim = policy.optimizer
    stepped = optim is not None and bool(optim.state)
    warmed = bool(policy.reference_warmed) and policy.reference is not None
    with _single_process_ok():
        dcp.save(_state(policy, lora, stepped, warmed), checkpoint_id=str(path))
    if rank == 0:
        meta = {
            "lora": lora,
            "stepped": stepped,
            "warmed": warmed,
            # no step yet: the empty local optimizer state (index-keyed, nothing to shard)
            "optimizer": None if stepped or optim is None else optim.state_dict(),
            "scheduler": policy.scheduler.state_dict() if policy.scheduler else None,
        }
        with open(path / META, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())


def load_policy(policy: Any, path: Path, *, lora: bool, name: str) -> None:
    """Read a sharded checkpoint into ``policy``: its own shards under FSDP (any world
    size; every rank calls it), the whole state in local mode."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (path / META).is_file():
        raise FileNotFoundError(
            f"policy {name!r}: {path} holds no {META}; it is not a complete sharded checkpoint"
        )
    meta = torch.load(path / META, weights_only=False)
    if meta["lora"] != lora:
        raise RuntimeError(
            f"policy {name!r}: the checkpoint in {path} was written "
            f"{'with' if meta['lora'] else 'without'} LoRA, this policy is "
            f"{'with' if lora else 'without'}; resume with the recipe that wrote it"
        )
    optim = policy.optimizer
    stepped = meta["stepped"] and optim is not None
    state = _state(policy, lora, stepped, meta["warmed"])
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(policy.model, state["weights"], options=_options(strict=not lora))
    if stepped:
        set_optimizer_state_dict(policy.model, optim, state["optimizer"])
    elif optim is not None:
        optim.load_state_dict(meta["optimizer"])
    if policy.scheduler is not None:
        policy.scheduler.load_state_dict(meta["scheduler"])
    if meta["warmed"]:
        set_model_state_dict(policy.reference, state["reference"])
        policy.reference_warmed = True


def load_part(policy: Any, part: Any, name: str) -> None:
    """Restore a policy from its checkpoint part: a full state dict, or a sharded
    directory (read by the Ray group's ranks, or whole by a local policy)."""
    if not isinstance(part, SavedDirectory):
        policy.load_state_dict(part)
    elif isinstance(policy, LoadsShards):
        policy.load_sharded(part.path)
    else:
        from polyrl.core.ray_workers import uses_lora

        for attr in ("model", "optimizer", "scheduler", "reference"):
            if not hasattr(policy, attr):
                raise TypeError(
                    f"policy {name!r}: its checkpoint {part.path} is sharded, and kind "
                    f"{type(policy).__name__} has no {attr!r} to read it into; resume it "
                    "under distributed.backend=ray, or write full checkpoints there "
                    "(distributed.args.checkpoint: full)"
                )
        load_policy(policy, part.path, lora=uses_lora(policy.cfg), name=name)


def read_full(part: Any) -> dict[str, Any]:
    """A policy part as plain tensors in one process (for inspection and tests): the
    weights, optimizer state keyed by parameter name when sharded, and ``meta.pt``."""
    if not isinstance(part, SavedDirectory):
        return part
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, _single_process_ok():
        dcp_to_torch_save(str(part.path), f"{tmp}/full.pt")
        state = torch.load(f"{tmp}/full.pt", weights_only=False)
    return state | {"meta": torch.load(part.path / META, weights_only=False)}
