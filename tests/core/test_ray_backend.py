"""The Ray backend: FSDP2 worker groups match local training; sync, checkpoints, failures.

One Ray instance serves the session (``ray_cluster``); the two-node test runs its own
simulated cluster in a subprocess.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.core.config import ConfigError, from_dict
from polyrl.core.record import text_record
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.algorithms import AlgorithmConfig
from tests.helpers.distributed import LORA, ray_config
from tests.helpers.rollouts import LOW_DIGIT
from tests.helpers.runs import assert_weights_moved
from tests.helpers.trainer import chat_ids, sampled_record


def _assert_states_close(local: dict, remote: dict) -> None:
    """Weights and optimizer state agree to float noise. The key-projection bias is left
    out: its exact gradient is zero (softmax ignores a shift shared by all keys), so Adam
    turns each backend's ~1e-10 rounding noise into steps of different sign."""

    def far(a, b):
        return float((a - b).abs().max()) > 1e-6 + 1e-4 * float(b.abs().max())

    assert set(remote["weights"]) == set(local["weights"])
    bad = {
        k: float((remote["weights"][k] - v).abs().max())
        for k, v in local["weights"].items()
        if far(remote["weights"][k], v) and not k.endswith("k_proj.bias")
    }
    lo, ro = local["optimizer"], remote["optimizer"]
    assert set(ro["state"]) == set(lo["state"])
    bad |= {
        f"optim {i}.{k}": float((ro["state"][i][k] - v).abs().max())
        for i, st in lo["state"].items()
        for k, v in st.items()
        if far(ro["state"][i][k], v)
    }
    assert not bad, bad
    assert remote["scheduler"]["last_epoch"] == local["scheduler"]["last_epoch"]
    assert set(remote.get("reference", {})) == set(local.get("reference", {}))
    for k, v in local.get("reference", {}).items():
        torch.testing.assert_close(remote["reference"][k], v, msg=f"reference {k}")


@pytest.fixture(scope="module")
def pair(ray_cluster, tiny_model_dir):
    """(ray backend, its policy and engine, a local policy) from the same checkpoint."""
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend

    cfg = ray_config(tiny_model_dir)
    backend = RayBackend(cfg)
    try:
        remote = backend.make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=True, shared={}
        )
        engine = backend.make_engine("main", remote, cfg.policies["main"], seed=0)
        local = LocalBackend(cfg).make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=True, shared={}
        )
        yield backend, remote, engine, local
    finally:
        backend.shutdown()


def test_ray_args_are_checked():
    from polyrl.core.distributed.ray_backend import RayArgs

    with pytest.raises(ConfigError, match="did you mean 'distributed.args.workers_per_policy'"):
        from_dict(RayArgs, {"worker_per_policy": 2}, "distributed.args")
    args = from_dict(
        RayArgs, {"workers_per_policy": 2, "policies": {"critic": {"workers_per_policy": 1}}}
    )
    assert args.for_policy("critic").workers_per_policy == 1
    assert args.for_policy("main").workers_per_policy == 2
    with pytest.raises(ConfigError, match="cannot be set per policy"):
        from_dict(RayArgs, {"policies": {"main": {"address": "auto"}}}).for_policy("main")


def test_ray_backend_rejects_what_it_cannot_run(tiny_model_dir):
    """Checked before Ray starts: a per-policy override for an unknown policy; a LoRA
    policy of a kind whose base model is shared between policies (lora_agent). A causal_lm
    LoRA policy passes the check (it trains below)."""
    from polyrl.core.distributed.ray_backend import RayBackend, _check_lora_kind

    cfg = ray_config(tiny_model_dir, "distributed.args={policies: {mian: {workers_per_policy: 1}}}")
    with pytest.raises(ConfigError, match="did you mean 'main'"):
        RayBackend(cfg)
    pytest.importorskip("polyrl.marl")
    cfg = ray_config(tiny_model_dir, "policies.main.kind=lora_agent", "policies.main.lora.r=4")
    with pytest.raises(
        ConfigError,
        match=r"policies.main: kind 'lora_agent' with lora.r=4 is "
        r"not supported by distributed.backend=ray",
    ):
        RayBackend(cfg)
    cfg = ray_config(tiny_model_dir, LORA)
    _check_lora_kind("main", cfg.policies["main"])


