"""Tiny offline Qwen2 builder and the arithmetic task."""

from __future__ import annotations

import json
import os

import pytest
import torch

from polyrl.core.demo.tiny import (
    CHAT_TEMPLATE,
    build_tiny_qwen2,
    build_tokenizer,
    is_complete,
    warm_start_texts,
)
from polyrl.core.registry import MODELS, TASKS
from polyrl.core.runner.builds import ensure_model
from polyrl.core.tasks import arithmetic


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(arithmetic.corpus())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny"
    return MODELS.get("tiny_qwen2")(path)


def test_registered():
    assert TASKS.get("arithmetic") is arithmetic
    assert callable(MODELS.get("tiny_qwen2"))


@pytest.mark.parametrize(
    "text", ["12+7=", "What is 3*14?", "19", "20-5=15", "What is 0+0?\n-3", "Hello, world! ~{x}"]
)
def test_tokenizer_round_trips(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_digits_and_operators_are_single_tokens(tok):
    for ch in "0123456789+-*=?":
        assert len(tok(ch, add_special_tokens=False)["input_ids"]) == 1, ch
    ids = tok("1234+56=", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "+", "5", "6", "="]


def test_special_tokens(tok):
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\n2+3=<|im_end|>\n"


def test_forward_and_shapes(tok):
    model = build_tiny_qwen2(tok)
    assert model.config.vocab_size == len(tok)
    assert model.config.head_dim == 64
    assert model.model.layers[0].self_attn.q_proj.out_features == 64
    assert model.dtype == torch.float32
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    batch = tok(["1+2=", "What is 13*4?"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_head_dim_independent_of_hidden_size(tok):
    model = build_tiny_qwen2(tok, hidden_size=32, num_heads=2, num_kv_heads=1)
    assert model.config.head_dim == 64
    assert model.model.layers[0].self_attn.q_proj.out_features == 128
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_init_is_deterministic(tok):
    rng_before = torch.get_rng_state()
    a, b, c = (build_tiny_qwen2(tok, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_builder_is_atomic_and_idempotent(built):
    assert is_complete(built)
    siblings = [p.name for p in built.parent.iterdir()]
    assert siblings == ["tiny"]  # temp dir renamed away, nothing left behind
    mtimes = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    again = MODELS.get("tiny_qwen2")(built, seed=1)
    assert again == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == mtimes


def test_builder_refuses_partial_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        MODELS.get("tiny_qwen2")(tmp_path / "m")


def test_builds_are_bitwise_identical(built, tmp_path):
    other = MODELS.get("tiny_qwen2")(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (other / name).read_bytes() == (built / name).read_bytes(), name


def test_reload_with_auto_classes(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    fresh = build_tokenizer(arithmetic.corpus())
    text = "<|im_start|>user\nWhat is 7*8?<|im_end|>\n"
    assert tok(text)["input_ids"] == fresh(text)["input_ids"]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.vocab_size == len(tok) and model.config.head_dim == 64
    assert model.generation_config.eos_token_id[0] == tok.eos_token_id
    out = model.generate(**tok(["1+1="], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= 4 + 3


def test_ensure_model(built, tmp_path, monkeypatch):
    assert ensure_model("Qwen/Qwen2.5-0.5B", None, {}) == "Qwen/Qwen2.5-0.5B"
    assert ensure_model(built, "tiny_qwen2", {}) == str(built)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = ensure_model("~/m", "tiny_qwen2", {"num_layers": 1})
    assert path == str(tmp_path / "m") and is_complete(path)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.parametrize("ops", ["+", "+-*"])
def test_rows_answers_correct(ops):
    rows = arithmetic.make_rows(200, seed=3, max_operand=20, ops=ops)
    assert len(rows) == 200 and len({r["uid"] for r in rows}) == 200
    for r in rows:
        assert r["prompt"] == r["uid"] + "="
        assert r["answer"] == str(eval(r["uid"]))
        assert int(r["answer"]) >= 0
    assert {r["uid"][len(r["uid"].rstrip("0123456789")) - 1] for r in rows} <= set(ops)
    assert rows == arithmetic.make_rows(200, seed=3, max_operand=20, ops=ops)
    assert rows != arithmetic.make_rows(200, seed=4, max_operand=20, ops=ops)


def test_question_style_and_sft_rows():
    rows = arithmetic.make_rows(5, seed=0, style="question")
    assert all(r["prompt"] == f"What is {r['uid']}?" for r in rows)
    sft = arithmetic.sft_rows(rows)
    assert sft == [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]


def test_write_dataset_disjoint(tmp_path):
    train_path, eval_path = arithmetic.write_dataset(
        tmp_path, seed=0, n_train=1000, n_eval=50, max_operand=20
    )
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    held = [json.loads(line) for line in eval_path.read_text().splitlines()]
    assert len(train) == 1000 and len(held) == 50  # train repeats: only 441 - 50 problems
    assert len({r["uid"] for r in held}) == 50
    assert not {r["uid"] for r in train} & {r["uid"] for r in held}
    assert all(r["answer"] == str(eval(r["uid"])) for r in train + held)
    assert sorted(os.listdir(tmp_path)) == ["eval.jsonl", "train.jsonl"]
    with pytest.raises(ValueError):
        arithmetic.write_dataset(tmp_path, seed=0, n_train=10, n_eval=441, max_operand=20)


def test_corpus_covers_task_text(tok):
    rows = arithmetic.make_rows(100, seed=1, ops="+-*") + arithmetic.make_rows(
        100, seed=1, ops="+-*", style="question"
    )
    chars = set("".join(arithmetic.corpus()))
    for r in rows:
        assert set(r["prompt"] + r["answer"]) <= chars
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        assert len(ids) <= 10 and tok.decode(ids) == r["prompt"]


def corpus_nll(path, texts=None) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    losses = []
    with torch.no_grad():
        for text in (texts or arithmetic.corpus())[:16]:
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    return sum(losses) / len(losses)


def test_pretrained_build_knows_its_corpus_and_is_deterministic(built, tmp_path):
    first = MODELS.get("tiny_qwen2")(tmp_path / "pt", pretrain_steps=30, pretrain_lr=3e-3)
    again = MODELS.get("tiny_qwen2")(tmp_path / "pt2", pretrain_steps=30, pretrain_lr=3e-3)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    before, after = corpus_nll(built), corpus_nll(first)
    assert after < before - 1.0, (before, after)


def test_warm_start_texts_are_the_tasks_sft_conversations(tok):
    texts = warm_start_texts("arithmetic", tok, seed=0, task_args={"n_train": 20, "n_eval": 5})
    rows = arithmetic.sft_rows(arithmetic.make_rows(20, seed=0))
    assert len(texts) == len(rows) == 20
    for text in texts:
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n")
        assert "<|im_start|>assistant\n" in text


@pytest.mark.learning
def test_pretrain_on_sft_learns_the_warm_start_and_keeps_the_corpus_tokenizer(built, tmp_path):
    args = {"n_train": 200, "n_eval": 20}
    path = MODELS.get("tiny_qwen2")(
        tmp_path / "sft", pretrain_steps=30, pretrain_lr=3e-3, pretrain_on="sft", task_args=args
    )
    assert (path / "tokenizer.json").read_text() == (built / "tokenizer.json").read_text()
    from transformers import AutoTokenizer

    texts = warm_start_texts("arithmetic", AutoTokenizer.from_pretrained(path), 0, args)
    before, after = corpus_nll(built, texts), corpus_nll(path, texts)
    assert after < before - 1.0, (before, after)


def test_unknown_pretrain_source_fails_before_building(tmp_path):
    with pytest.raises(ValueError, match="pretrain_on must be"):
        MODELS.get("tiny_qwen2")(tmp_path / "x", pretrain_steps=1, pretrain_on="books")
    assert not (tmp_path / "x").exists()
