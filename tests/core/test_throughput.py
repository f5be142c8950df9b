"""tokens/s and MFU: FLOPs per token from a config against hand counts, one step's figures
against the record they come from, and the metrics of a real run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from polyrl.core.loop import train
from polyrl.core.observe.throughput import Throughput, device_peak, model_flops
from polyrl.core.record import text_record
from polyrl.core.train.algorithms import AlgorithmConfig
from tests.helpers.runs import metrics
from tests.helpers.throughput import ONE_PASS, Cost, check_by_hand, linear_weights

DENSE = transformers.Qwen2Config(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=32,
)
MOE = transformers.Qwen3MoeConfig(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    moe_intermediate_size=6,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=32,
)


def test_dense_flops_count_every_projection_and_causal_attention():
    # per layer q 8x8, k 8x4, v 8x4, o 8x8 = 192; gated MLP 3 * 8x16 = 384; head 8x32 = 256
    cost = model_flops(DENSE)
    assert cost.matmul_params == 2 * (192 + 384) + 256 == 1408
    # the real model's projection weights (embedding aside) are the same count
    model = transformers.Qwen2ForCausalLM(DENSE)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == cost.matmul_params
    # a 3-token row: 2 * 1408 * 3 matmul FLOPs; attention 4 * t * (2 heads * 4) per layer for
    # t = 1, 2, 3 -> 4 * 6 * 8 * 2 layers = 384
    assert cost.forward(3) == 2 * 1408 * 3 + 384


def test_moe_flops_count_only_the_active_experts():
    # per layer attention 192; 2 of 4 experts, each 3 * 8x6 = 144; router 8x4 = 32
    cost = model_flops(MOE)
    assert cost.matmul_params == 2 * (192 + 2 * 144 + 32) + 256
    assert model_flops(SimpleNamespace(hidden_size=8)) is None  # not a decoder LM


def test_one_steps_figures_from_the_record():
    a, b = SimpleNamespace(model=SimpleNamespace(config=DENSE)), SimpleNamespace()
    record = text_record(
        prompt_ids=[[1, 2], [1, 2], [3, 4, 5], [6]],
        response_ids=[[7, 8, 9], [7], [8, 8], [9, 9, 9, 9]],
        rollout_logprobs=[[0.0] * 3, [0.0], [0.0] * 2, [0.0] * 4],
        policy=["a", "a", "a", "b"],
        uid=[0, 0, 1, 2],
        pad_id=0,
    )
    record["valid"] = torch.tensor([True, True, False, True])
    record["advantages"] = torch.tensor(  # row 1: no signal, the update leaves it out
        [[0.5, 0.5, 0.5, 0.0], [0.0] * 4, [1.0, 1.0, 0.0, 0.0], [1.0] * 4]
    )
    algo = AlgorithmConfig(ppo_epochs=2, kl_coef=0.1, skip_zero_advantage=True)
    perf = Throughput({"a": a, "b": b}, algo, peak=1e6)
    out = perf.step(record, step_s=2.0, update_s={"a": 0.5})
    # policy a: 3 + 1 + 2 response tokens; the update runs row 0 (2 + 3 tokens) twice
    assert out["perf/a/gen_tokens"] == 6 and out["perf/a/gen_tokens_per_s"] == 3.0
    assert out["perf/a/train_tokens"] == 10 and out["perf/a/train_tokens_per_s"] == 20.0
    assert out["perf/b/gen_tokens"] == 4 and "perf/b/train_tokens" not in out  # not trained
    assert out["perf/gen_tokens_per_s"] == 5.0 and out["perf/train_tokens_per_s"] == 20.0
    f = model_flops(DENSE).forward
    # training: 3 passes x 2 epochs over row 0; old log-probs (2 epochs) and reference
    # (KL) passes over both valid rows 0 and 1
    train_flops = 6 * f(5) + 2 * (f(5) + f(3))
    assert out["perf/a/mfu"] == pytest.approx(train_flops / (0.5 * 1e6))
    assert "perf/mfu" not in out  # b's model has no config: no overall FLOP count


def test_rows_of_no_policy_are_not_counted():
    # a joint-action row (marl) restates what the agents said: no engine sampled it
    a = SimpleNamespace(model=SimpleNamespace(config=DENSE))
    record = text_record(
        prompt_ids=[[1, 2], [3], [4, 5, 6]],
        response_ids=[[7, 8], [9, 9, 9], [8]],
        rollout_logprobs=[[0.0] * 2, [0.0] * 3, [0.0]],
        policy=["a", "a", "<joint>"],
        uid=[0, 0, 0],
        pad_id=0,
    )
    record["valid"] = torch.tensor([True, True, True])
    perf = Throughput({"a": a}, AlgorithmConfig(), peak=1e6)
    out = perf.step(record, step_s=2.0, update_s={"a": 1.0})
    assert not [k for k in out if "<joint>" in k]
    assert out["perf/a/gen_tokens"] == 5 and out["perf/gen_tokens_per_s"] == 2.5
    assert out["perf/a/train_tokens"] == 8  # (2 + 2) + (1 + 3), one epoch
    f = model_flops(DENSE).forward
    flops = 4 * (f(4) + f(4))  # one forward generating each row, three training it
    assert out["perf/tflops"] == pytest.approx(flops / 1e12)
    assert out["perf/mfu"] == pytest.approx(flops / (2.0 * 1e6))


def test_cpu_peak_is_measured_and_gpus_come_from_the_table():
    peak, where = device_peak("cpu")
    assert 1e6 < peak < 1e15 and "measured" in where
    if torch.cuda.is_available():
        assert "TFLOP/s" in device_peak("cuda")[1]


def test_a_runs_metrics_hold_tokens_per_second_and_mfu(make_config, tiny_model_dir, one_thread):
    run = train(make_config("train.steps=2", "run.export=false", *ONE_PASS))
    steps = [r for r in metrics(run.path) if "time/step_s" in r]
    assert len(steps) == 2
    # step 1 by hand: the model's weights from its modules, its width from its config
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = model.config
    cost = Cost(linear_weights(model), c.num_hidden_layers, c.num_attention_heads * c.head_dim)
    check_by_hand(run.path, {"main": cost})
    for r in steps:  # every step: the token count is the rollout's
        gen = r["perf/main/gen_tokens"]
        assert gen == pytest.approx(r["rollout/response_len"] * r["rollout/rows"])
        assert r["perf/main/train_tokens"] > 0 and 0 < r["perf/main/mfu"] < 1


def test_the_progress_line_shows_tokens_per_second_and_mfu(capsys):
    from polyrl.core.observe.progress import Progress

    with Progress(2) as bar:
        step = {"reward/mean": 0.5, "time/step_s": 1.5}
        bar.update(1, step | {"perf/gen_tokens_per_s": 1234.4, "perf/mfu": 0.0312})
        bar.update(2, step)  # a step without figures keeps the last ones shown
    assert capsys.readouterr().out.splitlines() == [
        "train 1/2  reward 0.500  acc nan  1234 tok/s  mfu 3.1%  1.50s/step",
        "train 2/2  reward 0.500  acc nan  1234 tok/s  mfu 3.1%  1.50s/step",
    ]