@pytest.mark.ray
def test_updates_match_local_training(pair):
    """Loss, weights and optimizer state after each update equal the single-process ones:
    a full batch; a one-row batch (rank 1 runs a zero-weighted stand-in pass) with
    seq-mean-token-mean; KL to the (sharded) reference plus an entropy bonus; two epochs of
    two shuffled mini-batches (old log-probs gathered from both ranks)."""
    from polyrl.core.train import trainer

    backend, remote, _, local = pair
    assert remote.world_size == 2 and len(remote.group.nodes) == 2
    rec = sampled_record(local, seed=0)
    cases = [
        (rec, AlgorithmConfig()),
        (rec[:1], AlgorithmConfig(loss_agg="seq-mean-token-mean")),
        (sampled_record(local, seed=1), AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01)),
        (sampled_record(local, seed=2), AlgorithmConfig(ppo_epochs=2, minibatches=2)),
    ]
    for batch, algo in cases:
        g_local, g_ray = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        out_l = trainer.update(local, batch.clone(), algo, generator=g_local)
        out_r = backend.update(remote, batch.clone(), algo, temperature=1.0, generator=g_ray)
        assert out_r["loss"] == pytest.approx(out_l["loss"], rel=1e-4, abs=1e-7)
        assert out_r["grad_norm"] == pytest.approx(out_l["grad_norm"], rel=1e-4)
        assert out_r["lr"] == out_l["lr"] and out_r["skipped_nonfinite"] == 0
        for key in ("kl", "entropy"):
            assert (key in out_r) == (key in out_l)
            if key in out_l:
                assert out_r[key] == pytest.approx(out_l[key], rel=1e-4)
        assert torch.equal(g_ray.get_state(), g_local.get_state())  # same shuffle stream
        _assert_states_close(local.state_dict(), remote.state_dict())


