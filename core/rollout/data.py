"""Prompt data: load, validate and tokenise a prompt dataset, then sample it deterministically.

Datasets for RL post-training are small text tables, so :class:`PromptDataset` reads and
checks every row up front: a typo in a field name or an empty prompt fails before any GPU
time is spent, with a message that says which file, which row and what to change.
:class:`PromptSampler` turns the dataset into an endless, seed-determined stream of batches
whose position can be saved and restored, so a resumed run sees exactly the prompts the
uninterrupted run would have seen.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.core.config import UserError, doc
from polyrl.core.registry import DATASETS

FILE_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Suffixes that mark a string as a (mistyped or unsupported) local file, never a hub name.
_FILE_LIKE = {*FILE_FORMATS, ".txt", ".tsv", ".arrow", ".gz", ".zip", ".yaml", ".yml", ".xlsx"}


class DataError(UserError, ValueError):
    """A dataset could not be loaded or one of its rows is unusable."""


@dataclass
class DataConfig:
    """Where the prompts come from and how they become token ids."""

    kind: str = doc("text", "dataset kind: text here; plugins add kinds (e.g. vision-language)")
    path: str = doc(
        "", "a .jsonl/.json/.parquet/.csv file, a directory, or a Hugging Face hub dataset name"
    )
    subset: str | None = doc(None, "configuration name of a hub dataset (e.g. 'main' for gsm8k)")
    split: str = doc("train", "split to read from a hub dataset or directory (files have one)")
    prompt_field: str = doc("prompt", "row field holding the prompt: a string or chat messages")
    answer_field: str | None = doc(
        "answer",
        "row field holding the ground truth passed to rewards; null when the task has none",
    )
    system_prompt: str | None = doc(
        None, "system message put before every prompt (a row's own system message wins)"
    )
    chat_template: bool = doc(
        True, "render prompts with the tokenizer's chat template; false tokenises the raw text"
    )
    max_prompt_tokens: int = doc(512, "longest prompt, in tokens after templating")
    overlong: str = doc(
        "filter", "what to do with longer prompts: 'filter' drops and counts them, 'error' stops"
    )
    limit: int | None = doc(None, "use only the first N rows (null: all)")
    shuffle: bool = doc(True, "shuffle prompts each epoch (seeded)")
    args: Any = doc(
        {},
        "options of the dataset kind (e.g. image root and pixel limits)",
        options=DATASETS,
        chooser="kind",
    )


@dataclass
class PromptItem:
    """One prompt ready for generation, with what the reward needs to score it."""

    uid: int
    prompt_ids: list[int]
    prompt_text: str
    answer: Any
    row: dict


# --------------------------------------------------------------------------- loading


def _is_hub_name(path: str) -> bool:
    """Whether a string that is not a local path could name a hub dataset ('owner/name')."""
    if path.startswith(("/", ".", "~")) or "\\" in path:
        return False
    return path.count("/") <= 1 and Path(path).suffix.lower() not in _FILE_LIKE


def _missing_file_message(path: Path, what: str) -> str:
    msg = f"{what}: {str(path)!r} does not exist."
    parent = path.parent
    if parent.is_dir():
        files = sorted(
            p.name for p in parent.iterdir() if p.is_dir() or p.suffix.lower() in FILE_FORMATS
        )
        hint = difflib.get_close_matches(path.name, files, n=1, cutoff=0.5)
        if hint:
            msg += f" Did you mean {str(parent / hint[0])!r}?"
        if files:
            shown = ", ".join(files[:10]) + (
                f", ... ({len(files) - 10} more)" if len(files) > 10 else ""
            )
            msg += f" {str(parent)!r} holds: {shown}."
        else:
            msg += f" {str(parent)!r} holds no data files."
    else:
        msg += f" Its directory {str(parent)!r} does not exist either."
    return msg + " Fix data.path."


def task_paths(task: str, result: Any, used: Sequence[bool]) -> tuple[Path, Path]:
    """What task ``task``'s ``write_dataset`` returned, checked: the (train, eval) paths of
    files it wrote; ``used[i]``: the run reads path ``i`` (no data.path overrides it)."""
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    if not ok or not all(isinstance(p, (str, os.PathLike)) for p in result):
        raise DataError(
            f"task {task!r} (task.name): write_dataset returned {result!r}; it must return "
            "(train_path, eval_path), the two files it wrote. Fix the task's write_dataset"
        )
    paths = (Path(result[0]), Path(result[1]))
    for which, path, read in zip(("train", "eval"), paths, used, strict=True):
        if read and not path.is_file():
            raise DataError(
                f"task {task!r} (task.name): write_dataset returned {str(path)!r} as its "
                f"{which} file, but wrote no such file. Fix the task's write_dataset (or "
                f"give the {which} data's path in the recipe)"
            )
    return paths


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object hook: a key given twice is an error, not 'the last one wins'."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _read_text(path: Path) -> str:
    """A data file as UTF-8 text; another encoding is named by file and line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}). Re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None


