"""The engine's routing capture (core/train/moe.py) leaves no hook on the routers after a generate
call, also one that raises mid-decode (issue 32): the policy's module is the trainer's in
local mode, so a stale hook would capture (and keep alive) every later forward."""

from __future__ import annotations

import pytest

from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.rollout.engine import HFEngine, Request, SamplingParams
from polyrl.core.train.moe import routers
from tests.helpers.trainer import chat_ids, make_policy


class Broken(RuntimeError):
    pass


def test_a_generate_call_that_raises_mid_decode_leaves_no_hooks(tmp_path, one_thread):
    policy = make_policy(str(tiny_qwen3_moe(tmp_path / "moe", num_layers=2)))
    seen: list[int] = []

    def sink(sample, tok, lp, top):  # a streaming client that fails at the third token
        seen.append(tok)
        if len(seen) == 3:
            raise Broken("the client went away")

    prompt = chat_ids(policy.tokenizer)[0]
    params = SamplingParams(n=1, max_new_tokens=8, stop_token_ids=[])
    engine = HFEngine(policy, seed=0)
    with pytest.raises(Broken):
        engine.generate([Request(prompt, on_token=sink)], params)
    assert len(seen) == 3  # it raised inside the decode loop, after forwards with hooks on
    assert len(routers(policy.model)) == 2
    assert all(not r._forward_hooks for r in routers(policy.model))
    # the next call records its experts as usual, and leaves no hook either
    (out,) = engine.generate([prompt], params)
    experts = (out.prompt + out.tokens).experts  # prompt then response
    assert experts is not None and experts.shape[0] == len(prompt) + len(out.token_ids)
    assert all(not r._forward_hooks for r in routers(policy.model))
