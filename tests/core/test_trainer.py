"""The update step: exact on-policy ratio, loss masks, per-policy isolation, NaN guard."""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.core.record import concat, select_policy, strings, text_record
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import group_credit
from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig
from polyrl.core.train.trainer import sft_update, update
from tests.helpers.trainer import grads_at_step, make_policy, sampled_record


def weights(policy):
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_recomputed_old_logprobs_give_ratio_exactly_one(tiny_model_dir):
    """The no-grad pass (old log-probs) and the grad pass agree bitwise before any update."""
    policy = make_policy(tiny_model_dir)
    rec = sampled_record(policy)
    with torch.no_grad():
        old, _ = policy.logprobs(rec)
    new, _ = policy.logprobs(rec)
    ratio = torch.exp(new - old)
    m = rec["loss_mask"].bool()
    assert torch.equal(ratio[m], torch.ones_like(ratio[m]))


@pytest.mark.parametrize("epochs,minibatches", [(1, 1), (2, 1), (1, 2)])
def test_first_update_is_on_policy(tiny_model_dir, epochs, minibatches):
    policy = make_policy(tiny_model_dir)
    algo = AlgorithmConfig(ppo_epochs=epochs, minibatches=minibatches)
    out = update(policy, sampled_record(policy), algo, generator=torch.Generator().manual_seed(0))
    if epochs == 1 and minibatches == 1:
        assert out["ppo_kl"] == 0.0 and out["pg_clipfrac"] == 0.0
    assert out["skipped_nonfinite"] == 0 and out["grad_norm"] > 0


def test_masked_tokens_do_not_move_the_weights(tiny_model_dir):
    """Tokens outside loss_mask (environment/tool/other-agent text) carry no gradient."""
    base = make_policy(tiny_model_dir)
    rec = sampled_record(base)
    # Mask the middle of every response as if a tool had written it.
    mask = rec["loss_mask"].clone()
    mask[:, 1:3] = 0
    rec["loss_mask"] = mask
    group_credit(rec, AlgorithmConfig())
    poisoned = rec.clone()
    adv = poisoned["advantages"].clone()
    adv[:, 1:3] = 1e6  # would dominate the update if these tokens were trained on
    poisoned["advantages"] = adv
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    update(a, rec, AlgorithmConfig())
    update(b, poisoned, AlgorithmConfig())
    assert same(weights(a), weights(b))
    assert not same(weights(a), weights(base))


def test_micro_batching_matches_one_big_batch(tiny_model_dir):
    """No clipping (it would hide a wrongly scaled gradient): the same gradient either way."""
    rec = sampled_record(make_policy(tiny_model_dir))
    big = make_policy(tiny_model_dir, micro=64, max_grad_norm=0.0)
    small = make_policy(tiny_model_dir, micro=3, max_grad_norm=0.0)
    gb, gs = grads_at_step(big), grads_at_step(small)
    update(big, rec.clone(), AlgorithmConfig())
    update(small, rec.clone(), AlgorithmConfig())
    assert len(gb) == len(gs) == 1
    assert all(
        torch.allclose(a, b, atol=1e-7, rtol=1e-4) for a, b in zip(gb[0], gs[0], strict=True)
    )