def _read_jsonl_text(text: str, path: Path) -> tuple[list[dict], list[str]]:
    rows, where = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as e:
            raise DataError(
                f"{path}, line {lineno}: the key {e.args[0]!r} appears twice in one row; "
                "keep one of them."
            ) from None
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}, line {lineno}: malformed JSON ({e.msg} at column {e.colno}). "
                "Each line of a .jsonl file must be one JSON object; fix or delete this line."
            ) from None
        rows.append(row)
        where.append(f"{path}, line {lineno}")
    return rows, where


def _read_json(path: Path) -> tuple[list[dict], list[str]]:
    text = _read_text(path)
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise DataError(
            f"{path}: the key {e.args[0]!r} appears twice in one object; keep one of them."
        ) from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines saved under a .json name
            return _read_jsonl_text(text, path)
        raise DataError(
            f"{path}: malformed JSON ({e.msg} at line {e.lineno}, column {e.colno}). "
            "A .json file must hold an array of row objects (or use .jsonl, one per line)."
        ) from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list):
        raise DataError(
            f"{path}: expected a JSON array of row objects, got a "
            f"{type(data).__name__}. Write the rows as [{{...}}, {{...}}]."
        )
    return data, [f"{path}, row {i}" for i in range(len(data))]


def _read_with_datasets(
    kind: str, path: Path, split: str | None, subset: str | None = None
) -> list[dict]:
    import datasets

    try:
        if kind in ("parquet", "csv"):
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(str(path), subset, split=split)
    except Exception as e:  # datasets raises many types; keep the cause, add the context
        raise DataError(
            f"could not load {str(path)!r} (split {split!r}) with "
            f"datasets.load_dataset: {type(e).__name__}: {e}"
        ) from e
    return [dict(r) for r in ds]


def check_paths(sources: Iterable[tuple[str, DataConfig]]) -> None:
    """Fail now, before any model builds or loads, when a data config (``(name, config)``,
    e.g. ``("eval", cfg.eval.data)``) names a local file or directory that is not there:
    reading it would fail the same way, only after the model. Empty paths (a task fills
    them in; no evaluation) and hub dataset names pass; rows are checked when read."""
    for name, cfg in sources:
        if cfg.path and not _is_hub_name(cfg.path):
            p = Path(cfg.path).expanduser()
            if not p.exists():
                raise DataError(_missing_file_message(p, f"{name} data"))


def load_rows(
    path: str,
    split: str = "train",
    limit: int | None = None,
    what: str = "dataset",
    subset: str | None = None,
) -> tuple[list[dict], list[str]]:
    """Read raw rows and a human-readable location for each ('file, line 3').

    Files are read by extension; directories and hub names go through ``datasets``.
    """
    if not path:
        raise DataError(
            f"{what}: data.path is empty. Set it to a .jsonl/.json/.parquet/.csv "
            "file or a Hugging Face hub dataset name."
        )
    p = Path(path).expanduser()
    if p.is_dir():
        rows = _read_with_datasets("dir", p, split, subset)
        where = [f"{p} (split {split!r}), row {i}" for i in range(len(rows))]
    elif p.is_file():
        kind = FILE_FORMATS.get(p.suffix.lower())
        if kind is None:
            raise DataError(
                f"{what}: {str(p)!r} has an unsupported extension "
                f"{p.suffix or '(none)'!r}. Supported: "
                f"{', '.join(FILE_FORMATS)}. Convert the file or rename it."
            )
        if kind == "jsonl":
            rows, where = _read_jsonl_text(_read_text(p), p)
        elif kind == "json":
            rows, where = _read_json(p)
        else:
            rows = _read_with_datasets(kind, p, None)
            if kind == "csv":  # name the line a spreadsheet user will look at
                where = [f"{p}, row {i} (line {i + 2})" for i in range(len(rows))]
            else:
                where = [f"{p}, row {i}" for i in range(len(rows))]
    elif _is_hub_name(path):
        try:
            rows = _read_with_datasets("hub", Path(path), split, subset)
        except DataError as e:
            raise DataError(
                f"{what}: {path!r} is not a local file or directory, and loading "
                f"it as a Hugging Face hub dataset failed: {e.__cause__}"
            ) from e
        where = [f"hub dataset {path!r} (split {split!r}), row {i}" for i in range(len(rows))]
    else:
        raise DataError(_missing_file_message(p, what))
    if limit is not None:
        rows, where = rows[:limit], where[:limit]
    return rows, where


