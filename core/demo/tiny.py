"""Tiny Qwen2 (and Qwen3-MoE) models built offline, for tests and CPU demos.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a task's corpus and a small
Qwen2 is initialised from a seed. Both save as an ordinary Hugging Face checkpoint, so every
engine (HF, vLLM) loads them exactly as it would a real Qwen2.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import polyrl.core.tasks  # noqa: F401  (registers the tasks whose corpora we train on)
from polyrl.core.config import doc
from polyrl.core.interfaces import HasCorpus, HasSFTRows
from polyrl.core.options import Options
from polyrl.core.registry import MODELS, TASKS
from polyrl.core.runner.builds import build_once

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


@dataclass
class TextSizes(Options):
    """The sizes every tiny text model shares (this module's decoders and the Qwen-VL
    families' language model), and the seed its weights are drawn from."""

    hidden_size: int = doc(64, "model width")
    num_layers: int = doc(2, "decoder layers")
    num_heads: int = doc(1, "attention heads")
    max_position_embeddings: int = doc(512, "longest sequence")
    tie_word_embeddings: bool = doc(True, "share input and output embeddings")
    seed: int = doc(0, "initialisation and pretraining seed")


@dataclass
class DecoderSizes(TextSizes):
    """What a tiny decoder adds, dense or mixture-of-experts: its key/value heads' count and
    width."""

    num_kv_heads: int = doc(1, "key/value heads")
    head_dim: int = doc(64, "per-head width (vLLM's CPU kernel needs 64)")


@dataclass
class Qwen2Sizes(DecoderSizes):
    """A tiny dense Qwen2's sizes (:func:`build_tiny_qwen2`)."""

    intermediate_size: int = doc(256, "MLP width")
    vocab_rows: int = doc(0, "embedding rows (0: the tokenizer's size; more pads it)")


def build_tiny_qwen2(tokenizer: Qwen2Tokenizer, **sizes: Any) -> Qwen2ForCausalLM:
    """A float32 Qwen2 sized to ``tokenizer`` (``sizes``: :class:`Qwen2Sizes`),
    initialised deterministically from its ``seed``.

    ``head_dim`` is written to the config explicitly (default 64) because vLLM's CPU
    attention kernel rejects smaller heads; it need not equal hidden_size / num_heads.
    ``vocab_rows`` (0: the tokenizer's size) pads the embedding to a real model's vocabulary
    (rows the tokenizer never emits), so the model has that model's shape and memory.
    The global torch RNG is left as it was.
    """
    s = Qwen2Sizes(**sizes)
    if s.vocab_rows and s.vocab_rows < len(tokenizer):
        raise ValueError(f"vocab_rows={s.vocab_rows} is below the tokenizer's {len(tokenizer)}")
    rows = s.vocab_rows or len(tokenizer)
    return _decoder(
        "Qwen2", tokenizer, rows, s, s.intermediate_size, max_window_layers=s.num_layers
    )


@dataclass
class Qwen3MoeSizes(DecoderSizes):
    """A tiny Qwen3-MoE's sizes (:func:`build_tiny_qwen3_moe`); each layer is a sparse MoE
    block."""

    num_experts: int = doc(4, "experts per layer")
    experts_per_token: int = doc(2, "experts each token is routed to (top-k)")
    moe_intermediate_size: int = doc(64, "each expert's MLP width")
    norm_topk_prob: bool = doc(True, "renormalise the chosen experts' weights to sum 1")


def build_tiny_qwen3_moe(tokenizer: Qwen2Tokenizer, **sizes: Any) -> Any:
    """A float32 Qwen3-MoE (every layer a sparse MoE block: ``num_experts`` experts, top-
    ``experts_per_token`` routing) sized to ``tokenizer`` (``sizes``:
    :class:`Qwen3MoeSizes`), initialised from its ``seed``.

    The architecture of Qwen3-30B-A3B at toy size, so every engine loads it as that family
    (``Qwen3MoeForCausalLM``); its routers are ``Qwen3MoeTopKRouter`` modules, which
    :mod:`polyrl.core.train.moe` hooks. ``norm_topk_prob`` renormalises the chosen experts'
    weights to sum to 1, as Qwen3-30B-A3B does. The global torch RNG is left as it was.
    """
    s = Qwen3MoeSizes(**sizes)
    if not 1 <= s.experts_per_token <= s.num_experts:
        raise ValueError(
            f"experts_per_token={s.experts_per_token} must be between 1 and "
            f"num_experts={s.num_experts}"
        )
    return _decoder(
        "Qwen3Moe",
        tokenizer,
        len(tokenizer),
        s,
        s.moe_intermediate_size,
        num_experts=s.num_experts,
        num_experts_per_tok=s.experts_per_token,
        moe_intermediate_size=s.moe_intermediate_size,
        norm_topk_prob=s.norm_topk_prob,
        decoder_sparse_step=1,
    )


def _decoder(
    family: str,
    tokenizer: Qwen2Tokenizer,
    vocab_size: int,
    s: DecoderSizes,
    intermediate_size: int,
    **settings: Any,
) -> Any:
    """transformers' ``<family>ForCausalLM`` in float32 with ``vocab_size`` embedding rows,
    the sizes ``s``, the tokenizer's pad and end tokens, and the family's other config
    ``settings``; initialised from ``s.seed``."""
    import transformers

    if s.num_heads % s.num_kv_heads:
        raise ValueError(
            f"num_heads={s.num_heads} must be a multiple of num_kv_heads={s.num_kv_heads}"
        )
    # one token in, one id out (transformers types the result int | list[int])
    pad_id: int = tokenizer.convert_tokens_to_ids(PAD_TOKEN)  # type: ignore[assignment]
    eos_id: int = tokenizer.convert_tokens_to_ids(EOS_TOKEN)  # type: ignore[assignment]
    text = text_config(vocab_size, s, intermediate_size, pad_id=pad_id, eos_id=eos_id)
    config = getattr(transformers, f"{family}Config")(
        **text,
        head_dim=s.head_dim,
        tie_word_embeddings=s.tie_word_embeddings,
        **settings,
        dtype="float32",
    )
    model = getattr(transformers, f"{family}ForCausalLM")
    return seeded_model(model, config, s.seed, pad_id=pad_id, eos_ids=[eos_id, pad_id])


def text_config(
    vocab_size: int, sizes: Options, intermediate_size: int, *, pad_id: int, eos_id: int
) -> dict[str, Any]:
    """The Qwen2-style text config fields every tiny builder sets (this module's decoders and
    the Qwen-VL families' language model): the ``sizes`` (``hidden_size``, ``num_layers``,
    ``num_heads``, ``num_kv_heads`` (default: ``num_heads``), ``max_position_embeddings``),
    and the pad token as bos and pad."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": sizes["hidden_size"],
        "intermediate_size": intermediate_size,
        "num_hidden_layers": sizes["num_layers"],
        "num_attention_heads": sizes["num_heads"],
        "num_key_value_heads": sizes.get("num_kv_heads", sizes["num_heads"]),
        "max_position_embeddings": sizes["max_position_embeddings"],
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


def corpus(task_name: str) -> list[str]:
    """The texts task ``task_name`` offers to train a tiny tokenizer and model on."""
    task = TASKS.get(task_name)
    if not isinstance(task, HasCorpus):
        raise ValueError(f"task {task_name!r} has no corpus() to train a tiny model on")
    return task.corpus()


def warm_start_texts(
    task_name: str, tokenizer: Any, seed: int, task_args: dict | None = None
) -> list[str]:
    """A task's format warm-start conversations (its ``sft_rows`` over a train set it writes
    with ``seed``), rendered with the chat template: what a model that has seen the task
    knows -- its answer formats and, for tasks whose rows carry them, arbitrary habits."""
    import tempfile

    from polyrl.core.rollout.data import load_rows

    task = TASKS.get(task_name)
    with tempfile.TemporaryDirectory() as tmp:
        train_path, _ = task.write_dataset(tmp, seed=seed, **(task_args or {}))
        rows = load_rows(str(train_path))[0]
    if not isinstance(task, HasSFTRows):
        raise ValueError(f"task {task_name!r} has no sft_rows() to make warm-start texts from")
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


@dataclass
class TinyTextBuild(Options):
    """``build_args`` that make a tiny text model's tokenizer and pretrain it."""

    corpus: str = doc("arithmetic", "task whose corpus() trains the tokenizer (and pretraining)")
    vocab_size: int = doc(128, "BPE vocabulary size of the tokenizer")
    pretrain_steps: int = doc(0, "next-token steps on the corpus (0: random init)")
    pretrain_lr: float = doc(1e-3, "AdamW learning rate of pretraining")
    pretrain_on: Literal["corpus", "sft"] = doc(
        "corpus", "corpus, or sft: the task's format warm start"
    )
    task_args: dict | None = doc(None, "the task's options, for pretrain_on: sft")


