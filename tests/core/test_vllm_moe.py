"""The vLLM engine on a mixture-of-experts model (CPU, float32, issue 32): it runs the tiny
Qwen3-MoE and records each token's routed experts, prompt and response, as the HF engine
does, in fresh and partial (weights refreshed mid-call) generation.

The check is independent of the engine's capture: the HF model with its routers swapped
for hand-built ones that send every token to the recorded experts must reproduce vLLM's
log-probs; a misplaced or wrong row would not.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.demo.tiny import tiny_qwen3_moe  # noqa: E402
from polyrl.core.rollout.engine import SamplingParams  # noqa: E402
from polyrl.core.rollout.vllm_engine import VLLMEngine  # noqa: E402
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig  # noqa: E402
from tests.helpers.moe import replayed
from tests.helpers.trainer import chat_ids

pytestmark = pytest.mark.vllm
E, K, LAYERS = 4, 2, 2


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-moe"
    # pretrained a little, so the routers' logits are not all near ties
    tiny_qwen3_moe(path, num_experts=E, experts_per_token=K, num_layers=LAYERS, pretrain_steps=30)
    return CausalLMPolicy(
        "main", PolicyConfig(model=str(path)), total_steps=1, need_reference=False
    )


@pytest.fixture(scope="module")
def engine(policy):
    eng = VLLMEngine(policy, seed=0, max_model_len=256, kv_cache_gb=0.0625)
    yield eng
    eng.close()


def _check(policy, prompts, outs) -> float:
    """Every completion's experts: shape, -1 only on the last response row, k distinct
    experts per row, and a hand-routed HF forward on them reproduces vLLM's log-probs.
    Returns the share of tokens whose recorded set equals the HF router's own choice."""
    same = total = 0
    worst = 0.0
    for o in outs:
        experts = (o.prompt + o.tokens).experts  # prompt then response
        p = prompts[o.prompt_index]
        n = len(p) + len(o.token_ids)
        assert experts is not None and experts.dtype == torch.int8
        assert experts.shape == (n, LAYERS, K)
        assert bool((experts[-1] == -1).all())
        fed = experts[:-1].long()
        assert bool(((fed >= 0) & (fed < E)).all())
        assert bool((fed[..., 0] != fed[..., 1]).all())
        logp, own = replayed(policy.model, p + o.token_ids, experts)
        want = logp[torch.arange(len(p) - 1, n - 1), torch.tensor(o.token_ids)]
        worst = max(
            worst, float((torch.tensor(o.logprobs, dtype=torch.float64) - want).abs().max())
        )
        eq = (own[:-1].sort(-1).values == fed.sort(-1).values).all(-1).all(-1)
        same, total = same + int(eq.sum()), total + n - 1
    assert worst < 1e-4, f"max |vLLM - HF routed as recorded| = {worst:.2e}"
    return same / total


def test_vllm_records_the_experts_it_routed_to(policy, engine):
    prompts = chat_ids(policy.tokenizer, ("12+7=", "3+4=", "25+30="))
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8))
    # float32 on both sides: vLLM routes nearly every token as HF's router would
    assert _check(policy, prompts, outs) > 0.95


def test_vllm_records_experts_in_a_partial_call(policy, engine):
    """rollout.partial's stepping path records them too (here one version throughout)."""
    prompts = chat_ids(policy.tokenizer, ("8+9=", "14+2="))
    engine.set_refresh(lambda: 0)
    try:
        outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
    finally:
        engine.set_refresh(None)
    assert all(o.tokens.versions == [0] * len(o.token_ids) for o in outs)
    assert _check(policy, prompts, outs) > 0.95
