"""Image requests beside token requests: one record of token and trajectory rows, and the
batcher serving a painter's waiting requests in one call."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import TensorDict

from polyrl.core.interfaces import EngineCaps
from polyrl.core.record import Row, build_rows, select_policy, set_strings, strings
from polyrl.core.rollout.batching import Batcher
from polyrl.core.rollout.paint import ImageRequest, Painting, merge_records, paints_images
from polyrl.core.segment import Tokens


def _text_record() -> TensorDict:
    rows = [
        Row(Tokens.given([5, 6, 7]), Tokens.sampled([8, 9], [-0.5, -0.25]), "writer", 1),
        Row(Tokens.given([5]), Tokens.sampled([4, 3, 2, 1], [-1.0] * 4), "writer", 2),
    ]
    return build_rows(rows, pad_id=0)


def _trajectory_record(b: int = 3, n: int = 5) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    td = TensorDict(
        {
            "latents": torch.randn((b, n + 1, 4, 2, 2), generator=g),
            "rollout_logprobs": torch.randn((b, n), generator=g),
            "loss_mask": torch.ones((b, n), dtype=torch.long),
            "response_mask": torch.ones((b, n), dtype=torch.long),
            "noise_mask": torch.ones((b, n), dtype=torch.bool),
            "uid": torch.arange(b),
            "agent_id": torch.ones(b, dtype=torch.long),
            "turn": torch.zeros(b, dtype=torch.long),
            "node": -torch.ones(b, dtype=torch.long),
            "reward": torch.full((b,), float("nan")),
            "valid": torch.zeros(b, dtype=torch.bool),
            "truncated": torch.zeros(b, dtype=torch.bool),
        },
        batch_size=[b],
    )
    for key, value in (("policy", "painter"), ("prompt_text", "red"), ("error", "")):
        set_strings(td, key, [value] * b)
    set_strings(td, "sampler", ["flow_sde"] * b)
    set_strings(td, "meta", [{"k": i} for i in range(b)])
    return td


def test_merge_keeps_each_kind_and_select_trims_back():
    text, paint = _text_record(), _trajectory_record()
    merged = merge_records([text, paint])
    assert merged.batch_size[0] == 5
    # text rows: zero latents, "" sampler; painter rows: no prompt tokens
    assert bool((merged["latents"][:2] == 0).all())
    assert strings(merged, "sampler") == ["", "", "flow_sde", "flow_sde", "flow_sde"]
    assert int(merged["prompt_mask"][2:].sum()) == 0
    assert strings(merged, "meta")[2:] == [{"k": 0}, {"k": 1}, {"k": 2}]
    # a policy's rows, trimmed, are its own record's columns exactly
    for own, name in ((text, "writer"), (paint, "painter")):
        got = select_policy(merged, name)
        for key in own.keys():  # noqa: SIM118 (TensorDict)
            if isinstance(own[key], torch.Tensor):
                assert torch.equal(got[key].nan_to_num(-7.0), own[key].nan_to_num(-7.0)), key
            else:
                assert strings(got, key) == strings(own, key), (name, key)


def test_merge_refuses_rows_of_other_shapes():
    a, b = _trajectory_record(), _trajectory_record()
    b["latents"] = torch.zeros((3, 6, 4, 3, 3))
    with pytest.raises(ValueError, match="latents"):
        merge_records([a, b])


class Painter:
    """An engine that paints a flat image per request, counting its calls."""

    caps = EngineCaps(paints_images=True)

    def __init__(self) -> None:
        self.calls: list[list[ImageRequest]] = []

    def paint(self, requests):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            row = TensorDict({"latents": torch.zeros((1, 2))}, batch_size=[1])
            out.append(
                [Painting(torch.full((3, 2, 2), len(r.prompt) / 10), row) for _ in range(r.n)]
            )
        return out

    def prompt_limit(self) -> int:
        return 8

    def generate(self, prompts, params):
        raise AssertionError("an image request never reaches generate")

    def sync(self) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class TextEngine:
    def generate(self, prompts, params):
        raise AssertionError("not called")


def test_batcher_serves_waiting_image_requests_in_one_call():
    painter = Painter()
    assert paints_images(painter) and not paints_images(TextEngine())
    batcher = Batcher({"painter": painter, "writer": TextEngine()}, in_thread=False)

    async def episode(prompt: str, n: int):
        return await batcher.paint("painter", ImageRequest(prompt, n=n))

    async def main():
        tasks = [asyncio.ensure_future(episode(p, n)) for p, n in (("red", 2), ("blue", 3))]
        await batcher.drive(tasks)
        return [t.result() for t in tasks]

    got = asyncio.run(main())
    assert len(painter.calls) == 1 and [r.prompt for r in painter.calls[0]] == ["red", "blue"]
    assert [len(g) for g in got] == [2, 3]
    assert float(got[1][0].image[0, 0, 0]) == pytest.approx(0.4)

    async def refused():
        await batcher.paint("writer", ImageRequest("red"))

    with pytest.raises(TypeError, match="paints no images"):
        asyncio.run(refused())
    with pytest.raises(ValueError, match="n >= 1"):
        ImageRequest("red", n=0)