@dataclass
class TinyQwen2Options(Qwen2Sizes, TinyTextBuild):
    """``build_args`` of ``tiny_qwen2``."""


@dataclass
class TinyQwen3MoeOptions(Qwen3MoeSizes, TinyTextBuild):
    """``build_args`` of ``tiny_qwen3_moe``."""


@MODELS.register("tiny_qwen2", options=TinyQwen2Options)
def tiny_qwen2(path: str | Path, **options: Any) -> Path:
    """Build a tiny Qwen2 + tokenizer at ``path`` (once), trained on task ``corpus``'s texts;
    ``options`` are :class:`TinyQwen2Options`.

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
    already at ``path`` is returned untouched (recipes build through
    :func:`polyrl.core.runner.builds.ensure_model`, which first checks the directory's build record).
    """
    return _write_tiny(path, build_tiny_qwen2, TinyQwen2Options(**options))


@MODELS.register("tiny_qwen3_moe", options=TinyQwen3MoeOptions)
def tiny_qwen3_moe(path: str | Path, **options: Any) -> Path:
    """Build a tiny Qwen3-MoE + tokenizer at ``path`` (once): :func:`tiny_qwen2`'s
    tokenizer and pretraining (the same corpus gives the same tokenizer, token for token),
    with a mixture-of-experts model (:func:`build_tiny_qwen3_moe`) in place of the dense one;
    ``options`` are :class:`TinyQwen3MoeOptions`.
    """
    return _write_tiny(path, build_tiny_qwen3_moe, TinyQwen3MoeOptions(**options))


