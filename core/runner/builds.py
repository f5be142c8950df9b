"""Models a recipe builds: each named builder's model built once per settings, never in place.

A policy may name a model builder (``policies.<name>.build`` with ``build_args``) instead of
a checkpoint; :func:`ensure_model` resolves the path, building first where needed. Each built
directory carries a build record (``polyrl_build.json``) so a later run reuses exactly its
own build, builds other settings beside it, and never touches a model it did not build.
:func:`build_once` is the atomic write every builder shares (a temp dir renamed into place).
This lives apart from the builders themselves (:mod:`polyrl.core.demo.tiny` and the plugins'
``tiny`` modules): running a recipe needs the resolution, not the demo models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polyrl.core.config import ConfigError
from polyrl.core.registry import MODELS

log = logging.getLogger(__name__)


def build_once(
    path: str | Path, write: Callable[[Path], None], complete: Callable[[Path], bool]
) -> Path:
    """Run ``write(tmp_dir)`` in a temp dir beside ``path`` and rename it into place, so a
    crash or a concurrent builder never leaves a half-written model; a model ``complete``
    says is finished is returned untouched, anything else already at ``path`` is an error."""
    path = Path(path).expanduser()
    if complete(path):
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists but is not a complete model; remove it to rebuild")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        try:
            os.replace(tmp, path)  # atomic; replaces only a missing or empty directory
        except OSError:
            if not complete(path):  # a concurrent builder that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# The build record: what built a model directory, written into it with the model.
BUILD_RECORD = "polyrl_build.json"


def build_settings(builder: str, args: Any = None) -> dict:
    """What ``builder`` would build with ``args``: its name and every option bound (defaults
    included), as plain JSON values, so a record compares equal exactly when the build would."""
    options = MODELS.bind(builder, args, "build_args")

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        raise TypeError(
            f"model builder {builder!r}: option value {value!r} cannot be recorded as JSON"
        )

    return {"builder": builder, "options": json.loads(json.dumps(options, default=plain))}


def setting_differences(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for each setting two build records disagree on."""
    missing = "(unset)"
    out = (
        [f"build: {old['builder']!r} -> {new['builder']!r}"]
        if old["builder"] != new["builder"]
        else []
    )
    a, b = old.get("options", {}), new.get("options", {})
    for key in sorted(set(a) | set(b)):
        if a.get(key, missing) != b.get(key, missing):
            out.append(f"{key}: {a.get(key, missing)!r} -> {b.get(key, missing)!r}")
    return out


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {BUILD_RECORD}


def _read_record(path: Path) -> dict | None:
    file = path / BUILD_RECORD
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model directory {str(path)!r}: its build record {BUILD_RECORD} cannot be read "
            f"({e}); delete the directory to rebuild it"
        ) from None
    if not isinstance(record, dict) or not {"builder", "options", "files"} <= set(record):
        raise ConfigError(
            f"model directory {str(path)!r}: {BUILD_RECORD} is not a PolyRL build record; "
            "delete the directory to rebuild it, or point the policy's model elsewhere"
        )
    return record


