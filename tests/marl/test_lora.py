"""``lora_agent``: one base model, one adapter and optimizer per policy (no training run)."""

from __future__ import annotations

import torch

from polyrl.core.record import text_record
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.trainer import update


def make_pair(marl_config):
    from polyrl.core.registry import POLICIES

    cfg = marl_config(
        "policies.speaker.kind=lora_agent",
        "policies.listener.kind=lora_agent",
        "policies.speaker.lora.r=4",
        "policies.listener.lora.r=4",
        "policies.speaker.optim.lr=0.05",
        "policies.listener.optim.lr=0.05",
    )
    shared: dict = {}
    pols = {
        n: POLICIES.get(p.kind)(n, p, total_steps=4, need_reference=True, shared=shared)
        for n, p in cfg.policies.items()
    }
    return cfg, pols, shared


def batch(policy_name: str, n: int = 4):
    return text_record(
        prompt_ids=[[5, 6, 7]] * n,
        response_ids=[[8, 9]] * n,
        rollout_logprobs=[[0.0, 0.0]] * n,
        policy=[policy_name] * n,
        uid=list(range(n)),
        pad_id=0,
    )


def test_adapters_share_one_base_and_train_separately(marl_config):
    _, pols, shared = make_pair(marl_config)
    speaker, listener = pols["speaker"], pols["listener"]
    assert len(shared) == 1 and speaker.model is listener.model
    s_params = {id(p) for g in speaker.optimizer.param_groups for p in g["params"]}
    l_params = {id(p) for g in listener.optimizer.param_groups for p in g["params"]}
    assert s_params and l_params and not (s_params & l_params)
    base_before = speaker.base_state()
    l_before = listener.trainable_state()
    s_before = speaker.trainable_state()

    b = batch("speaker")
    b["advantages"] = torch.ones(4, 2)
    update(speaker, b, AlgorithmConfig())
    s_after = speaker.trainable_state()
    assert any(not torch.equal(s_before[k], s_after[k]) for k in s_before)  # speaker moved
    assert all(torch.equal(l_before[k], v) for k, v in listener.trainable_state().items())
    base_after = speaker.base_state()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)


def test_reference_is_the_base_and_adapters_differ(marl_config):
    _, pols, _ = make_pair(marl_config)
    speaker, listener = pols["speaker"], pols["listener"]
    b = batch("speaker")
    b["advantages"] = torch.ones(4, 2)
    ref = speaker.ref_logprobs(b)
    update(speaker, b, AlgorithmConfig())
    assert torch.allclose(speaker.ref_logprobs(b), ref)  # adapters off: the untouched base
    with torch.no_grad():
        s_lp = speaker.logprobs(b)[0]
        l_lp = listener.logprobs(b)[0]  # listener adapter untrained (B = 0): equals the base
    assert not torch.allclose(s_lp, ref)
    assert torch.allclose(l_lp, ref, atol=1e-6)


def test_checkpoint_and_export_hold_one_adapter(marl_config, tmp_path):
    _, pols, _ = make_pair(marl_config)
    speaker = pols["speaker"]
    state = speaker.state_dict()
    assert state["weights"] and all(".speaker." in k for k in state["weights"])
    speaker.load_state_dict(state)
    out = speaker.export(tmp_path / "speaker")
    files = {p.name for p in out.iterdir()}
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    assert "model.safetensors" not in files  # the adapter only, not the base
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(speaker.cfg.model)
    loaded = PeftModel.from_pretrained(base, out)  # loadable as exported, no subfolder
    theirs = {
        k.replace(".default.", ".speaker."): v
        for k, v in loaded.state_dict().items()
        if "lora_" in k
    }
    assert theirs.keys() == speaker.trainable_state().keys()
    for k, v in speaker.trainable_state().items():
        assert torch.equal(theirs[k], v), k