def _write_tiny(
    path: str | Path,
    build_model: Callable[..., Any],
    options: TinyQwen2Options | TinyQwen3MoeOptions,
) -> Path:
    """What the registered tiny builders share: ``corpus``'s tokenizer, the model
    ``build_model(tokenizer, **sizes)`` makes for it (every option not in
    :class:`TinyTextBuild`),
    optionally pretrained (see :func:`tiny_qwen2`), written once at ``path``."""
    o = options
    if o.pretrain_on not in ("corpus", "sft"):
        raise ValueError(f"pretrain_on must be 'corpus' or 'sft', got {o.pretrain_on!r}")
    build = {f.name for f in dataclasses.fields(TinyTextBuild)}
    sizes = {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name not in build}

    def write(tmp: Path) -> None:
        tokenizer = build_tokenizer(corpus(o.corpus), vocab_size=o.vocab_size)
        model = build_model(tokenizer, **sizes)
        if o.pretrain_steps:
            texts = (
                corpus(o.corpus)
                if o.pretrain_on == "corpus"
                else warm_start_texts(o.corpus, tokenizer, o.seed, o.task_args)
            )
            pretrain(model, tokenizer, texts, o.pretrain_steps, o.pretrain_lr, o.seed)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_once(path, write, is_complete)


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
