"""Rollout-correction weights and mismatch metrics against hand computations."""

import math

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.train.correction import Mismatch, RolloutCorrection, weights

# two responses of 3 and 2 trained tokens; log pi_old - log mu per token:
D = [[0.1, 1.0, -0.3], [-2.0, 0.2, 0.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _pair(d=D):
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.7, -9.0]])
    return behaviour + torch.tensor(d), behaviour


def test_token_truncate_is_min_of_rho_and_cap():
    prox, beh = _pair()
    w, dropped = weights(prox, beh, MASK, RolloutCorrection(level="token", max=2.0), "token")
    want = [[min(math.exp(0.1), 2), 2.0, math.exp(-0.3)], [math.exp(-2.0), math.exp(0.2), 0.0]]
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)
    assert not dropped.any()
    assert not w.requires_grad


def test_sequence_mask_drops_whole_response_outside_band():
    prox, beh = _pair()
    opts = RolloutCorrection(level="sequence", mode="mask", max=2.0, min=0.5)
    w, dropped = weights(prox, beh, MASK, opts, "sequence")
    # row 0: rho = e^{0.8} = 2.23 > 2 -> masked; row 1: e^{-1.8} = 0.165 < 0.5 -> masked
    assert torch.equal(w, torch.zeros_like(w))
    assert dropped.tolist() == [[True, True, True], [True, True, False]]
    opts = RolloutCorrection(level="sequence", mode="mask", max=3.0, min=0.1)
    w, dropped = weights(prox, beh, MASK, opts, "sequence")
    want = [[math.exp(0.8)] * 3, [math.exp(-1.8)] * 2 + [0.0]]
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)
    assert not dropped.any()


def test_geometric_level_is_mean_log_ratio():
    prox, beh = _pair()
    w, _ = weights(prox, beh, MASK, RolloutCorrection(level="geometric", max=5.0), "geometric")
    want = [[math.exp(0.8 / 3)] * 3, [math.exp(-1.8 / 2)] * 2 + [0.0]]
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)


def test_reject_band_zeroes_tokens_outside_it_only():
    prox, beh = _pair()
    opts = RolloutCorrection(level="off", reject_band=[0.5, 2.5])
    w, dropped = weights(prox, beh, MASK, opts, "off")
    # token rho: e^.1 e^1 e^-.3 | e^-2 e^.2 -> e^1 = 2.72 > 2.5 and e^-2 = 0.135 < 0.5 out
    assert w.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert dropped.tolist() == [[False, True, False], [True, False, False]]


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_equal_engine_and_trainer_give_weights_of_exactly_one(level, mode):
    logp = torch.randn(4, 7) - 2
    mask = (torch.rand(4, 7) > 0.3).float()
    opts = RolloutCorrection(level=level, mode=mode, min=0.5, reject_band=[0.5, 2.0])
    w, dropped = weights(logp, logp.clone(), mask, opts, level)
    assert torch.equal(w, mask)
    assert not dropped.any()


def test_mismatch_metrics_match_hand_computation():
    prox, beh = _pair()
    m = Mismatch()
    opts = RolloutCorrection(level="token", max=2.0)
    _, dropped = weights(prox, beh, MASK, opts, "token")
    m.add(prox, beh, MASK, opts, "token", dropped)
    d = [0.1, 1.0, -0.3, -2.0, 0.2]
    got = m.metrics()
    assert got["mismatch/logp_abs_mean"] == pytest.approx(sum(abs(x) for x in d) / 5, rel=1e-6)
    assert got["mismatch/logp_abs_max"] == pytest.approx(2.0, rel=1e-6)
    k3 = sum(math.exp(x) - 1 - x for x in d) / 5  # r = pi_old / mu = e^d: r - 1 - log r
    assert got["mismatch/kl_engine_trainer"] == pytest.approx(k3, rel=1e-5)
    assert got["mismatch/truncated_frac"] == pytest.approx(1 / 5)  # only e^1 > 2
    assert got["mismatch/rho_max"] == pytest.approx(math.exp(1.0), rel=1e-6)
    assert got["mismatch/rho_p50"] == pytest.approx(math.exp(0.1), rel=1e-6)


