"""Faults made for real on files and processes: a zeroed block inside a stored tensor."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

BLOCK = 4096  # a disk block


def zero_block(path: Path, offset: int, size: int = BLOCK) -> None:
    """Overwrite ``size`` bytes of ``path`` at ``offset`` with zeros, in place (the file
    keeps its length, as bit rot or a bad block leaves it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(size))


def largest_tensor_span(pt: Path) -> tuple[str, int, int]:
    """``(entry, start, length)`` of the largest tensor storage inside a ``torch.save``
    zip (stored uncompressed): where in the file its bytes lie."""
    with zipfile.ZipFile(pt) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(pt, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    return info.filename, start, info.file_size


def zero_block_in_tensor(pt: Path) -> str:
    """Zero one block in the middle of the largest tensor of ``pt``; returns its entry."""
    entry, start, length = largest_tensor_span(pt)
    assert length >= 3 * BLOCK, (entry, length)
    zero_block(pt, start + length // 2 - BLOCK // 2)
    return entry


def sized_state(step: int, n: int) -> dict:
    """A checkpoint state of ``n`` float32 weights drawn from seed ``step``."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "trainer": {"step": step},
        "policy_main": {"weights": {"w": torch.randn(n, generator=g)}},
    }
