"""GPU paths: a policy on its device (local mode), bf16, FSDP2 on one rank, a Ray worker on nccl.

Run on a GPU machine with ``pytest -m gpu``. ``POLYRL_TEST_DEVICE=cpu`` runs the same
checks on the CPU (to check the tests themselves where no GPU is lent); the bf16
tolerances are those of bf16 matmuls, so they hold on either device.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from polyrl.core.record import text_record
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import group_credit

DEVICE = os.environ.get("POLYRL_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(),
        reason="needs a CUDA device (POLYRL_TEST_DEVICE=cpu runs it on the CPU)",
    ),
]
PROMPTS = ["3+4=", "12+5=", "7+8=", "20+1="]


def _policy(model_dir: str, dtype: str, *, device: str = DEVICE):
    from polyrl.core.config import load
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        None,
        [
            "run.loggers=[]",  # the offline GPU kit carries no tensorboard
            f"policies.main.model={model_dir}",
            f"policies.main.dtype={dtype}",
            f"policies.main.device={device}",
            "policies.main.optim.lr=1e-3",
            "policies.main.micro_batch_size=8",
        ],
    )
    cfg.validate()
    return LocalBackend(cfg).make_policy(
        "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
    )


def _record(policy, seed: int = 0):
    tok = policy.tokenizer
    ids = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for t in PROMPTS
    ]
    outs = HFEngine(policy, seed=seed).generate(ids, SamplingParams(n=4, max_new_tokens=8))
    rec = text_record(
        prompt_ids=[ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=["main"] * len(outs),
        uid=[o.prompt_index for o in outs],
        pad_id=tok.pad_token_id,
    )
    rec["reward"] = torch.tensor([float(k % 2) for k in range(len(outs))])
    group_credit(rec, AlgorithmConfig())
    return rec


@pytest.mark.parametrize("dtype,mean_tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_policy_and_engine_run_on_the_device_and_agree(tiny_model_dir, dtype, mean_tol):
    """device: auto/cuda puts the policy on the GPU in local mode; the engine samples there,
    its log-probs match the trainer's, and an update moves the weights."""
    from polyrl.core.train.trainer import update

    policy = _policy(tiny_model_dir, dtype)
    assert {p.device.type for p in policy.model.parameters()} == {torch.device(DEVICE).type}
    rec = _record(policy)
    mask = rec["response_mask"].bool()
    with torch.no_grad():
        logp = policy.logprobs(rec, 1.0)[0].float().cpu()
    gap = (logp[mask] - rec["rollout_logprobs"][mask]).abs()
    print(
        f"{dtype} on {DEVICE}: |trainer - engine| log-prob mean {gap.mean():.2e} "
        f"max {gap.max():.2e}"
    )
    assert float(gap.mean()) <= mean_tol
    before = {k: v.detach().float().cpu().clone() for k, v in policy.model.named_parameters()}
    out = update(policy, rec, AlgorithmConfig(), generator=torch.Generator().manual_seed(0))
    assert math.isfinite(out["loss"]) and out["skipped_nonfinite"] == 0
    moved = [
        k
        for k, v in policy.model.named_parameters()
        if not torch.equal(v.detach().float().cpu(), before[k])
    ]
    assert len(moved) > len(before) // 2


def test_a_run_trains_on_the_device(make_config):
    """The whole loop (rollout, reward, credit, update, eval, checkpoint) on the device."""
    from polyrl.core.loop import train

    cfg = make_config(
        "run.loggers=[]",
        f"policies.main.device={DEVICE}",
        "policies.main.dtype=bfloat16",
        "train.steps=3",
        "eval.every=0",
    )
    run = train(cfg)
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["main/loss"] for r in rows if "main/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert (run.path / "checkpoints").is_dir()


def test_fsdp2_worker_on_one_rank_matches_local(tiny_model_dir):
    """FSDP2 on one rank (nccl on CUDA, gloo on the CPU), in this process and without Ray:
    the Ray backend's worker class, set up and updated directly; its first update's loss
    equals local mode's. (The offline GPU kit carries no Ray: README, "GPU checks".)"""
    import socket

    from polyrl.core.config import load
    from polyrl.core.distributed.ray_workers import PolicyWorker
    from polyrl.core.recipe import Config
    from polyrl.core.train.trainer import update

    cfg = load(
        Config,
        None,
        [
            "run.loggers=[]",
            f"policies.main.model={tiny_model_dir}",
            "policies.main.optim.lr=1e-3",
            "policies.main.micro_batch_size=8",
        ],
    )
    local = _policy(tiny_model_dir, "float32")
    rec = _record(local)
    algo = AlgorithmConfig()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = PolicyWorker(rank=0, world=1, threads=torch.get_num_threads())
    try:
        worker.setup(
            "main",
            cfg.policies["main"],
            ("127.0.0.1", port),
            total_steps=10,
            need_reference=False,
            gpu=DEVICE.startswith("cuda"),
            timeout_s=120,
            rng=torch.get_rng_state(),
        )
        import torch.distributed as dist

        backend = dist.get_backend()
        sharded = type(next(worker.policy.model.parameters())).__name__
        r, _ = worker.update(rec.clone(), algo, 1.0, torch.Generator().manual_seed(0).get_state())
    finally:
        worker.close()
    loc = update(local, rec.clone(), algo, generator=torch.Generator().manual_seed(0))
    print(
        f"FSDP2 on {backend}, one rank: loss {r['loss']:.3e} vs local {loc['loss']:.3e}, "
        f"grad norm {r['grad_norm']:.6f} vs local {loc['grad_norm']:.6f}"
    )
    assert backend == ("nccl" if DEVICE.startswith("cuda") else "gloo")
    assert sharded == "DTensor"  # fully_shard turned the parameters into DTensors
    assert r["loss"] == pytest.approx(loc["loss"], rel=1e-4, abs=1e-7)
    # the first GRPO loss is ~0 (ratio 1, zero-mean advantages); the gradient is not
    assert loc["grad_norm"] > 1e-3
    assert r["grad_norm"] == pytest.approx(loc["grad_norm"], rel=1e-4)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="nccl needs CUDA")
def test_ray_worker_on_nccl_matches_local(ray_cluster, tiny_model_dir):
    """One FSDP2 worker on the GPU (nccl): its first update's loss equals local mode's."""
    from polyrl.core.config import load
    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.recipe import Config

    if ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test session's Ray cluster sees no GPU")
    cfg = load(
        Config,
        None,
        [
            "run.loggers=[]",
            f"policies.main.model={tiny_model_dir}",
            "policies.main.optim.lr=1e-3",
            "policies.main.micro_batch_size=8",
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 1, num_gpus_per_worker: 1}",
        ],
    )
    local = _policy(tiny_model_dir, "float32")
    rec = _record(local)
    backend = RayBackend(cfg)
    try:
        remote = backend.make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        algo = AlgorithmConfig()
        r = backend.update(
            remote, rec.clone(), algo, temperature=1.0, generator=torch.Generator().manual_seed(0)
        )
    finally:
        backend.shutdown()
    from polyrl.core.train.trainer import update

    loc = update(local, rec.clone(), algo, generator=torch.Generator().manual_seed(0))
    assert r["loss"] == pytest.approx(loc["loss"], rel=1e-4, abs=1e-7)
