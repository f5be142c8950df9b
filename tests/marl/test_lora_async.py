"""``lora_agent`` teams under ``rollout.max_staleness >= 1``: the engines generate on a
shadow copy of the shared base (one for all the adapters of a base), weight versions load
into each adapter there, and a run keeps the staleness bound, with and without
``rollout.partial``."""

from __future__ import annotations

import torch

from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.rollout.rollouts import LocalVersions
from tests.helpers.lora import NAMES, lora_pair, prompts
from tests.helpers.partial import check_partial_run
from tests.helpers.runs import metrics_by_step

LORA = [f"policies.{n}.{k}" for n in NAMES for k in ("kind=lora_agent", "lora.r=4")]


def _generate(policy, seed: int):
    ids = prompts(policy, ["object 1", "dog 2"])
    return HFEngine(policy, seed=seed).generate(ids, SamplingParams(n=3, max_new_tokens=3))


def test_shadows_share_one_copied_base_and_take_versions_per_adapter(marl_config):
    _, pols = lora_pair(marl_config)
    speaker, listener = pols["speaker"], pols["listener"]
    versions = {n: LocalVersions(p) for n, p in pols.items()}
    twins = {n: v.engine_policy for n, v in versions.items()}
    assert twins["speaker"].model is twins["listener"].model  # one copy for the base
    assert twins["speaker"].model is not speaker.model
    assert twins["speaker"].row_group() == twins["listener"].row_group()  # calls still mix
    base = dict(speaker.model.named_parameters())
    copied = dict(twins["speaker"].model.named_parameters())
    assert set(base) == set(copied)
    for k, p in copied.items():  # base weights shared, adapters copied, nothing trains
        assert (p is base[k]) == ("lora_" not in k), k
        assert not p.requires_grad

    before = _generate(twins["speaker"], seed=5)
    assert [c.token_ids for c in before] == [c.token_ids for c in _generate(speaker, seed=5)]
    moved = {k: v + 0.5 * torch.randn_like(v) for k, v in speaker.trainable_state().items()}
    speaker.load_trainable_state(moved)  # what an update does to the trainer's adapter
    listener_state = listener.trainable_state()
    stale = _generate(twins["speaker"], seed=5)
    assert [c.logprobs for c in stale] == [c.logprobs for c in before]  # the update stays out

    versions["speaker"].load(HFEngine(twins["speaker"]), versions["speaker"].capture())
    fresh, want = _generate(twins["speaker"], seed=5), _generate(speaker, seed=5)
    assert [c.token_ids for c in fresh] == [c.token_ids for c in want]
    gap = max(
        abs(a - b)
        for f, w in zip(fresh, want, strict=True)
        for a, b in zip(f.logprobs, w.logprobs, strict=True)
    )
    assert gap < 1e-5
    assert any(
        a != b
        for f, s in zip(fresh, stale, strict=True)
        for a, b in zip(f.logprobs, s.logprobs, strict=False)
    )
    twin_listener = {
        k: p for k, p in twins["listener"].model.named_parameters() if ".listener." in k
    }
    assert all(torch.equal(twin_listener[k], v) for k, v in listener_state.items())  # untouched


def test_lora_team_trains_one_version_behind(marl_config):
    from polyrl.core.loop import train

    cfg = marl_config(*LORA, "rollout.max_staleness=1", "eval.every=0")
    run = train(cfg)
    steps = metrics_by_step(run.path)
    for s in (1, 2):
        assert steps[s]["async/staleness_max"] <= 1
        assert steps[s]["async/dropped_groups"] == 0
    # batch b is made with version b - 2: from step 2 on every row is exactly one behind
    assert steps[2]["async/staleness_1"] > 0 and steps[2]["async/staleness_0"] == 0
    assert all(torch.isfinite(torch.tensor(steps[2][f"{n}/loss"])) for n in NAMES)


def test_lora_team_takes_newer_weights_mid_rollout(marl_config):
    from polyrl.core.loop import train

    engine = "tests.helpers.crawling_engine:CrawlingEngine"
    cfg = marl_config(
        *LORA,
        "rollout.max_staleness=1",
        "rollout.partial=true",
        *(f"policies.{n}.engine.name={engine}" for n in NAMES),
        "run.save_every=0",
        "eval.every=0",
    )
    run = train(cfg)
    steps = check_partial_run(run.path, 2)  # rows whose tokens span a publish: versions kept
    assert all(torch.isfinite(torch.tensor(steps[2][f"{n}/loss"])) for n in NAMES)