def test_the_kl_metric_estimates_kl_of_engine_from_trainer_under_engine_samples():
    """Tokens drawn from the engine's distribution mu: the metric converges to the exact
    KL(mu || pi_old) = sum mu log(mu / pi_old), not to the reverse KL."""
    g = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, 0)
    pi = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, 0)
    exact = float((mu * (mu / pi).log()).sum())
    reverse = float((pi * (pi / mu).log()).sum())
    tokens = torch.multinomial(mu, 400_000, replacement=True, generator=g).view(400, 1000)
    m = Mismatch()
    opts = RolloutCorrection(level="token")
    m.add(pi.log()[tokens], mu.log()[tokens], torch.ones(400, 1000), opts, "off", None)
    got = m.metrics()["mismatch/kl_engine_trainer"]
    assert got == pytest.approx(exact, rel=0.03)
    assert abs(exact - reverse) > 0.1 * exact  # the test tells the two apart


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="max"):
        RolloutCorrection(max=1.0).check()
    with pytest.raises(ConfigError, match="reject_band"):
        RolloutCorrection(reject_band=[2.0, 3.0]).check()


def test_auto_is_off_only_for_exact_synchronous_engines():
    opts = RolloutCorrection()
    assert opts.resolved(exact_engines=True) == "off"
    assert opts.resolved(exact_engines=False) == "token"
    assert opts.resolved(exact_engines=True, max_staleness=1) == "token"


# --- through the trainer -------------------------------------------------------------


def _policy_and_record(model_dir):
    from tests.helpers.trainer import make_policy, sampled_record

    policy = make_policy(model_dir, max_grad_norm=0.0)
    rec = sampled_record(policy)
    with torch.no_grad():  # the engine == the trainer: its log-probs, exactly
        rec["rollout_logprobs"] = policy.logprobs(rec)[0] * rec["loss_mask"]
    return policy, rec


def _grads(model_dir, rec, algo, correction):
    import copy

    from polyrl.core.train.trainer import update
    from tests.helpers.trainer import grads_at_step, make_policy

    policy = make_policy(model_dir, max_grad_norm=0.0)
    seen = grads_at_step(policy)
    out = update(copy.deepcopy(policy), rec.clone(), algo, correction=correction)
    return seen, out, policy


def test_correction_is_a_no_op_when_engine_equals_trainer(tiny_model_dir):
    import copy

    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update
    from tests.helpers.trainer import grads_at_step

    policy, rec = _policy_and_record(tiny_model_dir)
    outs, grads = {}, {}
    for level in ("off", "token", "sequence"):
        p = copy.deepcopy(policy)
        seen = grads_at_step(p)
        algo = AlgorithmConfig(
            rollout_correction=RolloutCorrection(level=level, mode="mask"),
            skip_zero_advantage=False,
        )
        outs[level] = update(p, rec.clone(), algo, correction=level)
        grads[level] = seen[0]
    for level in ("token", "sequence"):
        assert outs[level]["loss"] == outs["off"]["loss"]
        assert all(torch.equal(a, b) for a, b in zip(grads[level], grads["off"], strict=True))
    assert outs["off"]["mismatch/logp_abs_max"] == 0.0
    assert outs["off"]["mismatch/rho_p10"] == outs["off"]["mismatch/rho_max"] == 1.0


def test_truncated_weights_scale_each_tokens_gradient(tiny_model_dir):
    """With one epoch the PPO ratio is 1, so the token-mean loss is -mean(w * A): weighting
    the advantages by hand gives the same gradient as the correction."""
    import copy

    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update
    from tests.helpers.trainer import grads_at_step

    policy, rec = _policy_and_record(tiny_model_dir)
    mask = rec["loss_mask"].float()
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(mask.shape, generator=gen) * mask
    rec["rollout_logprobs"] = rec["rollout_logprobs"] - noise  # the engine sampled elsewhere
    algo = AlgorithmConfig(
        rollout_correction=RolloutCorrection(level="token", max=1.5), skip_zero_advantage=False
    )
    a = copy.deepcopy(policy)
    ga = grads_at_step(a)
    out = update(a, rec.clone(), algo, correction="token")
    by_hand = rec.clone()
    w = torch.exp(noise).clamp(max=1.5) * mask
    by_hand["advantages"] = rec["advantages"] * w
    b = copy.deepcopy(policy)
    gb = grads_at_step(b)
    update(b, by_hand, AlgorithmConfig(skip_zero_advantage=False), correction="off")
    assert all(
        torch.allclose(x, y, atol=1e-7, rtol=1e-4) for x, y in zip(ga[0], gb[0], strict=True)
    )
    assert out["mismatch/truncated_frac"] == pytest.approx(
        float(((noise > math.log(1.5)) & (mask > 0)).sum() / mask.sum()), abs=1e-6
    )
