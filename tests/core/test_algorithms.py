"""The algorithm registry matches verl's reference math (group estimators on well-conditioned
groups: see test_credit.py for equal rewards and lone rows) and aggregates correctly."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, UnknownNameError
from polyrl.core.train.algorithms import (
    LOSS_AGG_MODES,
    AggInfo,
    AlgorithmConfig,
    aggregate,
    entropy_from_logits,
)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

GROUP_SIZES = (2, 3, 4, 5)  # several groups of different sizes
R = 7


def make_batch(seed: int = 0, group_sizes=GROUP_SIZES):
    """Rewards, masks (one empty row, one row with a hole) and interleaved group ids."""
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), i) for i, n in enumerate(group_sizes)])
    group = group[torch.randperm(len(group), generator=g)]  # groups are not contiguous
    b = len(group)
    rewards = torch.randn(b, generator=g)
    lengths = torch.randint(1, R + 1, (b,), generator=g)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    mask[1] = 0.0  # a row with nothing to train on
    mask[2] = torch.tensor([1, 1, 0, 0, 1, 1, 0], dtype=torch.float32)  # multi-turn hole
    return rewards, mask, group


def last_token_rewards(rewards, mask):
    """Reference placement, by a plain loop: reward on the last loss token (else last column)."""
    out = torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        on = [j for j in range(mask.shape[1]) if mask[i, j] != 0]
        out[i, on[-1] if on else mask.shape[1] - 1] = rewards[i]
    return out


def verl_algo(cfg):
    return AlgoConfig(gamma=cfg.gamma, lam=1.0, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std)


def verl_reference(name, rewards, mask, group, cfg):
    """The verl call each registered estimator must reproduce."""
    tok, index = last_token_rewards(rewards, mask), group.numpy()
    eps = cfg.epsilon
    if name == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            tok, mask, index, epsilon=eps, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std
        )[0]
    if name == "drgrpo":
        return core_algos.compute_grpo_outcome_advantage(
            tok, mask, index, epsilon=eps, norm_adv_by_std_in_grpo=False
        )[0]
    if name == "rloo":
        return core_algos.compute_rloo_outcome_advantage(tok, mask, index, epsilon=eps)[0]
    if name == "grpo_passk":
        return core_algos.compute_grpo_passk_outcome_advantage(
            tok, mask, index, epsilon=eps, config=verl_algo(cfg)
        )[0]
    if name == "reinforce_plus_plus":
        return core_algos.compute_reinforce_plus_plus_outcome_advantage(
            tok, mask, config=verl_algo(cfg)
        )[0]
    if name == "reinforce_plus_plus_baseline":
        return core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
            tok, mask, index, epsilon=eps, config=verl_algo(cfg)
        )[0]
    raise AssertionError(f"no verl reference for {name}")


ESTIMATORS = [
    "grpo",
    "drgrpo",
    "rloo",
    "grpo_passk",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
]


def test_expected_names_are_registered():
    assert set(ESTIMATORS) <= set(ADVANTAGES.names())
    assert {"ppo_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov"} <= set(POLICY_LOSSES.names())
    assert {"k1", "k2", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+"} <= set(
        KL_ESTIMATORS.names()
    )


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("norm", [True, False])
def test_advantage_matches_verl(name, norm):
    cfg = AlgorithmConfig(gamma=0.9, norm_adv_by_std=norm)
    for seed in range(3):
        rewards, mask, group = make_batch(seed)
        adv = ADVANTAGES.get(name)(rewards, mask, group, cfg)
        assert adv.shape == mask.shape and adv.dtype == torch.float32
        torch.testing.assert_close(adv, verl_reference(name, rewards, mask, group, cfg).float())
        assert torch.all(adv[mask == 0] == 0)
        assert adv.abs().sum() > 0  # the comparison is not trivially zero == zero


def test_grpo_matches_vectorized_verl_and_hand_computation():
    cfg = AlgorithmConfig()
    rewards, mask, group = make_batch(4)
    adv = ADVANTAGES.get("grpo")(rewards, mask, group, cfg)
    vec = core_algos.compute_grpo_vectorized_outcome_advantage(
        last_token_rewards(rewards, mask), mask, group.numpy(), epsilon=cfg.epsilon
    )[0]
    torch.testing.assert_close(adv, vec)
    hand = torch.empty_like(rewards)
    for gid in group.unique():
        sel = group == gid
        r = rewards[sel]
        hand[sel] = (r - r.mean()) / (r.std(unbiased=True) + cfg.epsilon)
    # the empty row still counts in its group's statistics, but gets no advantage
    torch.testing.assert_close(adv, hand[:, None] * mask)


def test_drgrpo_is_mean_centering_whatever_the_config():
    rewards, mask, group = make_batch(5)
    hand = torch.empty_like(rewards)
    for gid in group.unique():
        sel = group == gid
        hand[sel] = rewards[sel] - rewards[sel].mean()
    dr = ADVANTAGES.get("drgrpo")(rewards, mask, group, AlgorithmConfig(norm_adv_by_std=True))
    torch.testing.assert_close(dr, hand[:, None] * mask)
    unnormed = ADVANTAGES.get("grpo")(rewards, mask, group, AlgorithmConfig(norm_adv_by_std=False))
    torch.testing.assert_close(unnormed, dr)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_sum_to_zero(name):
    rewards, _, group = make_batch(6)
    full = torch.ones(len(rewards), R)  # full masks: one scalar per row is visible
    adv = ADVANTAGES.get(name)(rewards, full, group, AlgorithmConfig())[:, 0]
    for gid in group.unique():
        assert abs(float(adv[group == gid].sum())) < 1e-5


def test_rloo_is_leave_one_out():
    rewards, mask, group = make_batch(7)
    adv = ADVANTAGES.get("rloo")(rewards, torch.ones(len(rewards), 3), group, AlgorithmConfig())
    for i in range(len(rewards)):
        others = (group == group[i]) & (torch.arange(len(rewards)) != i)
        assert abs(float(adv[i, 0] - (rewards[i] - rewards[others].mean()))) < 1e-5


def test_reinforce_plus_plus_uses_gamma_and_reward_position():
    rewards, mask, group = make_batch(8)
    a = ADVANTAGES.get("reinforce_plus_plus")(rewards, mask, group, AlgorithmConfig(gamma=1.0))
    b = ADVANTAGES.get("reinforce_plus_plus")(rewards, mask, group, AlgorithmConfig(gamma=0.5))
    assert not torch.allclose(a, b)
    # with gamma = 1 every loss token of a row sees the same return-to-go
    row = 0 if mask[0].sum() > 1 else 3
    on = a[row][mask[row] != 0]
    torch.testing.assert_close(on, on[:1].expand_as(on))


@pytest.mark.parametrize("name", ESTIMATORS)
def test_empty_masks_do_not_crash(name):
    rewards, mask, group = make_batch(9)
    mask[:3] = 0
    adv = ADVANTAGES.get(name)(rewards, mask, group, AlgorithmConfig())
    assert torch.isfinite(adv).all() and torch.all(adv[:3] == 0)
    if name != "grpo_passk":  # pass@k is undefined for a single sample
        empty = torch.zeros(2, R)
        out = ADVANTAGES.get(name)(
            torch.tensor([1.0, 0.0]), empty, torch.tensor([0, 0]), AlgorithmConfig()
        )
        assert torch.equal(out, torch.zeros(2, R))


@pytest.mark.parametrize("name", ["grpo", "drgrpo"])
def test_lone_rows_get_zero_where_verl_keeps_the_reward(name):
    """verl gives a group of one row mean 0 (and std 1): its raw reward becomes its advantage.
    It has no baseline to compare with, so here it gets 0; the other rows still match verl."""
    cfg = AlgorithmConfig()
    rewards, mask, group = make_batch(10, group_sizes=(1, 3, 4))
    lone = int((group == 0).nonzero())
    mask[lone] = 1.0
    adv = ADVANTAGES.get(name)(rewards, mask, group, cfg)
    ref = verl_reference(name, rewards, mask, group, cfg)
    assert adv[lone].abs().sum() == 0 and ref[lone].abs().sum() > 0
    rest = group != 0
    torch.testing.assert_close(adv[rest], ref[rest].float())


# --------------------------------------------------------------------------- losses

LOSSES = {
    "ppo_clip": "vanilla",
    "gspo": "gspo",
    "cispo": "cispo",
    "sapo": "sapo",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
}

# non-default values everywhere, so a setting the wrapper forgot to pass shows up; each
# loss's own knobs live in its loss_args
CLIPS = {"clip_ratio_low": 0.15, "clip_ratio_high": 0.28, "clip_ratio_c": 2.5}
OWN = {
    "sapo": {"tau_pos": 1.3, "tau_neg": 1.7},
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 50.0},
    "kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.3},
}
# verl's own defaults for the knobs a loss does not take (they do not affect it)
UNUSED = {
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 0.1,
}


def loss_cfg(name):
    cfg = AlgorithmConfig(policy_loss=name, loss_args=dict(OWN.get(name, {})), **CLIPS)
    cfg.validate()
    return cfg


def verl_actor(mode, cfg, agg):
    cfg = SimpleNamespace(**CLIPS, **(UNUSED | dict(cfg.loss_args)))
    actor = ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=cfg.clip_ratio_low,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
        policy_loss=PolicyLossConfig(
            loss_mode=mode,
            clip_cov_ratio=cfg.clip_cov_ratio,
            clip_cov_lb=cfg.clip_cov_lb,
            clip_cov_ub=cfg.clip_cov_ub,
            kl_cov_ratio=cfg.kl_cov_ratio,
            ppo_kl_coef=cfg.ppo_kl_coef,
        ),
    )
    actor.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=agg.batch_num_tokens,
        global_batch_size=agg.global_batch_size,
        loss_scale_factor=agg.loss_scale_factor,
    )
    return actor


def loss_inputs(seed=0, b=6, r=R, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, r, generator=g) * 3
    logp = (old + spread * torch.randn(b, r, generator=g)).requires_grad_(True)
    adv = torch.randn(b, r, generator=g)
    mask = (torch.rand(b, r, generator=g) > 0.25).float()
    mask[0] = 0.0
    return logp, old, adv, mask


def run_verl_loss(mode, logp, old, adv, mask, cfg, agg):
    fn = core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg.mode,
        config=verl_actor(mode, cfg, agg),
    )
    return loss, {k.removeprefix("actor/"): v for k, v in metrics.items()}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_matches_verl(name, mode):
    logp, old, adv, mask = loss_inputs(1)
    agg = AggInfo(
        mode=mode, batch_num_tokens=int(mask.sum()) + 5, global_batch_size=9, loss_scale_factor=4
    )
    torch.manual_seed(0)  # clip_cov picks its cut tokens at random
    cfg = loss_cfg(name)
    loss, metrics = POLICY_LOSSES.get(name)(logp, old, adv, mask, cfg, agg)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.manual_seed(0)
    ref, ref_metrics = run_verl_loss(LOSSES[name], logp, old, adv, mask, cfg, agg)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert metrics == pytest.approx(ref_metrics)
    assert all(not k.startswith("actor/") and isinstance(v, float) for k, v in metrics.items())


def test_ppo_clip_inputs_actually_clip():
    logp, old, adv, mask = loss_inputs(1)
    cfg = loss_cfg("ppo_clip")
    _, metrics = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask, cfg, AggInfo())
    assert metrics["pg_clipfrac"] > 0 and metrics["ppo_kl"] != 0


def test_gspo_clamps_the_log_sequence_ratio_at_10():
    """As AlgorithmConfig.policy_loss documents: past log ratio 10, a negative advantage's
    loss is capped at |A| e^10 and has no gradient; below it, loss and gradient are e^x."""
    cfg, mask, adv = AlgorithmConfig(), torch.ones(1, 3), torch.full((1, 3), -1.0)
    for mean_log_ratio, expected in ((12.0, math.exp(10)), (5.0, math.exp(5))):
        logp = torch.tensor([[mean_log_ratio - 1, mean_log_ratio, mean_log_ratio + 1]])
        logp.requires_grad_(True)
        loss, _ = POLICY_LOSSES.get("gspo")(logp, torch.zeros(1, 3), adv, mask, cfg, AggInfo())
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(expected, rel=1e-5)
        # token-mean over 3 tokens; d/dlogp_t exp(logp_t - sg(logp_t) + x) = e^x, unclamped
        hand = 0.0 if mean_log_ratio > 10 else expected / 3
        torch.testing.assert_close(grad, torch.full((1, 3), hand))


def test_infinite_clip_ratio_c_turns_the_dual_clip_off():
    """clip_ratio_c: .inf (Flow-GRPO's loss): max(-A r, -A clip(r)) for every sign of A,
    zero advantages included (no nan from 0 * inf reaches the loss or its gradient)."""
    clip = 1e-4
    logp = torch.tensor([[3.0, -3.0, 0.5, 2.0, 1.5]], requires_grad=True)
    adv = torch.tensor([[-1.0, 0.0, 1.0, -2.0, -0.5]])
    losses = {}
    for c in (math.inf, 3.0):
        cfg = AlgorithmConfig(clip_ratio_c=c, clip_ratio_low=clip, clip_ratio_high=clip)
        cfg.validate()
        loss, _ = POLICY_LOSSES.get("ppo_clip")(
            logp, torch.zeros(1, 5), adv, torch.ones(1, 5), cfg, AggInfo()
        )
        losses[c] = (loss, *torch.autograd.grad(loss, logp))
    r = logp.detach().exp()
    per_token = torch.maximum(-adv * r, -adv * r.clamp(1 - clip, 1 + clip))
    loss, grad = losses[math.inf]
    torch.testing.assert_close(loss, per_token.mean())
    # unclipped where A < 0 and r > 1 + clip: d(-A e^x)/dx = -A r; clipped elsewhere
    hand = torch.where((adv < 0) & (r > 1 + clip), -adv * r, torch.zeros_like(r)) / 5
    torch.testing.assert_close(grad, hand)
    dual, dual_grad = losses[3.0]  # the default caps tokens 0, 3 and 4 (r > 3)
    assert dual < loss and dual_grad[0, 0] == 0 and grad[0, 0] > 0


def test_gspo_takes_token_level_weights_per_token():
    """Rollout-correction weights multiply each token's term, even in GSPO's sequence-level
    ratio: at ratio 1 and A = 1, token t's gradient is -w_t / (tokens), not one per row."""
    w = torch.tensor([[1.0, 2.0, 0.5]])
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = POLICY_LOSSES.get("gspo")(
        logp,
        torch.zeros(1, 3),
        torch.ones(1, 3),
        torch.ones(1, 3),
        AlgorithmConfig(),
        AggInfo(),
        weights=w,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 0.5) / 3)
    torch.testing.assert_close(grad, -w / 3)