# --------------------------------------------------------------------------- validation


def _is_blank(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):  # empty CSV cell
        return True
    return isinstance(value, str) and not value.strip()


def _check_messages(value: list, where: str, field: str) -> list[dict]:
    if not value:
        raise DataError(
            f"{where}: field {field!r} is an empty message list. "
            "Give at least one {'role': ..., 'content': ...} message."
        )
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: field {field!r}, message {j} is {m!r}; chat messages "
                "must be dicts with 'role' and 'content'."
            )
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, list)):
            raise DataError(
                f"{where}: field {field!r}, message {j} needs a string 'role' and "
                "a string (or content-part list) 'content'."
            )
    if all(isinstance(m["content"], str) and not m["content"].strip() for m in value):
        raise DataError(
            f"{where}: field {field!r} has only empty messages. Fill in the prompt or drop the row."
        )
    return [dict(m) for m in value]


def _field_missing(row: dict, field: str, where: str, setting: str) -> DataError:
    fields = [str(k) for k in row]
    hint = difflib.get_close_matches(field, fields, n=1, cutoff=0.5)
    msg = (
        f"{where}: the row has no field {field!r}. Its fields are: "
        f"{', '.join(repr(f) for f in fields) or '(none)'}."
    )
    if hint:
        msg += f" Did you mean {hint[0]!r}? Set data.{setting}={hint[0]}."
    else:
        msg += f" Set data.{setting} to the field that holds it."
    return DataError(msg)


