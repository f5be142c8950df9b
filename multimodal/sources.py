"""Where the ``vl`` dataset's rows come from: a JSONL/JSON/CSV file through the core's
loader, or a Parquet file, dataset directory or hub dataset through ``datasets``.

Arrow-backed rows stay in the memory-mapped table, read one at a time with their images
left as encoded bytes (:class:`ArrowRows`), so loading holds neither pixels nor bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polyrl.core.rollout.data import DataConfig, DataError, load_rows


def undecoded(feature: Any) -> tuple[Any, bool]:
    """``feature`` with every (nested) ``datasets.Image`` set not to decode; whether it
    changed. Images in lists, and video frames in lists of lists, stay encoded bytes."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False), feature.decode
    if isinstance(feature, list) and len(feature) == 1:
        inner, changed = undecoded(feature[0])
        return [inner], changed
    inner = getattr(feature, "feature", None)
    if inner is not None and not isinstance(feature, dict):
        new, changed = undecoded(inner)
        return (type(feature)(new) if changed else feature), changed
    return feature, False


class ArrowRows:
    """Rows of a memory-mapped ``datasets`` table, read one at a time, images undecoded."""

    def __init__(self, table: Any, fields: tuple[str, ...]) -> None:
        for name in fields:
            feature = table.features.get(name)
            if feature is None:
                continue
            new, changed = undecoded(feature)
            if changed:
                table = table.cast_column(name, new)
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> dict:
        return self.table[i]


def load_source(
    cfg: DataConfig, fields: tuple[str, ...], name: str
) -> tuple[Any, list[str], Path | None, bool]:
    """(rows, where, default image root, arrow-backed) for ``cfg.path``."""
    p = Path(cfg.path).expanduser() if cfg.path else None
    if p is not None and p.is_file() and p.suffix.lower() != ".parquet":
        rows, where = load_rows(
            cfg.path, cfg.split, cfg.limit, what=f"{name} data", subset=cfg.subset
        )
        return rows, where, p.parent, False
    import datasets

    try:
        if p is not None and p.is_file():
            table = datasets.load_dataset("parquet", data_files=str(p), split="train")
            label, root = str(p), p.parent
        elif p is not None and p.is_dir():
            table = datasets.load_dataset(str(p), cfg.subset, split=cfg.split)
            label, root = f"{p} (split {cfg.split!r})", p
        else:
            if not cfg.path or cfg.path.startswith(("/", ".", "~")):
                # not a hub name: let the core say what is missing and what is nearby
                load_rows(cfg.path, cfg.split, cfg.limit, what=f"{name} data")
            table = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
            label, root = f"hub dataset {cfg.path!r} (split {cfg.split!r})", None
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"{name} data: could not load {cfg.path!r} with datasets.load_dataset: "
            f"{type(e).__name__}: {e}"
        ) from e
    if cfg.limit is not None:
        table = table.select(range(min(cfg.limit, len(table))))
    rows = ArrowRows(table, fields)
    return rows, [f"{label}, row {i}" for i in range(len(rows))], root, True
