"""Sharded policy checkpoints with ``torch.distributed.checkpoint`` (DCP).

Under ``distributed.backend: ray`` (``distributed.args.checkpoint: sharded``, the default)
each FSDP rank writes its own shards of a policy's weights, optimizer moments and (after a
warm start) reference into ``policy_<name>/`` of the checkpoint being written, so no rank
ever holds the full state; rank 0 adds ``meta.pt`` (the schedule, and what the state holds).
The checkpoint directory is still written under ``step_N.tmp`` and renamed when complete
(:meth:`polyrl.core.runner.run.RunDir.save`), so a run killed mid-write resumes from the previous
one. DCP keys every tensor by its parameter name, so the same directory loads into any
world size, and into a local (unsharded) policy: :func:`load_policy` reads it there.
The Hugging Face export still gathers the weights once, at the end of a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from polyrl.core.config import UserError
from polyrl.core.runner.checksums import COMPLETE, MANIFEST, check_manifest, has_manifest

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from polyrl.core.interfaces import Policy

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


def policy_part(policy: Policy) -> Any:
    """What a checkpoint holds for ``policy``: its shards when it writes them, else its
    full state dict."""
    if isinstance(policy, WritesShards) and policy.sharded_checkpoint:
        return DirectoryPart(policy.save_sharded)
    return policy.state_dict()


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """Without a process group DCP reads in this process alone, as local mode means to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(*, ignore_frozen_params: bool = False, strict: bool = True) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=ignore_frozen_params, strict=strict)


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


def uses_lora(cfg: Any) -> bool:
    """Whether a policy config trains a LoRA adapter (its sharded state is the adapter's)."""
    lora = getattr(cfg, "lora", None)
    return lora is not None and lora.r > 0


def load_part(policy: Any, part: Any, name: str) -> None:
    """Restore a policy from its checkpoint part: a full state dict, or a sharded
    directory (read by the Ray group's ranks, or whole by a local policy)."""
    if not isinstance(part, SavedDirectory):
        policy.load_state_dict(part)
    elif isinstance(policy, LoadsShards):
        policy.load_sharded(part.path)
    else:
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


# --- verifying a checkpoint against the run that resumes it -------------------------------
# Resuming or evaluating a damaged or mismatched checkpoint used to fail deep inside a load
# (a zip error, a size mismatch, a KeyError), after the models had loaded. These checks
# read only file sizes, zip directories, pickled structure (tensors memory-mapped, never
# read), DCP's ``.metadata`` and safetensors headers, then hash every file against the
# checkpoint's manifest (polyrl.core.runner.checksums), all before any model loads.

_LORA_KEY = re.compile(r"^(.*)\.lora_([AB])\.[^.]+\.weight$")


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot resume this run: damaged, or written by another setup."""


@dataclass(frozen=True)
class SavedPosition:
    """Where the checkpoint's data stream stood; checked once the dataset is loaded."""

    checkpoint: Path | None  # None: not resuming, or nothing to resume from
    epoch: int = 0
    position: int = 0

    def check_data(self, rows: int, source: str = "data.path") -> None:
        """The dataset must still hold the rows the saved position points past."""
        if self.checkpoint is not None and self.position > rows:
            raise CheckpointError(
                f"checkpoint {self.checkpoint}: its data position is row {self.position} "
                f"of epoch {self.epoch}, but the training data ({source}) now has {rows} "
                "rows; resume with the data that run used, or start a fresh run (another "
                "run.dir)"
            )