@pytest.mark.ray
def test_engine_sync_sft_checkpoint_and_export(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.core.train import trainer

    backend, remote, engine, local = pair
    # Weight sync: after it, the engine actor answers exactly like an engine on the local
    # policy (greedy, so equal weights give equal tokens).
    engine.sync()
    ids = chat_ids(local.tokenizer)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    want = HFEngine(local, seed=0).generate(ids, greedy)
    got = engine.generate(ids, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # The SFT optimizer swap is forwarded to the workers; the loss matches local.
    tok = local.tokenizer
    targets = [
        tok.encode(str(a), add_special_tokens=False) + [tok.eos_token_id] for a in (19, 7, 55)
    ]
    batch = text_record(
        prompt_ids=ids[:3],
        response_ids=targets,
        rollout_logprobs=[[0.0] * len(t) for t in targets],
        policy=["main"] * 3,
        uid=[0, 1, 2],
        pad_id=tok.pad_token_id,
    )
    with local.sft_optimizer(1e-3):
        want_sft = trainer.sft_update(local, batch.clone())
    with remote.sft_optimizer(1e-3):
        got_sft = backend.sft_update(remote, batch.clone())
    assert got_sft["sft_loss"] == pytest.approx(want_sft["sft_loss"], rel=1e-4)
    # The warm start's end hands the frozen KL reference the warmed-up weights (KL anchors
    # RL to the SFT model), so the checkpoint carries the reference from now on.
    for own in (local.state_dict(), remote.state_dict()):  # each backend's own weights
        assert set(own["reference"]) == set(own["weights"])
        for k, v in own["weights"].items():
            assert torch.equal(own["reference"][k], v), k
    # Checkpoints have the local layout: a local checkpoint loads into the worker group
    # (and back), and the group then holds exactly that state; an RL step first, so the
    # optimizer state it carries is not empty whichever tests ran before.
    trainer.update(local, sampled_record(local, seed=4), AlgorithmConfig())
    state = local.state_dict()
    remote.load_state_dict(state)
    back = remote.state_dict()
    assert isinstance(next(iter(back["optimizer"]["state"])), int)
    _assert_states_close(state, back)
    local.load_state_dict(back)
    # Export: rank 0 writes a Hugging Face folder with the gathered weights.
    out = remote.export(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state["weights"][k], msg=k)


@pytest.mark.ray
def test_placement_that_cannot_fit_says_so(ray_cluster, tiny_model_dir):
    from polyrl.core.distributed.ray_backend import RayBackend

    cfg = ray_config(
        tiny_model_dir, "distributed.args={workers_per_policy: 64, placement_timeout_s: 1}"
    )
    backend = RayBackend(cfg)
    with pytest.raises(RuntimeError, match="policy 'main': Ray could not place 64 bundles"):
        backend.make_policy(
            "main", cfg.policies["main"], total_steps=1, need_reference=False, shared={}
        )
    backend.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_run_survives_a_dead_worker_by_resuming(ray_cluster, make_config, monkeypatch):
    """A short GRPO run on 2 FSDP workers writes metrics and checkpoints; a worker killed
    after step 2's checkpoint stops step 3 with an error naming it, and the failed run has
    removed its placement group and killed its actors by then (a process that goes on gets
    the cluster back); ``run.resume`` then finishes the run from step 2."""
    from ray.exceptions import RayActorError

    import polyrl.core.runner.session as session_mod
    from polyrl.core.distributed.ray_backend import ActorError
    from polyrl.core.loop import train

    ray = ray_cluster

    def live_groups() -> set[str]:
        table = ray.util.placement_group_table()
        return {g for g, info in table.items() if info["state"] in ("CREATED", "PENDING")}

    args = [
        "distributed.backend=ray",
        "distributed.args={workers_per_policy: 2}",
        "train.steps=3",
        "run.save_every=1",
        "eval.data.limit=8",
        f"reward.terms=[{LOW_DIGIT}]",  # rewards that differ within a group: the weights move
    ]
    opened: list = []
    groups: list = []
    save = session_mod.Session.save

    def save_then_kill(self, step):
        save(self, step)
        opened.append(self)
        if step == 2:
            groups.append(self.backend.groups["main"])
            ray.kill(groups[0].workers[1])

    monkeypatch.setattr(session_mod.Session, "save", save_then_kill)
    before = live_groups()
    try:
        with pytest.raises(ActorError, match="policy 'main' worker 1 died") as err:
            train(make_config(*args))
        assert isinstance(err.value.__cause__, RayActorError)  # Ray's own error, kept
        s, group = opened[-1], groups[0]
        assert s.step == 2
        # freed before the error reached here: the group removed, every actor gone
        assert group.pg.id.hex() not in before
        assert ray.util.placement_group_table(group.pg)["state"] == "REMOVED"
        assert live_groups() == before
        assert not s.backend.groups
        for actor in [*group.workers, group.engine]:
            with pytest.raises(RayActorError):
                ray.get(actor.__ray_ready__.remote(), timeout=60)
        with pytest.raises(ActorError, match="engine for policy 'main' died"):
            s.engines["main"].generate([[1, 2]], SamplingParams(max_new_tokens=2))
    finally:
        for s in opened[-1:]:
            s.backend.shutdown()
    monkeypatch.undo()
    run = train(make_config(*args, "run.resume=true"))
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "main/loss" in r]
    assert steps == [1, 2, 3]  # step 3 once, after the resume
    assert all(
        math.isfinite(r["main/loss"]) and r["main/skipped_nonfinite"] == 0
        for r in rows
        if "main/loss" in r
    )
    assert (run.path / "export" / "main" / "config.json").is_file()
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir())[-1] == "step_000003"
    # the step run after the resume trained: its weights moved from step 2's (5.0e-5)
    from polyrl.core.runner.checkpoint import SavedDirectory, read_full

    step2, step3 = (
        read_full(SavedDirectory(run.path / "checkpoints" / f"step_00000{s}" / "policy_main"))
        for s in (2, 3)
    )
    assert_weights_moved(step2["weights"], step3["weights"], 5e-6, "resumed")


