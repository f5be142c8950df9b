"""tokens/s and MFU of the signaling demo: each agent's policy, the step's total, and no
figures for the joint-action rows (their text is the agents', sampled once); one step
against the hand count."""

from __future__ import annotations

import transformers

from polyrl.core.loop import train
from tests.helpers.throughput import ONE_PASS, Cost, check_by_hand, linear_weights


def test_a_signaling_runs_metrics_hold_each_agents_tokens_and_the_steps_mfu(
    marl_config, signaling_model_dir
):
    run = train(marl_config("eval.every=0", "train.steps=1", "run.export=false", *ONE_PASS))
    # both agents sample with the same tiny model: its weights from its modules, its
    # width from its config
    model = transformers.AutoModelForCausalLM.from_pretrained(signaling_model_dir)
    c = model.config
    heads = c.num_attention_heads
    width = heads * (getattr(c, "head_dim", None) or c.hidden_size // heads)
    cost = Cost(linear_weights(model), c.num_hidden_layers, width)
    step = check_by_hand(run.path, {"speaker": cost, "listener": cost})
    perf = {k: v for k, v in step.items() if k.startswith("perf/")}
    assert not [k for k in perf if "<joint>" in k]
    for name in ("speaker", "listener"):
        assert perf[f"perf/{name}/gen_tokens"] > 0 and perf[f"perf/{name}/train_tokens"] > 0
        assert 0 < perf[f"perf/{name}/mfu"] < 1