def _fix(ckpt: Path) -> str:
    """What to do about a damaged checkpoint: resume from the newest older complete one
    whose files match their checksums, or start a fresh run."""
    older = sorted(
        (
            p
            for p in ckpt.parent.iterdir()
            if p.name < ckpt.name and re.fullmatch(r"step_\d+", p.name) and (p / COMPLETE).is_file()
        ),
        reverse=True,
    )
    for prev in older:
        if has_manifest(prev) and check_manifest(prev) is not None:
            continue  # damaged too: never offer it
        return (
            f"move {ckpt.name} out of {ckpt.parent} (mv {ckpt} {ckpt}.damaged) to resume "
            f"from {prev.name}, the previous complete checkpoint ({prev}), with --resume "
            f"{ckpt.parent.parent}; or start a fresh run (another run.dir)"
        )
    return "start a fresh run (another run.dir), or resume from a copy of the run you kept"


def _check_sums(ckpt: Path) -> None:
    """Every file against the checkpoint's SHA-256 manifest (bit rot in a tensor is seen
    only here); a checkpoint written before manifests gets a one-line note."""
    if not has_manifest(ckpt):
        print(
            f"note: checkpoint {ckpt} has no {MANIFEST} (written before checkpoints carried "
            "checksums): its files are checked for size and structure only",
            file=sys.stderr,
        )
        return
    damage = check_manifest(ckpt)
    if damage is not None:
        raise CheckpointError(f"checkpoint {ckpt}: {damage.file} {damage.what}; {_fix(ckpt)}")


def _read_pt(path: Path, ckpt: Path) -> Any:
    """A ``.pt`` part's structure, its tensors memory-mapped (nothing is read into memory)."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(
            f"checkpoint {ckpt}: {path.name} is empty (0 bytes): the file was cut off or "
            f"overwritten after the checkpoint completed; {_fix(ckpt)}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, mmap=True, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001 (any failure to read is the same damage)
        raise CheckpointError(
            f"checkpoint {ckpt}: {path.name} ({size} bytes) cannot be read, it is truncated "
            f"or damaged ({type(e).__name__}: {str(e).splitlines()[0][:120]}); {_fix(ckpt)}"
        ) from None


def _read_sharded(path: Path, ckpt: Path) -> tuple[dict[str, tuple], dict]:
    """A sharded part's tensor shapes by name (from DCP's ``.metadata``) and ``meta.pt``,
    after checking that every shard file the metadata names is there and long enough."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = f"checkpoint {ckpt}: sharded part {path.name}/"
    for name in (".metadata", META):
        if not (path / name).is_file():
            raise CheckpointError(f"{where} has no {name} (a file is missing); {_fix(ckpt)}")
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{where}.metadata cannot be read ({type(e).__name__}); {_fix(ckpt)}"
        ) from None
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{where}{rel} is missing (.metadata names it); {_fix(ckpt)}")
        if f.stat().st_size < end:
            raise CheckpointError(
                f"{where}{rel} is {f.stat().st_size} bytes, its .metadata says at least {end}: "
                f"the file is truncated; {_fix(ckpt)}"
            )
    meta = _read_pt(path / META, ckpt)
    shapes = {
        k.removeprefix("weights."): tuple(v.size)
        for k, v in md.state_dict_metadata.items()
        if k.startswith("weights.") and isinstance(v, TensorStorageMetadata)
    }
    return shapes, meta if isinstance(meta, dict) else {}


def _model_dir(p: Any) -> Path | None:
    """The folder a policy's model loads from, when it is on this machine (built or a local
    path, or a hub id already in the cache); None when it cannot be found without a
    download."""
    from polyrl.core.runner.builds import ensure_model

    path = Path(ensure_model(p.model, p.build, p.build_args))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(p.model), local_files_only=True))
    except Exception:  # noqa: BLE001 (not cached: the load will say so itself)
        return None


