"""What a log-prob pass hands back to its caller: log-probs, entropy and, for a
mixture-of-experts model, the pass's routing (:class:`RouterTerms`), from which the
trainer computes the load-balancing loss and router metrics.

A pass returns these instead of leaving them on the policy for a later call to pick up, so
what the loss of one micro-batch uses is what that micro-batch's own pass produced. The
hooks that fill them are :class:`polyrl.core.train.moe.Routing`'s; this module holds only the
values (no import of the rest of the core, so the policy protocols can name them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# token kinds in a plan's ``where``: padding or packing filler, prompt, response
PAD, PROMPT, RESPONSE = 0, 1, 2


@dataclass(frozen=True)
class RouterTerms:
    """A log-prob pass's routing, as its caller gets it back (:class:`RoutedPass`): per
    forward (*step*) each MoE layer's own top-k, the experts used (replayed or not), the
    plan it ran under (recorded experts, token kinds) and, when the pass kept them, the
    router logits with their graph (what :meth:`aux_loss` differentiates)."""

    steps: list[dict[str, Any]]
    num_layers: int
    num_experts: int
    dtype: torch.dtype
    keep_logits: bool

    def _pooled(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Over every step: own and used experts [T, L, k] and recorded ones (None if no step
        had any) of the real tokens, and their kinds [T]."""
        own, used, rec, kinds = [], [], [], []
        for step in self.steps:
            experts, where = step["plan"]
            o, u = torch.stack(step["own"], 1), torch.stack(step["used"], 1)
            w = (
                torch.ones(o.shape[0], dtype=torch.long, device=o.device)
                if where is None
                else where
            )
            real = w.to(o.device) > PAD
            own.append(o[real])
            used.append(u[real])
            kinds.append(w.to(o.device)[real])
            if experts is not None:
                rec.append(experts.to(o.device)[real].to(self.dtype))
            else:
                rec.append(torch.full_like(o[real], -1))
        recorded = torch.cat(rec) if any(bool((r >= 0).any()) for r in rec) else None
        return torch.cat(own), torch.cat(used), recorded, torch.cat(kinds)

    def aux_loss(self) -> torch.Tensor:
        """Switch Transformer's load-balancing loss for top-k, over the real tokens of every
        step: per MoE layer ``E * sum_e f_e * P_e``, with ``f_e`` the share of the layer's
        ``k * T`` token-expert assignments that went to expert e (as routed, replayed or
        not) and ``P_e`` the mean router probability of e; averaged over layers. 1 for a
        uniform router; the gradient flows through ``P``. (transformers'
        ``load_balancing_loss_func`` pools the layers and sums the k slots: k at balance.)"""
        if not self.keep_logits:
            raise RuntimeError("RouterTerms.aux_loss needs a pass that kept the router logits")
        per_layer = []
        for layer in range(self.num_layers):
            probs, counts = [], []
            for step in self.steps:
                where = step["plan"][1]
                logits = step["logits"][layer]
                real = (
                    torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
                    if where is None
                    else where.to(logits.device) > PAD
                )
                probs.append(torch.softmax(logits[real].float(), -1))
                used = step["used"][layer][real].long()
                counts.append(torch.nn.functional.one_hot(used, self.num_experts).sum((0, 1)))
            p = torch.cat(probs).mean(0)
            f = torch.stack(counts).sum(0).float()
            f = f / f.sum().clamp(min=1)
            per_layer.append(self.num_experts * (f * p).sum())
        return torch.stack(per_layer).mean()

    def metrics(self) -> dict[str, float]:
        """Router metrics of the steps: per layer the busiest expert's load relative to a
        balanced one (``moe/load_max/l<i>``: E * max_e f_e, 1 = balanced; each expert's share
        ``moe/load/l<i>/e<j>`` too when there are at most 64 of them in all), and where
        experts were recorded the share of response (and prompt) tokens whose own top-k set
        differs from the recorded one in at least one layer (``moe/route_mismatch``,
        ``moe/route_mismatch_prompt``)."""
        if not self.steps:
            return {}
        own, used, recorded, kinds = self._pooled()
        out: dict[str, float] = {}
        e = self.num_experts
        for layer in range(self.num_layers):
            counts = torch.bincount(used[:, layer].reshape(-1).long(), minlength=e)[:e].float()
            share = counts / counts.sum().clamp(min=1)
            out[f"moe/load_max/l{layer}"] = float(e * share.max())
            if self.num_layers * e <= 64:
                for j in range(e):
                    out[f"moe/load/l{layer}/e{j}"] = float(share[j])
        if recorded is not None:
            has = (recorded >= 0).all(-1).all(-1)  # tokens recorded in every layer
            differs = (own.sort(-1).values != recorded.sort(-1).values).any(-1).any(-1)
            for name, kind in (
                ("moe/route_mismatch", RESPONSE),
                ("moe/route_mismatch_prompt", PROMPT),
            ):
                sel = has & (kinds == kind)
                if bool(sel.any()):
                    out[name] = float(differs[sel].float().mean())
        return out


@dataclass(frozen=True)
class RoutedPass:
    """A log-prob pass's result: log-probs (and entropy) of the response tokens and, for a
    mixture-of-experts model, the pass's :class:`RouterTerms` (None: dense, or a kind whose
    passes do not route), what the load-balancing loss and router metrics are made of."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    router: RouterTerms | None = None
