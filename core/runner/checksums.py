"""A checkpoint's checksum manifest: the SHA-256 and size of every file it holds.

Bit rot, a bad disk block or a stray write can damage a tensor without changing a file's
size or breaking its zip directory, so neither ``torch.load`` nor the structural checks of
:func:`polyrl.core.runner.checkpoint.verify_checkpoint` see it: the run resumes from wrong weights
and says nothing. :meth:`polyrl.core.runner.run.RunDir.save` therefore writes ``MANIFEST.json``
into the ``step_N.tmp`` directory after every part (every rank's shards included) and
before ``COMPLETE``, so the manifest is renamed with the checkpoint it describes; resume,
eval and export check it before any model loads. Checkpoints written before manifests
existed have none and still load (unverified, with a one-line note).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
_CHUNK = 1 << 22  # hashlib releases the GIL on large buffers: files hash in parallel


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (relative, sorted) but the manifest and the marker."""
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel not in (MANIFEST, COMPLETE):
                found.append(rel)
    return sorted(found)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_all(root: Path, rels: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda r: file_sha256(root / r), rels), strict=True))


def write_manifest(root: Path) -> Path:
    """Hash every file of the checkpoint being written in ``root`` into ``MANIFEST.json``
    (written and fsynced there; the caller renames the directory when complete)."""
    rels = _files(root)
    digests = _hash_all(root, rels)
    body = {
        "algorithm": "sha256",
        "files": {r: {"size": (root / r).stat().st_size, "sha256": digests[r]} for r in rels},
    }
    path = root / MANIFEST
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


@dataclass(frozen=True)
class Damage:
    """What is wrong with one file of a checkpoint, said as a sentence."""

    file: str
    what: str


def has_manifest(root: Path) -> bool:
    """False for a checkpoint written before manifests existed."""
    return (root / MANIFEST).is_file()


def check_manifest(root: Path) -> Damage | None:
    """``None`` when every file of ``root`` matches its manifest, else the first
    :class:`Damage` (sizes are compared before any file is hashed)."""
    path = root / MANIFEST
    try:
        files = json.loads(path.read_text())["files"]
        want = {str(r): (int(v["size"]), str(v["sha256"])) for r, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return Damage(MANIFEST, f"cannot be read ({type(e).__name__}): it is damaged")
    have = _files(root)
    extra = sorted(set(have) - set(want))
    if extra:
        return Damage(extra[0], f"is not in {MANIFEST}: it was added after the checkpoint")
    for rel, (size, _) in sorted(want.items()):
        f = root / rel
        if not f.is_file():
            return Damage(rel, f"is missing ({MANIFEST} lists it, {size} bytes)")
        got = f.stat().st_size
        if got != size:
            cut = "truncated" if got < size else "longer than written"
            return Damage(rel, f"is {got} bytes, {MANIFEST} says {size}: the file is {cut}")
    digests = _hash_all(root, sorted(want))
    for rel, (_, sha) in sorted(want.items()):
        if digests[rel] != sha:
            return Damage(
                rel,
                f"does not match its SHA-256 in {MANIFEST} (same size, other bytes): it "
                "was damaged on disk after the checkpoint was written",
            )
    return None