@pytest.mark.ray
@pytest.mark.slow
def test_two_node_group_trains_a_step(tiny_model_dir):
    """ray.cluster_utils.Cluster with two one-CPU nodes; STRICT_SPREAD puts one worker on
    each; one FSDP update over gloo across them succeeds."""
    script = Path(__file__).parents[1] / "helpers" / "ray_multinode.py"
    proc = subprocess.run(
        [sys.executable, str(script), tiny_model_dir], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["nodes"]) == 2
    assert sorted(result["workers"]) == result["nodes"]  # one worker on each node
    assert result["grad_norm"] > 0 and abs(result["loss"]) < 10


def test_reward_term_on_its_own_actor_scores_like_the_driver(ray_cluster, tiny_model_dir):
    """``reward.terms[].actor`` runs a term in another process; values, per-row errors and
    metrics equal scoring in the driver."""
    import os

    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.rollout import rewards

    cfg = ray_config(
        tiny_model_dir,
        "reward.terms=[{name: exact_match, actor: {num_cpus: 0.5}}, {name: regex_format}]",
    )
    cfg.validate()
    texts = ["19", "7", "oops", "16"]
    record = text_record(
        prompt_ids=[[5, 6]] * 4,
        response_ids=[[7]] * 4,
        rollout_logprobs=[[0.0]] * 4,
        policy=["main"] * 4,
        uid=[0, 1, 2, 3],
        pad_id=0,
    )
    from polyrl.core.record import set_strings

    set_strings(record, "response_text", texts)
    set_strings(record, "meta", [{"answer": a} for a in ("19", "8", "1", "16")])
    backend = RayBackend(cfg)
    try:
        runners = backend.reward_runners(cfg.reward)
        assert list(runners) == ["exact_match"]
        remote = record.clone()
        metrics = rewards.score(remote, cfg.reward, runners=runners)
        local = record.clone()
        want = rewards.score(local, cfg.reward)
        assert torch.equal(remote["reward_terms/exact_match"], local["reward_terms/exact_match"])
        assert remote["reward_terms/exact_match"].tolist()[:2] == [1.0, 0.0]
        assert metrics == want
        pid = backend.reward_actors[0].pid.remote()
        assert ray_cluster.get(pid) != os.getpid()
    finally:
        backend.shutdown()


def test_unknown_reward_actor_key_fails_at_config_time(tiny_model_dir):
    with pytest.raises(
        (ConfigError, ValueError), match=r"unknown actor keys \['num_cpu'\].*num_cpus"
    ):
        ray_config(tiny_model_dir, "reward.terms=[{name: exact_match, actor: {num_cpu: 1}}]")


# ------------------------------------------------------------------------------ LoRA policies


@pytest.fixture(scope="module")
def lora_pair(ray_cluster, tiny_model_dir):
    """(ray backend, its LoRA policy and engine, a local LoRA policy), made last in this
    module (the cluster's 4 CPUs then hold this group and ``pair``'s)."""
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend

    cfg = ray_config(tiny_model_dir, LORA)
    backend = RayBackend(cfg)
    try:
        rng = torch.get_rng_state()
        remote = backend.make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=True, shared={}
        )
        engine = backend.make_engine("main", remote, cfg.policies["main"], seed=0)
        torch.set_rng_state(rng)  # the workers start from the driver's RNG state too
        local = LocalBackend(cfg).make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=True, shared={}
        )
        yield backend, remote, engine, local
    finally:
        backend.shutdown()


