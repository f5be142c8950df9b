"""Tiny Qwen2 (and Qwen3-MoE) models built offline, for tests and CPU demos.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a task's corpus and a small
Qwen2 is initialised from a seed. Both save as an ordinary Hugging Face checkpoint, so every
engine (HF, vLLM) loads them exactly as it would a real Qwen2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import polyrl.core.tasks  # noqa: F401  (registers the tasks whose corpora we train on)
from polyrl.core.config import ConfigError
from polyrl.core.registry import MODELS, TASKS

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM, Qwen2Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Files a finished checkpoint holds; their presence means a build completed.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
log = logging.getLogger(__name__)


def _byte_alphabet(full: bool) -> list[str]:
    """Byte-level symbols the vocab always holds, so any (ASCII) text round-trips."""
    from tokenizers import pre_tokenizers

    if full:
        return pre_tokenizers.ByteLevel.alphabet()
    text = "".join(chr(i) for i in range(32, 127)) + "\n\t"
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return sorted(set(mapped.pre_tokenize_str(text)[0][0]))


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 128) -> Qwen2Tokenizer:
    """Train a small byte-level BPE with Qwen2's exact pre-tokenisation.

    Using Qwen2's own normaliser and split regex (one token per digit) means the tokenizer
    reloads identically through ``AutoTokenizer``, which rebuilds that pipeline from the
    vocab and merges. Below 259 entries the base alphabet is printable ASCII plus newline
    and tab (other bytes are dropped); from 259 up it is all 256 bytes.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    full = vocab_size >= 256 + len(SPECIAL_TOKENS)
    tok = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=_byte_alphabet(full),
        show_progress=False,
    )
    # Special tokens are cut out before pre-tokenisation at encode time; cut them out here
    # too, so no merges are spent on their fragments ("<|", "im", ...).
    pieces = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    texts = [piece for text in corpus for piece in pieces.split(text) if piece]
    tok.train_from_iterator(texts, trainer)
    return Qwen2Tokenizer(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,  # type: ignore[arg-type]  # transformers types it str; None: no unk token
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_qwen2(
    tokenizer: Qwen2Tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    vocab_rows: int = 0,
) -> Qwen2ForCausalLM:
    """A float32 Qwen2 sized to ``tokenizer``, initialised deterministically from ``seed``.

    ``head_dim`` is written to the config explicitly (default 64) because vLLM's CPU
    attention kernel rejects smaller heads; it need not equal hidden_size / num_heads.
    ``vocab_rows`` (0: the tokenizer's size) pads the embedding to a real model's vocabulary
    (rows the tokenizer never emits), so the model has that model's shape and memory.
    The global torch RNG is left as it was.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    # one token in, one id out (transformers types the result int | list[int])
    pad_id: int = tokenizer.convert_tokens_to_ids(PAD_TOKEN)  # type: ignore[assignment]
    eos_id: int = tokenizer.convert_tokens_to_ids(EOS_TOKEN)  # type: ignore[assignment]
    if vocab_rows and vocab_rows < len(tokenizer):
        raise ValueError(f"vocab_rows={vocab_rows} is below the tokenizer's {len(tokenizer)}")
    config = Qwen2Config(
        **text_config(
            vocab_rows or len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            pad_id=pad_id,
            eos_id=eos_id,
        ),
        head_dim=head_dim,  # type: ignore[call-arg]  # Qwen2Config takes it; not in its typed init
        max_window_layers=num_layers,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
    )
    return seeded_model(Qwen2ForCausalLM, config, seed, pad_id=pad_id, eos_ids=[eos_id, pad_id])


def text_config(
    vocab_size: int,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    pad_id: int,
    eos_id: int,
) -> dict[str, Any]:
    """The Qwen2-style text config fields every tiny builder sets (this module's Qwen2 and
    the Qwen-VL families' language model): sizes, and the pad token as bos and pad."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def seeded_model(cls: Any, config: Any, seed: int, *, pad_id: int, eos_ids: list[int]) -> Any:
    """``cls(config)`` in float32 and eval mode, initialised from ``seed`` with the global
    torch RNG left as it was, generating until one of ``eos_ids``."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    return model.eval()


def pretrain(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 32,
) -> None:
    """Next-token training of ``model`` on ``texts`` (padded batches, pad tokens masked)."""
    import torch

    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    pad = tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            pick = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
            width = max(len(rows[i]) for i in pick)
            ids = torch.full((batch_size, width), pad, dtype=torch.long)
            mask = torch.zeros((batch_size, width), dtype=torch.long)
            for j, i in enumerate(pick):
                ids[j, : len(rows[i])] = torch.tensor(rows[i])
                mask[j, : len(rows[i])] = 1
            labels = ids.masked_fill(mask == 0, -100)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.eval()


def warm_start_texts(
    task_name: str, tokenizer: Any, seed: int, task_args: dict | None = None
) -> list[str]:
    """A task's format warm-start conversations (its ``sft_rows`` over a train set it writes
    with ``seed``), rendered with the chat template: what a model that has seen the task
    knows -- its answer formats and, for tasks whose rows carry them, arbitrary habits."""
    import tempfile

    from polyrl.core.data import load_rows

    task = TASKS.get(task_name)
    with tempfile.TemporaryDirectory() as tmp:
        train_path, _ = task.write_dataset(tmp, seed=seed, **(task_args or {}))
        rows = load_rows(str(train_path))[0]
    texts = []
    for row in task.sft_rows(rows):
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [*messages, {"role": "assistant", "content": str(row["response"])}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return texts


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` holds a finished checkpoint (weights, config and tokenizer)."""
    p = Path(path).expanduser()
    return all((p / name).is_file() for name in MODEL_FILES)


@MODELS.register("tiny_qwen2")
def tiny_qwen2(
    path: str | Path,
    *,
    corpus: Annotated[str, "task whose corpus() trains the tokenizer (and pretraining)"] = (
        "arithmetic"
    ),
    vocab_size: Annotated[int, "BPE vocabulary size of the tokenizer"] = 128,
    seed: Annotated[int, "initialisation and pretraining seed"] = 0,
    pretrain_steps: Annotated[int, "next-token steps on the corpus (0: random init)"] = 0,
    pretrain_lr: Annotated[float, "AdamW learning rate of pretraining"] = 1e-3,
    pretrain_on: Annotated[str, "corpus, or sft: the task's format warm start"] = "corpus",
    task_args: Annotated[dict | None, "the task's options, for pretrain_on: sft"] = None,
    hidden_size: Annotated[int, "model width"] = 64,
    num_layers: Annotated[int, "decoder layers"] = 2,
    num_heads: Annotated[int, "attention heads"] = 1,
    num_kv_heads: Annotated[int, "key/value heads"] = 1,
    head_dim: Annotated[int, "per-head width (vLLM's CPU kernel needs 64)"] = 64,
    intermediate_size: Annotated[int, "MLP width"] = 256,
    max_position_embeddings: Annotated[int, "longest sequence"] = 512,
    tie_word_embeddings: Annotated[bool, "share input and output embeddings"] = True,
    vocab_rows: Annotated[int, "embedding rows (0: the tokenizer's size; more pads it)"] = 0,
) -> Path:
    """Build a tiny Qwen2 + tokenizer at ``path`` (once), trained on task ``corpus``'s texts.

    The tokenizer is trained on the corpus; with ``pretrain_steps`` the model is too
    (next-token loss over the corpus texts, batches of 32, AdamW at ``pretrain_lr``,
    deterministic in ``seed``): a base that knows the task's language, as a real pretrained
    model would -- what a recipe that trains only LoRA adapters on top needs.
    ``pretrain_on: sft`` trains on the task's format warm start instead (see
    :func:`warm_start_texts`; ``task_args`` go to its ``write_dataset``), so the base already
    answers in the task's format, as an instruction-tuned model would; the tokenizer is
    still trained on the corpus, so it matches the task's other tiny models token for token.
    The checkpoint is written to a temp dir beside ``path`` and renamed into place, so a
    crash or a concurrent builder never leaves a half-written model. A complete checkpoint
    already at ``path`` is returned untouched (recipes build through :func:`ensure_model`,
    which first checks the directory's build record).
    """
    return _write_tiny(
        path,
        build_tiny_qwen2,
        corpus=corpus,
        vocab_size=vocab_size,
        seed=seed,
        pretrain_steps=pretrain_steps,
        pretrain_lr=pretrain_lr,
        pretrain_on=pretrain_on,
        task_args=task_args,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        vocab_rows=vocab_rows,
    )


def _write_tiny(
    path: str | Path,
    build_model: Callable[..., Any],
    *,
    corpus: str,
    vocab_size: int,
    seed: int,
    pretrain_steps: int,
    pretrain_lr: float,
    pretrain_on: str,
    task_args: dict | None,
    **model_args: Any,
) -> Path:
    """What the registered tiny builders share: ``corpus``'s tokenizer, the model
    ``build_model(tokenizer, seed=seed, **model_args)`` makes for it, optionally pretrained
    (see :func:`tiny_qwen2`), written once at ``path`` (:func:`build_once`)."""
    if pretrain_on not in ("corpus", "sft"):
        raise ValueError(f"pretrain_on must be 'corpus' or 'sft', got {pretrain_on!r}")

    def write(tmp: Path) -> None:
        tokenizer = build_tokenizer(TASKS.get(corpus).corpus(), vocab_size=vocab_size)
        model = build_model(tokenizer, seed=seed, **model_args)
        if pretrain_steps:
            texts = (
                TASKS.get(corpus).corpus()
                if pretrain_on == "corpus"
                else warm_start_texts(corpus, tokenizer, seed, task_args)
            )
            pretrain(model, tokenizer, texts, pretrain_steps, pretrain_lr, seed)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_once(path, write)


def build_tiny_qwen3_moe(
    tokenizer: Qwen2Tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
    norm_topk_prob: bool = True,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Any:
    """A float32 Qwen3-MoE (every layer a sparse MoE block: ``num_experts`` experts, top-
    ``experts_per_token`` routing) sized to ``tokenizer``, initialised from ``seed``.

    The architecture of Qwen3-30B-A3B at toy size, so every engine loads it as that family
    (``Qwen3MoeForCausalLM``); its routers are ``Qwen3MoeTopKRouter`` modules, which
    :mod:`polyrl.core.moe` hooks. ``norm_topk_prob`` renormalises the chosen experts'
    weights to sum to 1, as Qwen3-30B-A3B does. The global torch RNG is left as it was.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(
            f"experts_per_token={experts_per_token} must be between 1 and num_experts={num_experts}"
        )
    pad_id: int = tokenizer.convert_tokens_to_ids(PAD_TOKEN)  # type: ignore[assignment]
    eos_id: int = tokenizer.convert_tokens_to_ids(EOS_TOKEN)  # type: ignore[assignment]
    config = Qwen3MoeConfig(
        **text_config(
            len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=moe_intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            pad_id=pad_id,
            eos_id=eos_id,
        ),
        head_dim=head_dim,  # type: ignore[call-arg]  # Qwen3MoeConfig takes it; not typed
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
    )
    return seeded_model(Qwen3MoeForCausalLM, config, seed, pad_id=pad_id, eos_ids=[eos_id, pad_id])


@MODELS.register("tiny_qwen3_moe")
def tiny_qwen3_moe(
    path: str | Path,
    *,
    corpus: Annotated[str, "task whose corpus() trains the tokenizer (and pretraining)"] = (
        "arithmetic"
    ),
    vocab_size: Annotated[int, "BPE vocabulary size of the tokenizer"] = 128,
    seed: Annotated[int, "initialisation and pretraining seed"] = 0,
    pretrain_steps: Annotated[int, "next-token steps on the corpus (0: random init)"] = 0,
    pretrain_lr: Annotated[float, "AdamW learning rate of pretraining"] = 1e-3,
    pretrain_on: Annotated[str, "corpus, or sft: the task's format warm start"] = "corpus",
    task_args: Annotated[dict | None, "the task's options, for pretrain_on: sft"] = None,
    hidden_size: Annotated[int, "model width"] = 64,
    num_layers: Annotated[int, "decoder layers (each a sparse MoE block)"] = 2,
    num_heads: Annotated[int, "attention heads"] = 1,
    num_kv_heads: Annotated[int, "key/value heads"] = 1,
    head_dim: Annotated[int, "per-head width (vLLM's CPU kernel needs 64)"] = 64,
    num_experts: Annotated[int, "experts per layer"] = 4,
    experts_per_token: Annotated[int, "experts each token is routed to (top-k)"] = 2,
    moe_intermediate_size: Annotated[int, "each expert's MLP width"] = 64,
    norm_topk_prob: Annotated[bool, "renormalise the chosen experts' weights to sum 1"] = True,
    max_position_embeddings: Annotated[int, "longest sequence"] = 512,
    tie_word_embeddings: Annotated[bool, "share input and output embeddings"] = True,
) -> Path:
    """Build a tiny Qwen3-MoE + tokenizer at ``path`` (once): :func:`tiny_qwen2`'s
    tokenizer and pretraining (the same corpus gives the same tokenizer, token for token),
    with a mixture-of-experts model (:func:`build_tiny_qwen3_moe`) in place of the dense one.
    """
    return _write_tiny(
        path,
        build_tiny_qwen3_moe,
        corpus=corpus,
        vocab_size=vocab_size,
        seed=seed,
        pretrain_steps=pretrain_steps,
        pretrain_lr=pretrain_lr,
        pretrain_on=pretrain_on,
        task_args=task_args,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def build_once(
    path: str | Path, write: Callable[[Path], None], complete: Callable[[Path], bool] = is_complete
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


# Qwen2.5-0.5B's shape (its config.json): 494M parameters, tied embeddings.
QWEN25_05B = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 4864,
    "vocab_rows": 151936,
    "tie_word_embeddings": True,
}


@MODELS.register("qwen2_5_0_5b_shape")
def qwen2_5_0_5b_shape(
    path: str | Path,
    *,
    corpus: Annotated[str, "task whose corpus() trains the tokenizer"] = "arithmetic",
    seed: Annotated[int, "initialisation seed"] = 0,
    num_layers: Annotated[int, "decoder layers (24 in the real model; fewer for tests)"] = 24,
    vocab_rows: Annotated[int, "embedding rows (151936 in the real model)"] = 151936,
) -> Path:
    """A randomly initialised model of Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 KV
    heads, MLP 4864, vocabulary 151936) with the task's tiny tokenizer: for memory and
    scale runs without a download. It has not learned anything."""
    shape = QWEN25_05B | {"num_layers": num_layers, "vocab_rows": vocab_rows}
    return tiny_qwen2(path, corpus=corpus, seed=seed, **shape)


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
def _build_lock(path: Path):
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