def test_loss_settings_are_not_mixed_up_by_the_cache():
    logp, old, adv, mask = loss_inputs(2, spread=0.8)
    loss_fn = POLICY_LOSSES.get("ppo_clip")
    narrow = AlgorithmConfig(clip_ratio_high=0.1)
    wide = dataclasses.replace(narrow, clip_ratio_high=0.5)
    first = loss_fn(logp, old, adv, mask, narrow, AggInfo())[0]
    other = loss_fn(logp, old, adv, mask, wide, AggInfo())[0]
    again = loss_fn(logp, old, adv, mask, narrow, AggInfo())[0]
    assert not torch.allclose(first, other)
    assert torch.equal(first, again)


def test_first_update_is_on_policy():
    logp, _, adv, mask = loss_inputs(3)
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(
        logp, logp.detach(), adv, mask, AlgorithmConfig(), AggInfo(mode="token-mean")
    )
    torch.testing.assert_close(loss, -(adv * mask).sum() / mask.sum())
    assert metrics["pg_clipfrac"] == 0.0
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == 0.0
    (grad,) = torch.autograd.grad(loss, logp)  # ratio 1: plain policy gradient
    torch.testing.assert_close(grad, -adv * mask / mask.sum())


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_full_batch(name, mode):
    logp, old, adv, mask = loss_inputs(4, b=8)
    mask[5] = 0.0  # a second empty row, inside another micro-batch
    cfg = loss_cfg(name)
    agg = AggInfo.for_minibatch(mode, mask)
    assert agg.batch_num_tokens == int(mask.sum())
    assert agg.global_batch_size == int((mask.sum(-1) > 0).sum())
    loss_fn = POLICY_LOSSES.get(name)
    full, _ = loss_fn(logp, old, adv, mask, cfg, AggInfo(mode=mode))
    (full_grad,) = torch.autograd.grad(full, logp)
    total = 0.0
    for sl in (slice(0, 3), slice(3, 4), slice(4, 8)):
        part, _ = loss_fn(logp[sl], old[sl], adv[sl], mask[sl], cfg, agg)
        total = total + part
    (micro_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(micro_grad, full_grad)
    if mode in ("token-mean", "seq-mean-token-mean"):  # and unlike naive per-micro means
        naive = sum(
            loss_fn(logp[sl], old[sl], adv[sl], mask[sl], cfg, AggInfo(mode=mode))[0]
            for sl in (slice(0, 3), slice(3, 4), slice(4, 8))
        )
        assert not torch.allclose(naive, full)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_matches_verl_and_splits(mode):
    g = torch.Generator().manual_seed(5)
    values = torch.randn(6, R, generator=g)
    mask = (torch.rand(6, R, generator=g) > 0.3).float()
    mask[2] = 0
    agg = AggInfo.for_minibatch(mode, mask)
    full = aggregate(values, mask, agg)
    ref = core_algos.agg_loss(
        values,
        mask,
        mode,
        batch_num_tokens=agg.batch_num_tokens,
        global_batch_size=agg.global_batch_size,
    )
    torch.testing.assert_close(full, ref)
    parts = aggregate(values[:4], mask[:4], agg) + aggregate(values[4:], mask[4:], agg)
    torch.testing.assert_close(parts, full)


# ------------------------------------------------------------------------------ KL


def _hand_kl(name: str, logp: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Value and d/dlogp of each estimator, written out from Schulman's note (k1, k2, k3)
    with verl's clamps for k3: log-ratio to [-20, 20], estimate to [-10, 10]."""
    d = (logp - ref).double()
    x = -d  # log(ref / policy)
    if name in ("k1", "k1+"):
        value, grad = d, torch.ones_like(d)
    elif name == "abs":
        value, grad = d.abs(), torch.sign(d)
    elif name == "k2":
        value, grad = 0.5 * d**2, d
    else:  # k3 and low_var_kl, with or without '+'
        xc = x.clamp(-20, 20)
        raw = torch.exp(xc) - xc - 1
        value = raw.clamp(max=10)
        grad = torch.where((x.abs() < 20) & (raw < 10), 1 - torch.exp(x), torch.zeros_like(x))
    if name.endswith("+"):
        grad = d  # straight-through: the k2 gradient under the estimator's value
    return value.float(), grad.float()


@pytest.mark.parametrize(
    "name", ["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+"]
)
def test_kl_estimators_match_a_hand_computation(name):
    g = torch.Generator().manual_seed(6)
    logp = torch.randn(4, R, generator=g)
    ref = torch.randn(4, R, generator=g)
    # log(ref / policy) beyond both of k3's clamps, past its [-10, 10] bound, and just inside
    logp[0, :4] = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ref[0, :4] = torch.tensor([25.0, -25.0, 3.0, -5.0])
    logp.requires_grad_(True)
    kl = KL_ESTIMATORS.get(name)(logp, ref)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    value, expected_grad = _hand_kl(name, logp.detach(), ref)
    torch.testing.assert_close(kl, value)
    torch.testing.assert_close(grad, expected_grad)
    if name.rstrip("+") in ("k3", "low_var_kl"):
        assert kl[0, :3].tolist() == [10.0, 10.0, 10.0]  # clamped: no gradient unless '+'
        assert kl[0, 3].item() == pytest.approx(math.exp(-5) + 4, rel=1e-6)
    same = KL_ESTIMATORS.get(name)(ref, ref)
    assert torch.equal(same, torch.zeros_like(same))


def test_straight_through_kl_has_k3_value_and_k2_gradient():
    g = torch.Generator().manual_seed(7)
    logp = torch.randn(3, R, generator=g).requires_grad_(True)
    ref = torch.randn(3, R, generator=g)
    st = KL_ESTIMATORS.get("k3+")(logp, ref)
    torch.testing.assert_close(st, KL_ESTIMATORS.get("k3")(logp, ref))
    (g_st,) = torch.autograd.grad(st.sum(), logp)
    (g_k2,) = torch.autograd.grad(KL_ESTIMATORS.get("k2")(logp, ref).sum(), logp)
    (g_k3,) = torch.autograd.grad(KL_ESTIMATORS.get("k3")(logp, ref).sum(), logp)
    torch.testing.assert_close(g_st, g_k2)
    assert not torch.allclose(g_st, g_k3)
    assert torch.all(KL_ESTIMATORS.get("k3")(logp, ref) >= 0)


# ------------------------------------------------------------------------- entropy


def test_entropy_from_logits_is_stable_and_correct():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    ent = entropy_from_logits(logits)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))
    shifted = entropy_from_logits((logits + 1e4).float())  # softmax is shift-invariant
    assert torch.isfinite(shifted).all()
    torch.testing.assert_close(shifted.double(), ent, atol=2e-2, rtol=0)
    uniform = entropy_from_logits(torch.zeros(3, 11))
    torch.testing.assert_close(uniform, torch.full((3,), float(np.log(11))))