@pytest.mark.ray
def test_lora_updates_match_local_training(lora_pair):
    """The adapter starts as in local mode (same RNG state, rank 0's copy on every rank);
    FSDP2 over the PEFT model (frozen base and adapter in one unit) then gives the local
    loss, grad norm, KL to the adapter-disabled base, adapter weights and optimizer state."""
    from polyrl.core.train import trainer

    backend, remote, _, local = lora_pair
    start = remote.state_dict()
    assert set(start["weights"]) == set(local.trainable_state())
    assert all("lora_" in k for k in start["weights"])
    for k, v in local.trainable_state().items():
        assert torch.equal(start["weights"][k], v), k
    assert start["optimizer"]["state"] == {}  # no step yet: no (zero-step) Adam state
    remote.load_state_dict(local.state_dict())  # a checkpoint from before the first step
    algo = AlgorithmConfig(kl_coef=0.1)
    for seed in (0, 1):  # the second update starts from B != 0, so the KL is not 0
        batch = sampled_record(local, seed=seed)
        out_l = trainer.update(local, batch.clone(), algo, generator=torch.Generator())
        out_r = backend.update(
            remote, batch.clone(), algo, temperature=1.0, generator=torch.Generator()
        )
        assert out_r["loss"] == pytest.approx(out_l["loss"], rel=1e-4, abs=1e-7)
        assert out_r["grad_norm"] == pytest.approx(out_l["grad_norm"], rel=1e-4)
        assert out_r["kl"] == pytest.approx(out_l["kl"], rel=1e-4, abs=1e-9)
        _assert_states_close(local.state_dict(), remote.state_dict())
    assert out_l["kl"] > 0


@pytest.mark.ray
def test_lora_engine_sync_checkpoint_and_export(lora_pair, ray_cluster, tmp_path):
    from safetensors.torch import load_file

    backend, remote, engine, local = lora_pair
    # Checkpoint: adapter weights only, the local layout; it loads into a local LoRA policy
    # exactly, and back into the group. An RL step first, so the optimizer state is not
    # empty whichever tests ran before.
    backend.update(
        remote,
        sampled_record(local, seed=4),
        AlgorithmConfig(),
        temperature=1.0,
        generator=torch.Generator(),
    )
    state = remote.state_dict()
    assert isinstance(next(iter(state["optimizer"]["state"])), int)
    local.load_state_dict(state)
    for k, v in local.trainable_state().items():
        assert torch.equal(v, state["weights"][k]), k
    remote.load_state_dict(local.state_dict())
    back = remote.state_dict()
    for k, v in state["weights"].items():
        assert torch.equal(back["weights"][k], v), k
    # Sync: the engine actor's plain model gets the merged weights under the base names.
    engine.sync()
    merged = dict(local.named_weights())
    got = ray_cluster.get(
        remote.group.engine.__ray_call__.remote(
            lambda self: {k: v.detach().clone() for k, v in self.policy.model.state_dict().items()}
        )
    )
    assert set(got) == set(merged)
    for k, v in merged.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
    ids = chat_ids(local.tokenizer)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    want = HFEngine(local, seed=0).generate(ids, greedy)
    outs = engine.generate(ids, greedy)
    assert [c.token_ids for c in outs] == [c.token_ids for c in want]
    for a, b in zip(outs, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # Export: the PEFT adapter folder, as local mode writes it.
    out_r, out_l = remote.export(tmp_path / "ray"), local.export(tmp_path / "local")
    configs = [json.loads((o / "adapter_config.json").read_text()) for o in (out_r, out_l)]
    for c in configs:  # PEFT writes a set: its order depends on the process's hash seed
        c["target_modules"] = sorted(c["target_modules"])
    assert configs[0] == configs[1]
    w_r, w_l = (load_file(o / "adapter_model.safetensors") for o in (out_r, out_l))
    assert set(w_r) == set(w_l) and all(torch.equal(w_r[k], w_l[k]) for k in w_l)


def test_rank_metrics_reduce_to_the_single_process_ones():
    from polyrl.core.distributed.ray_backend import _reduce

    ranks = [
        {"loss": 0.2, "lr": 1e-3, "mismatch/rho_max": 1.5, "mismatch/rho_p50": 1.0},
        {"loss": 0.4, "lr": 2e-3, "mismatch/rho_max": 3.0, "mismatch/rho_p50": 0.5},
    ]
    out = _reduce(ranks, world=2)
    assert out["loss"] == pytest.approx(0.3)  # each rank's loss is scaled by dp_size
    assert out["lr"] == 1e-3  # global: rank 0's
    assert out["mismatch/rho_max"] == 3.0  # a maximum over all tokens, not an average
    assert out["mismatch/rho_p50"] == pytest.approx(0.75)