class PromptDataset:
    """Every usable prompt of one dataset, validated and tokenised at construction."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, name: str = "train") -> None:
        if cfg.overlong not in ("filter", "error"):
            raise DataError(f"data.overlong must be 'filter' or 'error', not {cfg.overlong!r}")
        if cfg.max_prompt_tokens <= 0:
            raise DataError(f"data.max_prompt_tokens must be positive, not {cfg.max_prompt_tokens}")
        if cfg.args:
            raise DataError(
                f"{name} data: data.args {sorted(cfg.args)} given, but the 'text' "
                "dataset kind takes no options. Remove them or set data.kind to "
                "the kind they belong to."
            )
        if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{name} data: the tokenizer has no chat template. Use a chat/"
                "instruct tokenizer, or set data.chat_template=false to tokenise "
                "the raw prompt text."
            )
        self.cfg = cfg
        self.name = name
        self._tokenizer = tokenizer
        rows, where = load_rows(
            cfg.path, cfg.split, cfg.limit, what=f"{name} data", subset=cfg.subset
        )
        if not rows:
            raise DataError(f"{name} data: {cfg.path!r} has no rows.")

        texts, answers = [], []
        for row, loc in zip(rows, where, strict=True):
            prompt, answer = self._validate(row, loc)
            texts.append(self._render(prompt, loc))
            answers.append(answer)
        ids = tokenizer(texts, add_special_tokens=not cfg.chat_template)["input_ids"]

        self.items: list[PromptItem] = []
        filtered = 0
        for uid, (row, loc, text, answer, toks) in enumerate(
            zip(rows, where, texts, answers, ids, strict=True)
        ):
            if len(toks) > cfg.max_prompt_tokens:
                if cfg.overlong == "error":
                    raise DataError(
                        f"{loc}: prompt is {len(toks)} tokens after templating, "
                        f"over data.max_prompt_tokens={cfg.max_prompt_tokens}. "
                        "Raise the limit, shorten the prompt, or set "
                        "data.overlong=filter to drop such rows."
                    )
                filtered += 1
                continue
            self.items.append(
                PromptItem(uid=uid, prompt_ids=list(toks), prompt_text=text, answer=answer, row=row)
            )
        self.stats = {"rows": len(rows), "kept": len(self.items), "filtered_overlong": filtered}
        if not self.items:
            raise DataError(
                f"{name} data: all {len(rows)} prompts in {cfg.path!r} are longer "
                f"than data.max_prompt_tokens={cfg.max_prompt_tokens}; nothing is "
                "left to train on. Raise the limit."
            )

    def _validate(self, row: Any, where: str) -> tuple[str | list[dict], Any]:
        cfg = self.cfg
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: expected a row object with a {cfg.prompt_field!r} field, "
                f"got a {type(row).__name__}."
            )
        if cfg.prompt_field not in row:
            raise _field_missing(row, cfg.prompt_field, where, "prompt_field")
        prompt = row[cfg.prompt_field]
        if isinstance(prompt, list):
            prompt = _check_messages(prompt, where, cfg.prompt_field)
        elif _is_blank(prompt):
            raise DataError(
                f"{where}: field {cfg.prompt_field!r} is empty. Fill in the prompt or drop the row."
            )
        elif not isinstance(prompt, str):
            raise DataError(
                f"{where}: field {cfg.prompt_field!r} is a {type(prompt).__name__} "
                f"({prompt!r:.60}); it must be a string or a list of "
                "{'role', 'content'} messages."
            )
        answer = None
        if cfg.answer_field is not None:
            if cfg.answer_field not in row:
                raise _field_missing(row, cfg.answer_field, where, "answer_field")
            answer = row[cfg.answer_field]
            if _is_blank(answer) and not isinstance(answer, str):
                raise DataError(
                    f"{where}: field {cfg.answer_field!r} is null. Give every row "
                    "an answer, or set data.answer_field=null if the task has no "
                    "ground truth."
                )
        return prompt, answer

    def _render(self, prompt: str | list[dict], where: str) -> str:
        cfg = self.cfg
        if not cfg.chat_template:
            parts = (
                [prompt]
                if isinstance(prompt, str)
                else [m["content"] for m in prompt if isinstance(m["content"], str)]
            )
            if cfg.system_prompt and (isinstance(prompt, str) or prompt[0]["role"] != "system"):
                parts.insert(0, cfg.system_prompt)
            return "\n\n".join(parts)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        try:
            text = self._tokenizer_render(messages)
        except Exception as e:  # template errors come from jinja; say which row hit them
            raise DataError(
                f"{where}: the tokenizer's chat template failed on this prompt: "
                f"{type(e).__name__}: {e}"
            ) from e
        return text

    def _tokenizer_render(self, messages: list[dict]) -> str:
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        if isinstance(text, list):  # some versions wrap a single conversation
            text = text[0]
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)


# --------------------------------------------------------------------------- sampling


class PromptSampler:
    """Endless batches over a dataset, one seeded permutation per epoch.

    The order depends only on (seed, epoch), never on global RNG state, so saving
    ``(epoch, position)`` is enough to resume the exact stream.
    """

    def __init__(
        self, dataset: Sequence[PromptItem], batch_size: int, seed: int, shuffle: bool = True
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, not {batch_size}")
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def epoch(self) -> int:
        """Epoch of the next item to be drawn (0-based)."""
        return self._epoch

    def next_batch(self) -> list[PromptItem]:
        """The next ``batch_size`` items, continuing into the next epoch when one ends."""
        batch: list[PromptItem] = []
        while len(batch) < self.batch_size:
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._order_for(self._epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self._position)
            idx = self._order[self._position : self._position + take]
            batch.extend(self.dataset[int(i)] for i in idx)
            self._position += take
        return batch

    def __iter__(self) -> Iterator[list[PromptItem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands; enough (with the seed) to continue it exactly."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` taken on a sampler with the same seed and data."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise ValueError(
                f"sampler state {state} does not fit a dataset of {len(self.dataset)} items"
            )
        self._epoch, self._position = epoch, position
        self._order = self._order_for(epoch)


# --------------------------------------------------------------------------- writing


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Write rows as JSON lines atomically, so a crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


DATASETS.register("text", PromptDataset)