def _plan(path: Path, want: dict) -> str:
    """``build`` (nothing there), ``reuse`` (this build), ``other`` (a build of ours with other
    settings) or ``foreign`` (a model PolyRL did not build) for ``path``; a
    :class:`ConfigError` where our build there lost files (a model is never rebuilt in place)."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return "build"
    if not path.is_dir():
        raise ConfigError(
            f"model path {str(path)!r} is a file, not a model directory; delete it to build "
            "anew, or point the policy's model at another path"
        )
    record = _read_record(path)
    if record is None:
        return "foreign"
    if setting_differences(record, want):
        return "other"
    lost = sorted(set(record["files"]) - _files(path))
    if lost:
        raise ConfigError(
            f"model directory {str(path)!r} lacks files its build wrote "
            f"({', '.join(lost[:5])}{', ...' if len(lost) > 5 else ''}); PolyRL never rebuilds "
            "a model in place (another run may be using it): delete the directory to have it "
            "built again"
        )
    return "reuse"


def keyed_path(path: Path, want: dict) -> Path:
    """Where the build ``want`` goes when ``path`` holds another: beside it, named by a hash
    of the settings, so each setting has one directory and no build replaces another."""
    digest = hashlib.sha1(json.dumps(want, sort_keys=True).encode()).hexdigest()[:10]
    return path.with_name(f"{path.name}-build-{digest}")


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """One builder at a time per model path, across processes (a policy and its engine, or
    Ray workers on one machine, may ask for the same model at once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(path: Path, builder: str, options: Any, want: dict) -> None:
    """Build into a fresh directory beside ``path``, add the record, then move it into place
    (``path`` is missing or empty): a crash leaves no half-written model."""
    stage = path.parent / f".{path.name}.build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        MODELS.get(builder)(stage, **options)
        files = sorted(_files(stage)) if stage.is_dir() else []
        if not files:
            raise RuntimeError(f"model builder {builder!r} wrote no files at {stage}")
        record = {**want, "files": files}
        with open(stage / BUILD_RECORD, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(stage, path)  # atomic; replaces only a missing or empty directory
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ensure_model(path: str | Path, builder: str | None, args: Any = None) -> str:
    """Resolve a recipe's model path, building it first when a builder is named; returns
    the directory to load.

    Without a builder the path is returned as given (after ``~`` expansion), so hub ids
    pass straight through. With one, each built directory carries a build record
    (``polyrl_build.json``: the builder, its bound options and the files it wrote), written
    atomically with the model, and a built model is never changed in place (another run
    may be loading it):

    - no directory (or an empty one): build it there;
    - a record with the same settings: reuse the model;
    - a record with other settings: these settings are built once beside it, in
      ``<path>-build-<hash of the settings>`` (see :func:`keyed_path`), and used from
      there; the model at ``path`` is left as it is;
    - a directory with no record (a user's own model, a trained export, or a model built
      before records existed): used as it is, never touched, with a warning that ``build``
      and ``build_args`` were not applied to it;
    - a build of ours that lost files: refused with a :class:`ConfigError`.
    """
    resolved = os.path.expanduser(str(path))
    if not builder:
        return resolved
    options = MODELS.bind(builder, args, "build_args")
    want = build_settings(builder, options)
    target = Path(resolved)
    with _build_lock(target):
        plan = _plan(target, want)
        if plan == "foreign" and resolved not in _warned:
            _warned.add(resolved)
            log.warning(
                "model %s has no %s, so PolyRL did not build it: it is used as it is, and "
                "build %r and its build_args are not applied. If an older PolyRL built it "
                "with other settings, delete it to have it rebuilt.",
                resolved,
                BUILD_RECORD,
                builder,
            )
        if plan == "build":
            _build(target, builder, options, want)
        if plan != "other":
            return resolved
        keyed = keyed_path(target, want)
        if str(keyed) not in _warned:
            _warned.add(str(keyed))
            have = _read_record(target)
            assert have is not None  # plan "other": a build record, with other settings
            log.warning(
                "model %s was built with other settings (%s); these settings are built at "
                "%s and used from there, and %s is left as it is",
                resolved,
                "; ".join(setting_differences(have, want)),
                keyed,
                resolved,
            )
    with _build_lock(keyed):
        plan = _plan(keyed, want)
        if plan == "build":
            _build(keyed, builder, options, want)
        elif plan != "reuse":
            raise ConfigError(
                f"model directory {str(keyed)!r} (where PolyRL builds {builder!r} with these "
                f"build_args, since {resolved!r} holds another build) holds something else; "
                "delete it"
            )
    return str(keyed)


_warned: set[str] = set()  # paths already warned about (a run resolves its model often)


def check_build_conflicts(policies: dict[str, Any], source: str = "<config>") -> None:
    """Policies that build the same model path must build it the same way.

    Two policies naming one path with different ``build`` or ``build_args`` (e.g. a YAML
    anchor, then an override that reached one of them) almost always meant one model: say
    so at load rather than load two (and break parts that share a base by its path)."""
    seen: dict[str, tuple[str, dict]] = {}
    for name, p in policies.items():
        if not p.build:
            continue
        key = os.path.abspath(os.path.expanduser(str(p.model)))
        want = build_settings(p.build, p.build_args)
        if key not in seen:
            seen[key] = (name, want)
            continue
        first, had = seen[key]
        changes = setting_differences(had, want)
        if changes:
            raise ConfigError(
                f"policies.{first} and policies.{name} in {source} both build model "
                f"{str(p.model)!r}, with different settings (policies.{first} -> "
                f"policies.{name}: {'; '.join(changes)}). One directory holds one build: give "
                "both the same build and build_args, or give each its own model path"
            )