@pytest.mark.parametrize("loss_agg,minibatches", [("token-mean", 1), ("seq-mean-token-mean", 2)])
def test_skipping_zero_advantage_rows_gives_the_same_gradient(
    tiny_model_dir, loss_agg, minibatches
):
    """Half the groups agree on their reward (advantage 0), and one row of the other half has
    no trained token: with skip_zero_advantage only the other 7 rows run forward/backward,
    and every optimizer step sees the same gradient, because the loss totals still count
    the skipped rows."""
    from polyrl.core.config import ConfigError

    policy = make_policy(tiny_model_dir)
    rec = sampled_record(policy)
    rec["reward"] = torch.tensor([1.0] * 8 + [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    group_credit(rec, AlgorithmConfig())
    assert not rec["advantages"][:8].any() and rec["advantages"][8:].any(-1).all()
    rec["loss_mask"][8] = 0  # e.g. another policy's turn: a nonzero advantage, nothing trained
    runs = {}
    for skip in (False, True):
        algo = AlgorithmConfig(loss_agg=loss_agg, minibatches=minibatches, skip_zero_advantage=skip)
        algo.validate()
        p = make_policy(tiny_model_dir, micro=3, max_grad_norm=0.0)  # clipping hides scale
        seen = grads_at_step(p)
        out = update(p, rec.clone(), algo, generator=torch.Generator().manual_seed(0))
        runs[skip] = (seen, out)
    (full, out_full), (skipped, out_skip) = runs[False], runs[True]
    assert out_skip["zero_adv_skipped_frac"] == 9 / 16 and "zero_adv_skipped_frac" not in out_full
    assert out_skip["loss"] == pytest.approx(out_full["loss"], rel=1e-5, abs=1e-7)
    assert len(full) == len(skipped) == minibatches
    for a, b in zip(full, skipped, strict=True):
        assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(a, b, strict=True))
    for bad in (
        {"kl_coef": 0.1},
        {"entropy_coef": 0.01},
        {"policy_loss": "kl_cov"},
        {"loss_agg": "seq-mean-token-sum-norm"},
    ):
        with pytest.raises(ConfigError, match="skip_zero_advantage"):
            AlgorithmConfig(skip_zero_advantage=True, **bad).validate()
        auto = AlgorithmConfig(**bad)  # the default turns it on only where it is exact
        auto.validate()
        assert not auto.skips_zero_advantage()
    assert AlgorithmConfig().skips_zero_advantage()
    assert not AlgorithmConfig(skip_zero_advantage=False).skips_zero_advantage()


def test_two_policies_update_only_from_their_own_rows(tiny_model_dir):
    pa, pb = make_policy(tiny_model_dir, "a"), make_policy(tiny_model_dir, "b")
    assert not {id(p) for g in pa.optimizer.param_groups for p in g["params"]} & {
        id(p) for g in pb.optimizer.param_groups for p in g["params"]
    }
    rows_a, rows_b = sampled_record(pa, seed=1, name="a"), sampled_record(pb, seed=2, name="b")
    mixed = concat([rows_a, rows_b])
    assert strings(select_policy(mixed, "a"), "policy") == ["a"] * rows_a.batch_size[0]
    alone = copy.deepcopy(pa)
    update(alone, rows_a.clone(), AlgorithmConfig())
    b_before = weights(pb)
    update(pa, select_policy(mixed, "a"), AlgorithmConfig())
    assert same(weights(pa), weights(alone))  # b's rows changed nothing for a
    assert same(weights(pb), b_before)  # a's update never touched b
    update(pb, select_policy(mixed, "b"), AlgorithmConfig())
    assert not same(weights(pb), b_before)


def test_nonfinite_gradient_skips_the_step_and_leaves_weights(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    rec = sampled_record(policy)
    adv = rec["advantages"].clone()
    adv[0, 0] = float("nan")
    rec["advantages"] = adv
    before = weights(policy)
    opt_state = copy.deepcopy(policy.optimizer.state_dict())
    out = update(policy, rec, AlgorithmConfig())
    assert out["skipped_nonfinite"] == 1
    assert same(weights(policy), before)
    assert policy.optimizer.state_dict()["state"] == opt_state["state"]


def test_sft_lowers_the_loss_on_its_batch(tiny_model_dir):
    policy = make_policy(tiny_model_dir, lr=3e-3)
    tok = policy.tokenizer
    prompt = tok.encode(
        "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    target = tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]
    batch = text_record(
        prompt_ids=[prompt] * 4,
        response_ids=[target] * 4,
        rollout_logprobs=[[0.0] * len(target)] * 4,
        policy=["main"] * 4,
        uid=[0] * 4,
        pad_id=tok.pad_token_id,
    )
    losses = [sft_update(policy, batch.clone())["sft_loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def test_entropy_is_reported_per_trained_token_without_a_bonus(tiny_model_dir):
    """With entropy_coef 0 the update still reports the sampling distribution's entropy: the
    mean over loss-mask tokens, computed here from a direct forward. The metric alone leaves
    the update bitwise unchanged; the bonus changes it."""
    policy = make_policy(tiny_model_dir, lr=0.0)
    rec = sampled_record(policy)
    rec["loss_mask"][0] = 0  # a row the policy does not train
    ids = torch.cat([rec["prompt_ids"], rec["response_ids"]], 1)
    mask = torch.cat([rec["prompt_mask"], rec["response_mask"]], 1)
    with torch.no_grad():
        logits = policy.model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
    r = rec["response_ids"].shape[1]
    logp = torch.log_softmax(logits[:, -r - 1 : -1].double() / 0.7, -1)
    ent = -(logp.exp() * logp).sum(-1)
    m = rec["loss_mask"].double()
    out = update(policy, rec, AlgorithmConfig(skip_zero_advantage=False), temperature=0.7)
    assert out["entropy"] == pytest.approx(float((ent * m).sum() / m.sum()), rel=1e-5)
    # skipping zero-advantage rows: the mean over the rows the update ran
    m = m * ((rec["advantages"] != 0) & (m > 0)).any(-1, keepdim=True)
    assert 0 < m.sum() < rec["loss_mask"].sum()
    out = update(policy, rec, AlgorithmConfig(), temperature=0.7)
    assert out["entropy"] == pytest.approx(float((ent * m).sum() / m.sum()), rel=1e-5)
    assert "entropy" not in update(policy, rec, AlgorithmConfig(log_entropy=False))

    def trained(**kw):
        p = make_policy(tiny_model_dir)
        update(p, rec, AlgorithmConfig(**kw))
        return weights(p)

    plain = trained(log_entropy=False)
    assert same(trained(), plain)  # the metric does not touch the gradient
    assert not same(trained(entropy_coef=0.5), plain)  # the bonus does


def test_kl_to_reference_is_zero_before_the_first_step(tiny_model_dir):
    cfg = PolicyConfig(model=tiny_model_dir, optim=OptimConfig(lr=1e-3))
    policy = CausalLMPolicy("main", cfg, total_steps=10, need_reference=True)
    out = update(
        policy, sampled_record(policy), AlgorithmConfig(kl_coef=0.1, kl_estimator="low_var_kl")
    )
    assert out["kl"] == 0.0


def test_lora_reference_is_the_base_and_only_adapters_train(tiny_model_dir):
    cfg = PolicyConfig(model=tiny_model_dir, optim=OptimConfig(lr=1e-2))
    cfg.lora.r, cfg.lora.target_modules = 4, ["q_proj", "v_proj"]
    policy = CausalLMPolicy("main", cfg, total_steps=10, need_reference=True)
    base = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}
    rec = sampled_record(policy)
    for _ in range(3):
        update(policy, rec.clone(), AlgorithmConfig(kl_coef=0.1))
    now = policy.model.state_dict()
    assert all(torch.equal(base[k], now[k]) for k in base)
    with torch.no_grad():
        ref = policy.ref_logprobs(rec)
        cur, _ = policy.logprobs(rec)
    m = rec["loss_mask"].bool()
    assert not torch.allclose(ref[m], cur[m])  # adapters moved the policy away from the base
