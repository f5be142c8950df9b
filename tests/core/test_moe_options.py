"""``policies.<n>.moe`` options on every policy kind (issue 39): honoured where the kind's
passes route experts, else refused through the CLI with exit status 2 and one error line
that names the key and the fix. Kinds whose passes never route experts (qwen_vl's own
pass, diffusion) are refused at config time, before any model loads; causal_lm and
lora_agent are refused once the model shows it has no expert routers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.runner.cli import main
from polyrl.core.train.algorithms import AggInfo

# the model does not exist: a case that got past the recipe would fail on it instead
RECIPE = {"policies": {"main": {"model": "no/such-model"}}, "train": {"steps": 3}}
# a task whose data is made on the spot, for the cases that get as far as loading a model
TASK = ["task.name=arithmetic", "task.args={n_train: 8, n_eval: 4, max_operand: 9, ops: '+'}"]
ASKS = ["policies.main.moe.replay=rollout", "policies.main.moe.aux_loss_coef=0.01"]


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ would appear here
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


def error_line(capsys, argv: list[str]) -> str:
    """``polyrl argv`` exits 2 with one error line and no traceback; that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


@pytest.mark.parametrize("ask", ASKS)
@pytest.mark.parametrize("kind", ["diffusion", "qwen_vl"])
def test_kinds_without_routed_passes_refuse_moe_before_loading(recipe, capsys, kind, ask):
    """The model does not exist: only a config-time refusal gives this error."""
    err = error_line(capsys, ["train", str(recipe), f"policies.main.kind={kind}", ask])
    for needle in ("policies.main.moe", f"the {kind} policy kind", "remove the moe options"):
        assert needle in err, err
    assert str(recipe) in err and not Path("runs").exists()


@pytest.mark.parametrize("ask", ASKS)
@pytest.mark.parametrize("kind", ["causal_lm", "lora_agent"])
def test_routed_kinds_refuse_moe_on_a_dense_model(recipe, tiny_model_dir, capsys, kind, ask):
    """The tiny dense Qwen2 has no top-k routers: the options cannot be honoured."""
    argv = ["train", str(recipe), f"policies.main.model={tiny_model_dir}", ask]
    argv += [f"policies.main.kind={kind}", "policies.main.lora.r=4", "run.progress=false", *TASK]
    err = error_line(capsys, argv)
    for needle in ("policies.main.moe", "not a mixture-of-experts model", "remove the moe"):
        assert needle in err, err


def test_replay_with_gradient_checkpointing_is_refused(recipe, tmp_path, capsys):
    """An MoE model honours replay, but not with a recompute that would route freely."""
    from polyrl.core.demo.tiny import tiny_qwen3_moe

    model = tiny_qwen3_moe(tmp_path / "moe", num_experts=4, experts_per_token=2, num_layers=2)
    argv = ["train", str(recipe), f"policies.main.model={model}", ASKS[0]]
    argv += ["policies.main.gradient_checkpointing=true", "run.progress=false", *TASK]
    err = error_line(capsys, argv)
    assert "moe.replay with gradient_checkpointing" in err and "turn one of them off" in err


@pytest.mark.parametrize("kind", ["causal_lm", "lora_agent"])
def test_routed_kinds_honour_moe_on_an_moe_model(tmp_path, kind):
    """The same options on an MoE model: the policy routes (its passes replay and return
    their routing, which the load-balancing loss reads)."""
    from polyrl.core.demo.tiny import tiny_qwen3_moe
    from polyrl.core.record import Row, build_rows
    from polyrl.core.registry import POLICIES
    from polyrl.core.rollout.engine import HFEngine, SamplingParams
    from polyrl.core.train.moe import MoeConfig
    from polyrl.core.train.policy import PolicyConfig
    from tests.helpers.trainer import chat_ids

    model = tiny_qwen3_moe(tmp_path / "moe", num_experts=4, experts_per_token=2, num_layers=2)
    cfg = PolicyConfig(model=str(model), kind=kind, moe=MoeConfig("rollout", 0.01))
    cfg.lora.r = 4 if kind == "lora_agent" else 0
    policy = POLICIES.get(kind)("main", cfg, total_steps=1, need_reference=False)
    assert policy.is_moe
    ids = chat_ids(policy.tokenizer)
    outs = HFEngine(policy, seed=0).generate(ids, SamplingParams(n=2, max_new_tokens=4))
    rows = [Row(o.prompt, o.tokens, "main", o.prompt_index) for o in outs]
    batch = build_rows(rows, policy.tokenizer.pad_token_id)
    assert "response_experts" in batch.keys()  # noqa: SIM118 (TensorDict)
    routed = policy.routed_logprobs(batch)
    assert routed.router is not None and routed.router.keep_logits
    metrics: dict = {}
    loss = policy.router_loss(routed.router, batch, AggInfo(), metrics)
    assert metrics["moe/route_mismatch"] == [0.0]  # the engine's own experts, replayed
    assert float(loss.detach()) > 0 and metrics["moe/aux_loss"][0] > 0
