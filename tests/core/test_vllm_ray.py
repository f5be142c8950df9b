"""The vLLM engine on a Ray engine actor (``distributed.backend=ray``, ``engine.name=vllm``):
its log-probs equal the FSDP workers' recomputation, and a sync after an update moves it
to the trained weights. vLLM starts inside the actor's own process, so its process-global
state never meets the engines of the other vLLM tests."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.record import text_record  # noqa: E402
from polyrl.core.rollout.engine import HFEngine, SamplingParams  # noqa: E402
from polyrl.core.train.algorithms import AlgorithmConfig  # noqa: E402
from polyrl.core.train.credit import group_credit  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

PROMPTS = ["12+7=", "3+4=", "25+30=", "8+8="]


def _record(tok, ids, outs):
    rec = text_record(
        prompt_ids=[ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=["main"] * len(outs),
        uid=[o.prompt_index for o in outs],
        pad_id=tok.pad_token_id,
    )
    # rewards that vary within every group, so the update moves the weights
    rec["reward"] = (
        torch.tensor([float(len(o.token_ids) % 2) for o in outs]) + torch.arange(len(outs)) % 4 / 10
    )
    group_credit(rec, AlgorithmConfig())
    return rec


def test_vllm_engine_actor_matches_the_trainer_and_follows_sync(
    ray_cluster, tiny_model_dir, logprob_gaps, update_both
):
    from polyrl.core.config import load
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        None,
        [
            f"policies.main.model={tiny_model_dir}",
            "policies.main.optim.lr=1e-2",
            "policies.main.micro_batch_size=16",
            "policies.main.engine.name=vllm",
            "policies.main.engine.args={max_model_len: 256, kv_cache_gb: 0.0625}",
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 1}",
        ],
    )
    backend = RayBackend(cfg)
    try:
        remote = backend.make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        engine = backend.make_engine("main", remote, cfg.policies["main"], seed=0)
        local = LocalBackend(cfg).make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        tok = local.tokenizer
        ids = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for t in PROMPTS
        ]

        # 1. the actor's samples carry log-probs the trainer reproduces (float32)
        outs = engine.generate(ids, SamplingParams(n=4, max_new_tokens=8))
        assert len(outs) == 16 and all(o.token_ids for o in outs)
        rec = _record(tok, ids, outs)
        (diff,) = logprob_gaps(rec, local)
        print(
            f"vLLM actor vs trainer log-probs: mean |diff| {diff.mean():.2e}, max {diff.max():.2e}"
        )
        assert diff.mean() <= 1e-3, diff

        # 2. one update on the worker (and the same one locally), then sync: the actor's
        # samples now score like the trained weights, and far from the old ones
        old = LocalBackend(cfg).make_policy(
            "main", cfg.policies["main"], total_steps=10, need_reference=False, shared={}
        )
        update_both(backend, remote, local, rec)
        engine.sync()
        rec2 = _record(tok, ids, engine.generate(ids, SamplingParams(n=4, max_new_tokens=8)))
        new_diff, old_diff = logprob_gaps(rec2, local, old)
        print(
            f"after sync: mean |diff| to the trained weights {new_diff.mean():.2e}, "
            f"to the old ones {old_diff.mean():.2e}"
        )
        assert new_diff.mean() <= 1e-3, new_diff
        assert old_diff.mean() > 10 * new_diff.mean() + 1e-3, (old_diff.mean(), new_diff.mean())
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
        assert [c.token_ids for c in engine.generate(ids, greedy)] == [
            c.token_ids for c in HFEngine(local, seed=0).generate(ids, greedy)
        ]
    finally:
        backend.shutdown()