# -------------------------------------------------------------------------- config


def test_every_config_field_is_documented_and_defaults_validate():
    for f in dataclasses.fields(AlgorithmConfig):
        assert f.metadata.get("doc"), f.name
    AlgorithmConfig().validate()


@pytest.mark.parametrize(
    "field,bad,hint",
    [
        ("advantage", "grp0", "grpo"),
        ("advantage", "rloo0", "rloo"),
        ("policy_loss", "ppo_clp", "ppo_clip"),
        ("kl_estimator", "low_var", "low_var_kl"),
    ],
)
def test_unknown_names_suggest_the_nearest(field, bad, hint):
    with pytest.raises(UnknownNameError, match=repr(hint)):
        AlgorithmConfig(**{field: bad}).validate()
    registry = {
        "advantage": ADVANTAGES,
        "policy_loss": POLICY_LOSSES,
        "kl_estimator": KL_ESTIMATORS,
    }[field]
    with pytest.raises(UnknownNameError, match=repr(hint)):
        registry.get(bad)


def test_bad_loss_agg_names_the_nearest_mode():
    with pytest.raises(ConfigError, match="'seq-mean-token-mean'"):
        AlgorithmConfig(loss_agg="seq_mean_token_mean").validate()
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        AlgorithmConfig(clip_ratio_c=1.0).validate()