def model_shapes(model_dir: Path) -> dict[str, set[tuple]]:
    """Tensor shapes by name from the model's safetensors headers (top level, else one
    folder down, as a diffusers pipeline keeps them); names in several files with several
    shapes keep them all (ambiguous, never used to accuse a checkpoint)."""
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*/*.safetensors"))
    shapes: dict[str, set[tuple]] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 0 < n < 1 << 28:
                    continue
                header = json.loads(fh.read(n))
        except (OSError, ValueError):
            continue  # an unreadable model is the model loader's error to report
        for k, v in header.items():
            if k != "__metadata__" and isinstance(v, dict) and "shape" in v:
                shapes.setdefault(k, set()).add(tuple(v["shape"]))
    return shapes


def _match(key: str, shapes: dict[str, set[tuple]]) -> str | None:
    """The model tensor a checkpoint key names: itself, or with wrapper prefixes (PEFT's
    ``base_model.model.``, a pipeline's component) dropped from the left."""
    # transformers 5 nests a VLM's text model under language_model; files may not
    for name in dict.fromkeys((key, key.replace("language_model.", "", 1))):
        parts = name.split(".")
        for i in range(len(parts) - 1):
            k = ".".join(parts[i:])
            if k in shapes:
                return k
    return None


def _pattern(key: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", key)


def _check_weights(
    ckpt: Path, name: str, p: Any, saved: dict[str, tuple], meta_lora: bool | None
) -> None:
    """Adapter layout against ``policies.<name>.lora``, and shapes against the model."""
    part = f"checkpoint {ckpt}: policy {name!r}"
    lora = {k: s for k, s in saved.items() if _LORA_KEY.match(k)}
    was_lora = bool(lora) if meta_lora is None else meta_lora
    r = getattr(getattr(p, "lora", None), "r", 0)
    recipe = f"policies.{name}.lora.r={r}"
    if r > 0 and not was_lora:
        raise CheckpointError(
            f"{part} is a full fine-tune (no LoRA adapter weights), but {recipe} asks for a "
            "LoRA adapter; resume with lora.r=0 as that run had, or start a fresh run "
            "(another run.dir) to train an adapter"
        )
    if r == 0 and was_lora:
        raise CheckpointError(
            f"{part} holds LoRA adapter weights, but {recipe} asks for a full fine-tune; "
            "resume with the lora settings of the run that wrote it, or start a fresh run"
        )
    ranks = {s[0] for k, s in lora.items() if (m := _LORA_KEY.match(k)) and m[2] == "A" and s}
    if r > 0 and ranks and ranks != {r}:
        raise CheckpointError(
            f"{part} holds LoRA adapters of rank {sorted(ranks)}, but {recipe}; resume with "
            "the rank of the run that wrote it"
        )
    model_dir = _model_dir(p)
    shapes = model_shapes(model_dir) if model_dir else {}
    if not shapes:
        return
    matched: dict[str, str] = {}
    for key, shape in saved.items():
        m = _LORA_KEY.match(key)
        target = _match(f"{m.group(1)}.weight" if m else key, shapes)
        if target is None or len(shapes[target]) != 1:
            continue
        matched[key] = target
        (want,) = shapes[target]
        if m:  # lora_A is (r, in), lora_B is (out, r); the model's weight is (out, in)
            ok = len(want) == 2 and len(shape) == 2
            ok = ok and (shape[1] == want[1] if m.group(2) == "A" else shape[0] == want[0])
        else:
            ok = tuple(shape) == want
        if not ok:
            raise CheckpointError(
                f"{part}: {key} has shape {list(shape)}, the model in {model_dir} "
                f"(policies.{name}.model) has {target} of shape {list(want)}: the checkpoint "
                "was written for another model or another size; resume with the model "
                "that run used (same model and build_args), or start a fresh run"
            )
    if not matched:
        return  # a layout this check does not know: the load itself reports mismatches
    known = {_pattern(k) for k in matched}
    extra = sorted(k for k in saved if k not in matched and _pattern(k) in known)
    missing = (
        sorted(
            t
            for t in set(shapes) - set(matched.values())
            if _pattern(t) in {_pattern(v) for v in matched.values()}
        )
        if not was_lora
        else []
    )
    if extra or missing:
        what = f"has {extra[:3]} the model lacks" if extra else f"lacks {missing[:3]} of the model"
        raise CheckpointError(
            f"{part} {what} ({model_dir}): the checkpoint was written for a model with "
            "another number of layers or blocks; resume with the model that run used, or "
            "start a fresh run"
        )


def verify_checkpoint(cfg: Any, run_dir: Path) -> SavedPosition:
    """Check the run's latest complete checkpoint before anything loads from it: every part
    present and readable (sizes, zip directories, DCP metadata and shard lengths), one part
    per policy of the recipe, each policy's adapter layout (LoRA or full, rank) and tensor
    shapes against its model's safetensors headers. Returns the saved data position for
    :meth:`SavedPosition.check_data` once the dataset is loaded (one that checks nothing
    when the run does not resume or has no complete checkpoint: it then starts afresh)."""
    if not cfg.run.resume:
        return SavedPosition(None)
    ckpts = Path(run_dir).expanduser() / "checkpoints"
    found = (
        sorted(
            p
            for p in ckpts.iterdir()
            if re.fullmatch(r"step_\d+", p.name) and (p / "COMPLETE").is_file()
        )
        if ckpts.is_dir()
        else []
    )
    if not found:
        return SavedPosition(None)
    ckpt = found[-1]
    holds = sorted(p.name for p in ckpt.iterdir() if p.name not in (COMPLETE, MANIFEST))
    parts = {Path(n).stem if n.endswith(".pt") else n for n in holds}

    def need(part: str, why: str) -> None:
        if part not in parts:
            raise CheckpointError(
                f"checkpoint {ckpt}: {why}, but it has no {part} (it holds {holds}); a part "
                f"was deleted or the recipe names other policies; {_fix(ckpt)}"
            )

    need("trainer", "every checkpoint holds trainer.pt (step, data position, RNG)")
    theirs = sorted(n.removeprefix("policy_") for n in parts if n.startswith("policy_"))
    if theirs and not set(theirs) & set(cfg.policies):  # not a deleted part: another recipe
        raise CheckpointError(
            f"checkpoint {ckpt} holds policies {theirs}, the recipe names {sorted(cfg.policies)}: "
            f"the run was made with another recipe; give the run's own ("
            f"{Path(run_dir).expanduser() / 'config.yaml'}) to resume, evaluate or export it"
        )
    for name in cfg.policies:
        need(f"policy_{name}", f"the recipe has policy {name!r}")
    if cfg.rollout.max_staleness:
        need(
            "rollouts",
            f"rollout.max_staleness={cfg.rollout.max_staleness} resumes batches in flight",
        )
    trainer = _read_pt(ckpt / "trainer.pt", ckpt)
    sampler = trainer.get("sampler") if isinstance(trainer, dict) else None
    if not isinstance(sampler, dict) or "position" not in sampler:
        raise CheckpointError(
            f"checkpoint {ckpt}: trainer.pt holds no data position (sampler); it was not "
            f"written by this PolyRL; {_fix(ckpt)}"
        )
    for name, p in cfg.policies.items():
        folder = ckpt / f"policy_{name}"
        if folder.is_dir():
            saved, meta = _read_sharded(folder, ckpt)
            _check_weights(ckpt, name, p, saved, bool(meta.get("lora")) if meta else None)
            continue
        state = _read_pt(ckpt / f"policy_{name}.pt", ckpt)
        weights = state.get("weights") if isinstance(state, dict) else None
        if isinstance(weights, dict):
            saved = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
            _check_weights(ckpt, name, p, saved, None)
    for part in ("workflow", "rollouts"):
        if (ckpt / f"{part}.pt").is_file():
            _read_pt(ckpt / f"{part}.pt", ckpt)
    _check_sums(ckpt)  # last: the checks above name a missing or cut file more precisely
    return SavedPosition(ckpt, int(sampler.get("epoch", 0)), int(sampler["position"]))
