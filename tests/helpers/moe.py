"""A hand-built reference for MoE routing: a forward whose routers are told the experts."""

from __future__ import annotations

import torch

from polyrl.core.moe import routers


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
