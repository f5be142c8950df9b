"""A hand-built reference for MoE routing: a forward whose routers are told the experts, and
the checks of engine rows' recorded experts against it."""

from __future__ import annotations

import torch

from polyrl.core.train.moe import routers


class Routed(torch.nn.Module):
    """A router that sends token i to ``experts[i]`` (-1: its own top-k), weighted by the
    original router's softmax there, renormalised (the tiny model's ``norm_topk_prob``):
    built from the router's weight alone. Keeps its own clean top-k in ``own``."""

    def __init__(self, router: torch.nn.Module, experts: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.experts = router.weight, experts.long()
        self.own: torch.Tensor | None = None

    def forward(self, x: torch.Tensor):
        logits = x.reshape(-1, x.shape[-1]) @ self.weight.T
        probs = torch.softmax(logits.float(), -1)
        self.own = probs.topk(self.experts.shape[-1], -1).indices
        idx = torch.where(self.experts >= 0, self.experts, self.own)
        scores = probs.gather(-1, idx)
        return logits, scores / scores.sum(-1, keepdim=True), idx


def replayed(model, ids: list[int], experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-softmax over ``ids`` with every token routed to ``experts`` [N, L, k] by hand,
    and the clean routers' own top-k [N, L, k]."""
    blocks = [m for m in model.modules() if getattr(m, "gate", None) in routers(model)]
    saved = [b.gate for b in blocks]
    told = [Routed(r, experts[:, layer]) for layer, r in enumerate(saved)]
    try:
        for b, t in zip(blocks, told, strict=True):
            b.gate = t
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    finally:
        for b, r in zip(blocks, saved, strict=True):
            b.gate = r
    return torch.log_softmax(logits, -1), torch.stack([t.own for t in told], 1)


def record_rows(rec) -> list[tuple[list[int], int, torch.Tensor]]:
    """Per record row: its tokens (prompt + response, unpadded), prompt length and recorded
    experts [tokens, L, k]."""
    out = []
    for i in range(rec.batch_size[0]):
        pm, rm = rec["prompt_mask"][i].bool(), rec["response_mask"][i].bool()
        tokens = rec["prompt_ids"][i][pm].tolist() + rec["response_ids"][i][rm].tolist()
        experts = torch.cat([rec["prompt_experts"][i][pm], rec["response_experts"][i][rm]])
        out.append((tokens, int(pm.sum()), experts))
    return out


def check_replayed_rows(policy, rec, num_experts: int) -> None:
    """``rec``'s rows (all ``policy``'s, each with a response) as engine rows of an MoE
    policy under ``moe.replay: rollout``: every token but each row's last carries the
    experts a whole-row forward's routers choose (the last was never fed to the engine:
    -1); replay of those gives the engine's log-probs; replay of other experts gives a
    forward told them (and other log-probs)."""
    keys = set(rec.keys())
    assert {"prompt_experts", "response_experts"} <= keys, sorted(keys)
    layers, k = rec["response_experts"].shape[2:]
    for tokens, _, experts in record_rows(rec):
        assert experts.shape == (len(tokens), layers, k)
        _, own = replayed(policy.model, tokens, torch.full_like(experts, -1))
        assert bool((experts[-1] == -1).all())
        assert bool((experts[:-1] >= 0).all())  # every other token: some call routed it
        assert torch.equal(experts[:-1].long().sort(-1).values, own[:-1].sort(-1).values)
    lm = rec["loss_mask"].bool() & rec["response_mask"].bool()
    with torch.no_grad():
        got = policy.logprobs(rec)[0]
    assert bool(lm.any())
    torch.testing.assert_close(got[lm], rec["rollout_logprobs"][lm], atol=1e-5, rtol=0)

    gen = torch.Generator().manual_seed(0)
    moved = rec.clone()
    for key in ("prompt_experts", "response_experts"):
        ex = moved[key]
        rand = torch.rand((*ex.shape[:-1], num_experts), generator=gen).topk(k, -1).indices
        moved[key] = torch.where(ex >= 0, rand.to(ex.dtype), ex)
    with torch.no_grad():
        got = policy.logprobs(moved)[0]
    changed = 0.0
    for i, (tokens, p, experts) in enumerate(record_rows(moved)):
        lsm, _ = replayed(policy.model, tokens, experts)
        r = len(tokens) - p
        want = lsm[p - 1 : -1].gather(-1, torch.tensor(tokens[p:])[:, None]).squeeze(-1)
        torch.testing.assert_close(got[i, :r].double(), want, atol=1e-5, rtol=0)
        changed = max(changed, float((want - rec["rollout_logprobs"][i, :r]).abs().max()))
    assert changed > 1e-3  # the other experts do change the log-probs
