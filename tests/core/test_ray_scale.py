"""The 0.5B-shape path on a smaller shape: Qwen2.5-0.5B's layer shape (hidden 896, 14
heads, 2 KV heads, MLP 4864) with 1 layer and a small vocabulary, trained under Ray with
FSDP2 on 2 CPU ranks with activation checkpointing, as benchmarks/memory_05b.py runs it."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.train.algorithms import AlgorithmConfig


def _config(path: str, *extra: str):
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    return load(
        Config,
        None,
        [
            f"policies.main.model={path}",
            "policies.main.optim.lr=1e-4",
            "policies.main.micro_batch_size=4",
            "policies.main.gradient_checkpointing=true",
            *extra,
        ],
    )


def _batch(tokenizer, seed: int):
    from polyrl.core.record import text_record
    from polyrl.core.train.credit import group_credit

    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    rec = text_record(
        prompt_ids=[torch.randint(0, 100, (6,), generator=g).tolist() for _ in range(4)],
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        policy=["main"] * 4,
        uid=[0, 0, 1, 1],
        pad_id=tokenizer.pad_token_id,
    )
    rec["reward"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group_credit(rec, AlgorithmConfig())
    return rec


@pytest.mark.ray
@pytest.mark.slow
def test_05b_layer_shape_trains_on_two_ranks_with_half_the_state_each(ray_cluster, tmp_path):
    from polyrl.core.config import ConfigError
    from polyrl.core.demo.tiny import QWEN25_05B, qwen2_5_0_5b_shape
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.distributed.ray_workers import memory_report
    from polyrl.core.train import trainer

    path = str(qwen2_5_0_5b_shape(tmp_path / "m", num_layers=1, vocab_rows=1024))
    ray_cfg = _config(path, "distributed.backend=ray", "distributed.args={workers_per_policy: 2}")
    kw = {"total_steps": 10, "need_reference": False, "shared": {}}
    local = LocalBackend(ray_cfg).make_policy("main", ray_cfg.policies["main"], **kw)
    assert local.model.config.hidden_size == QWEN25_05B["hidden_size"] == 896
    assert local.model.config.num_key_value_heads == 2 and local.model.is_gradient_checkpointing

    backend = RayBackend(ray_cfg)
    try:
        remote = backend.make_policy("main", ray_cfg.policies["main"], **kw)
        for step in range(2):
            batch = _batch(local.tokenizer, step)
            gl, gr = torch.Generator().manual_seed(step), torch.Generator().manual_seed(step)
            out_l = trainer.update(local, batch.clone(), AlgorithmConfig(), generator=gl)
            out_r = backend.update(
                remote, batch.clone(), AlgorithmConfig(), temperature=1.0, generator=gr
            )
            assert out_r["loss"] == pytest.approx(out_l["loss"], rel=1e-4, abs=1e-6)
            assert out_r["grad_norm"] == pytest.approx(out_l["grad_norm"], rel=1e-4)
        # the step moved the weights as local mode's did
        state = remote.state_dict()["weights"]
        for k, v in local.model.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-4, msg=k)
        # each rank holds its half of the weights and of both Adam moments
        whole = memory_report(local)
        ranks = backend.groups["main"].call("memory")
        for key in ("params", "grads", "optimizer"):
            assert sum(r[key] for r in ranks) == pytest.approx(whole[key], rel=1e-3), key
            for r in ranks:
                assert r[key] == pytest.approx(whole[key] / 2, rel=0.05), (key, r[key])
    finally:
        backend.shutdown()
    with pytest.raises(ConfigError, match="cpu_offload"):
        RayBackend(
            _config(path, "distributed.backend=ray", "distributed.args={cpu_offload: true}")
        ).make_policy("main", ray_cfg.policies["main"], **kw)
