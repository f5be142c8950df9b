"""The engine's routing capture (core/moe.py) leaves no hook on the routers after a generate
call, also one that raises mid-decode (issue 32): the policy's module is the trainer's in
local mode, so a stale hook would capture (and keep alive) every later forward. And how a
multi-turn trajectory row's experts are stitched from its calls' (``moe.stitch_experts``)."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.engine import HFEngine, Request, SamplingParams
from polyrl.core.moe import routers
from polyrl.core.tiny import tiny_qwen3_moe
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
    assert out.experts is not None and out.experts.shape[0] == len(prompt) + len(out.token_ids)
    assert all(not r._forward_hooks for r in routers(policy.model))


def test_stitched_row_takes_each_tokens_experts_from_the_first_call_that_routed_it():
    """A trajectory row of two calls (hand-built experts, 1 layer, top-1): the first call's
    prompt and action, the second's for what only it routed; -1 where none did."""
    from polyrl.core.moe import stitch_experts

    def ex(*rows):
        return torch.tensor(rows, dtype=torch.int8).reshape(-1, 1, 1)

    row = [5, 6, 7, 8, 9, 10, 11]  # prompt 5 6, action 7 8, observation 9, action 10 11
    first = ([5, 6, 7, 8], ex(0, 1, 2, -1))  # its last token never fed: -1
    second = ([5, 6, 7, 8, 9, 10, 11], ex(3, 3, 3, 1, 2, 0, -1))  # routed 8 and 9 too
    got = stitch_experts(row, [first, second])
    assert got is not None and got.flatten().tolist() == [0, 1, 2, 1, 2, 0, -1]
    assert stitch_experts(row, [(first[0], None), second]).flatten().tolist() == [
        3, 3, 3, 1, 2, 0, -1,
    ]  # fmt: skip
    assert stitch_experts(row, [(first[0], None)]) is None
    with pytest.raises(ValueError, match="call 0's 4 ids"):
        stitch_experts(row, [([5, 6, 7, 9], first[1])])
