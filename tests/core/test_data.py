"""Prompt data layer: loading, validation errors, overlong filtering, deterministic sampling."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from polyrl.core.rollout.data import (
    DataConfig,
    DataError,
    PromptDataset,
    PromptItem,
    PromptSampler,
    check_paths,
    write_jsonl,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE chat tokenizer trained offline on a few sentences."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "what is two plus two?",
        "the answer is four.",
        "you are a helpful assistant",
        "hello world, user and system",
    ] * 4
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def rows(n: int) -> list[dict]:
    return [{"prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(n)]


def cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **kw)


# --------------------------------------------------------------------------- loading


def test_jsonl_loads(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows(5))
    ds = PromptDataset(cfg(path), tokenizer)
    assert len(ds) == 5 and ds.stats == {"rows": 5, "kept": 5, "filtered_overlong": 0}
    item = ds[2]
    assert isinstance(item, PromptItem)
    assert item.uid == 2 and item.answer == "4" and item.row == rows(5)[2]
    assert (
        item.prompt_text == "<|im_start|>user\nwhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert item.prompt_ids == tokenizer(item.prompt_text, add_special_tokens=False)["input_ids"]
    assert item.prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(item.prompt_ids) == item.prompt_text


def test_json_array_loads(tmp_path, tokenizer):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(rows(3)))
    assert [it.answer for it in PromptDataset(cfg(path), tokenizer)] == ["0", "2", "4"]


def test_csv_loads(tmp_path, tokenizer):
    path = tmp_path / "train.csv"
    pd.DataFrame(rows(4)).to_csv(path, index=False)
    ds = PromptDataset(cfg(path), tokenizer)
    assert len(ds) == 4 and "what is 3 plus 3?" in ds[3].prompt_text


def test_parquet_loads_with_chat_messages(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    data = [
        {"messages": [{"role": "user", "content": f"hello {i}"}], "answer": i} for i in range(3)
    ]
    pd.DataFrame(data).to_parquet(path)
    ds = PromptDataset(cfg(path, prompt_field="messages"), tokenizer)
    assert len(ds) == 3 and ds[1].answer == 1
    assert ds[1].prompt_text == "<|im_start|>user\nhello 1<|im_end|>\n<|im_start|>assistant\n"


def test_chat_messages_prompt(tmp_path, tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": msgs, "answer": "x"}])
    ds = PromptDataset(cfg(path, system_prompt="ignored: row has its own"), tokenizer)
    assert ds[0].prompt_text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_system_prompt_applied(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    ds = PromptDataset(cfg(path, system_prompt="you are a helpful assistant"), tokenizer)
    assert ds[0].prompt_text.startswith(
        "<|im_start|>system\nyou are a helpful assistant<|im_end|>\n<|im_start|>user\n"
    )


def test_raw_text_without_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(1))
    ds = PromptDataset(cfg(path, chat_template=False, system_prompt="sys"), tokenizer)
    assert ds[0].prompt_text == "sys\n\nwhat is 0 plus 0?"
    assert "<|im_start|>" not in tokenizer.decode(ds[0].prompt_ids)


def test_no_answer_field_and_limit(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    ds = PromptDataset(cfg(path, answer_field=None, limit=4), tokenizer)
    assert len(ds) == 4 and ds.stats["rows"] == 4 and ds[0].answer is None


def test_write_jsonl_is_atomic_and_roundtrips(tmp_path):
    path = write_jsonl(tmp_path / "sub" / "x.jsonl", rows(3))
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows(3)
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


# --------------------------------------------------------------------------- errors


def test_check_paths_finds_a_missing_file_without_a_tokenizer(tmp_path):
    """What a run checks before any model builds: paths only, so no tokenizer is needed."""
    write_jsonl(tmp_path / "train.jsonl", rows(1))
    fine = [
        ("train", cfg(tmp_path / "train.jsonl")),
        ("eval", DataConfig()),  # empty: a task fills it, or no evaluation
        ("sft", DataConfig(path="openai/gsm8k")),  # a hub name: read (and checked) later
    ]
    check_paths(fine)
    with pytest.raises(DataError) as e:
        check_paths([*fine, ("eval", cfg(tmp_path / "eval.jsnl"))])
    msg = str(e.value)
    assert msg.startswith("eval data: ") and str(tmp_path / "eval.jsnl") in msg
    assert "does not exist" in msg and "train.jsonl" in msg  # the file there, as a hint


def test_missing_file_names_path_and_neighbours(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", rows(1))
    missing = tmp_path / "trian.jsonl"
    with pytest.raises(DataError) as e:
        PromptDataset(cfg(missing), tokenizer)
    msg = str(e.value)
    assert str(missing) in msg and "does not exist" in msg
    assert "train.jsonl" in msg  # the nearby file, as a hint


def test_unknown_extension(tmp_path, tokenizer):
    path = tmp_path / "train.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"unsupported extension '\.txt'"):
        PromptDataset(cfg(path), tokenizer)


def test_missing_prompt_field_names_file_row_field_and_hint(tmp_path, tokenizer):
    data = rows(3)
    data[1] = {"promt": "typo", "answer": "1"}
    path = write_jsonl(tmp_path / "d.jsonl", data)
    with pytest.raises(DataError) as e:
        PromptDataset(cfg(path), tokenizer)
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg and "'prompt'" in msg
    assert "'promt'" in msg and "Did you mean 'promt'" in msg


def test_missing_prompt_field_in_csv_names_row(tmp_path, tokenizer):
    path = tmp_path / "d.csv"
    pd.DataFrame({"question": ["a"], "answer": ["b"]}).to_csv(path, index=False)
    with pytest.raises(DataError, match=r"row 0.*no field 'prompt'.*'question'"):
        PromptDataset(cfg(path), tokenizer)


def test_missing_answer_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answr": "1"}])
    with pytest.raises(DataError, match=r"line 1.*no field 'answer'.*Did you mean 'answr'"):
        PromptDataset(cfg(path), tokenizer)


@pytest.mark.parametrize("bad", ["", "   \n", None])
def test_empty_prompt(tmp_path, tokenizer, bad):
    path = write_jsonl(tmp_path / "d.jsonl", [*rows(2), {"prompt": bad, "answer": "1"}])
    with pytest.raises(DataError, match=r"line 3: field 'prompt' is empty"):
        PromptDataset(cfg(path), tokenizer)


def test_non_string_prompt(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 42, "answer": "1"}])
    with pytest.raises(DataError, match=r"line 1: field 'prompt' is a int"):
        PromptDataset(cfg(path), tokenizer)


def test_bad_chat_message(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"text": "hi"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"line 1: field 'prompt', message 0"):
        PromptDataset(cfg(path), tokenizer)


def test_malformed_json_line_names_line(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in rows(3)]
    lines.insert(2, '{"prompt": "oops", "answer": ')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl, line 3: malformed JSON"):
        PromptDataset(cfg(path), tokenizer)


def test_overlong_filtered_and_counted(tmp_path, tokenizer):
    data = rows(4)
    data[1]["prompt"] = "two plus two " * 200
    data[3]["prompt"] = "four " * 300
    path = write_jsonl(tmp_path / "d.jsonl", data)
    ds = PromptDataset(cfg(path, max_prompt_tokens=64), tokenizer)
    assert ds.stats == {"rows": 4, "kept": 2, "filtered_overlong": 2}
    assert [it.uid for it in ds] == [0, 2]  # uids stay the source row indices
    assert all(len(it.prompt_ids) <= 64 for it in ds)


def test_overlong_error_names_row_and_length(tmp_path, tokenizer):
    data = rows(3)
    data[2]["prompt"] = "two plus two " * 200
    path = write_jsonl(tmp_path / "d.jsonl", data)
    with pytest.raises(DataError, match=r"line 3: prompt is \d+ tokens.*max_prompt_tokens=64"):
        PromptDataset(cfg(path, max_prompt_tokens=64, overlong="error"), tokenizer)


def test_all_rows_filtered_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    with pytest.raises(DataError, match="all 3 prompts"):
        PromptDataset(cfg(path, max_prompt_tokens=2), tokenizer)


# --------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def items() -> list[PromptItem]:
    return [
        PromptItem(uid=i, prompt_ids=[i], prompt_text=str(i), answer=None, row={})
        for i in range(10)
    ]


def uids(batches: list[list[PromptItem]]) -> list[list[int]]:
    return [[it.uid for it in b] for b in batches]


def take(sampler: PromptSampler, k: int) -> list[list[int]]:
    return uids([sampler.next_batch() for _ in range(k)])


def test_sampler_deterministic_by_seed(items):
    assert take(PromptSampler(items, 4, seed=1), 6) == take(PromptSampler(items, 4, seed=1), 6)
    assert take(PromptSampler(items, 4, seed=1), 6) != take(PromptSampler(items, 4, seed=2), 6)


def test_sampler_epochs_are_permutations(items):
    sampler = PromptSampler(items, batch_size=5, seed=0)
    flat = [u for b in take(sampler, 6) for u in b]  # exactly three epochs
    epochs = [flat[i : i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert sampler.epoch == 2


def test_sampler_crosses_epoch_boundary(items):
    sampler = PromptSampler(items, batch_size=4, seed=3)
    flat = [u for b in take(sampler, 5) for u in b]  # 20 items: two full epochs
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert sampler.state_dict() == {"epoch": 1, "position": 10}


def test_sampler_without_shuffle_is_in_order(items):
    assert take(PromptSampler(items, 4, seed=0, shuffle=False), 3) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])  # 3 batches of 4 ends mid-epoch-1
def test_sampler_resume_matches_uninterrupted(items, k):
    full = take(PromptSampler(items, 4, seed=7), k + 6)
    first = PromptSampler(items, 4, seed=7)
    take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round-trip
    resumed = PromptSampler(items, 4, seed=7)
    resumed.load_state_dict(state)
    assert resumed.epoch == first.epoch
    assert take(resumed, 6) == full[k:]


def test_sampler_over_a_dataset(tmp_path, tokenizer):
    ds = PromptDataset(cfg(write_jsonl(tmp_path / "d.jsonl", rows(7))), tokenizer)
    batch = PromptSampler(ds, batch_size=3, seed=0).next_batch()
    assert len(batch) == 3 and all(isinstance(it, PromptItem) for it in batch)
