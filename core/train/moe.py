"""Mixture-of-experts routing: what the engine chose, recorded and replayed in the trainer.

An MoE layer's router sends each token to its top-k experts. The engine and the trainer
run the same weights through different kernels and batch shapes, so a near tie can fall
the other way: the token goes to other experts and the trainer's log-prob of a sampled
token drifts from the engine's (the failure mode that makes MoE RL runs collapse).
Routing replay records the engine's choices per token and layer and has the trainer's
passes route every recorded token to those experts, with the weights recomputed from the
router's own softmax at them, so the router still gets gradients.

Both work through forward hooks on the router modules (a forward hook's return value
replaces the module's output, a supported torch API). Routers are the modules following
transformers' top-k router convention (Qwen2/3-MoE, Mixtral, OLMoE, ...): a class named
``*TopKRouter`` with ``top_k``, ``num_experts`` and ``weight``, whose forward returns
``(logits [N, E], scores [N, k], indices [N, k])`` over the N tokens of its input, the
scores being the softmax over all experts at the chosen ones (renormalised to sum 1 when
``norm_topk_prob``). Tested on Qwen3-MoE.

Layout. Experts are int8 (int16 from 128 experts) tensors ``[tokens, layers, k]``, -1
where no choice was recorded (the router then routes freely), a token segment's
``experts`` (``core/segment.py``: a completion's prompt and its sampled tokens); the
record holds them as ``prompt_experts [B, P, L, k]`` (left-padded like ``prompt_ids``) and
``response_experts [B, R, L, k]`` (right-padded). The prompt's tokens are recorded too:
the response's log-probs attend to the prompt's keys and values, which depend on how the
prompt's tokens were routed in every earlier layer, and an engine's prefill (another
kernel, batch or padding) need not route them as the trainer would. A response's last
token is never fed to the engine, so its row is -1 (nothing the trainer scores reads it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from tensordict import TensorDict

from polyrl.core.config import NONNEGATIVE, UserError, doc
from polyrl.core.train.router_terms import PROMPT, RESPONSE, RouterTerms

EXPERT_COLUMNS = ("prompt_experts", "response_experts")


@dataclass
class MoeConfig:
    """A policy's mixture-of-experts options (``policies.<n>.moe``; dense models ignore them)."""

    replay: Literal["off", "rollout"] = doc(
        "off",
        "routing replay: rollout routes every token of the trainer's log-prob and update "
        "passes to the experts the engine chose (the record's prompt_experts / "
        "response_experts; an engine that cannot record them is an error); off: the "
        "trainer's router chooses",
    )
    aux_loss_coef: float = doc(
        0.0,
        "weight of the load-balancing loss (Switch-style: E * sum_e f_e * P_e per MoE "
        "layer, averaged over layers; 1 when balanced) added to the update's loss; 0: off "
        "(it is still reported as moe/aux_loss)",
        bound=NONNEGATIVE,
    )


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules, in layer order (empty for a dense model)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.lower().endswith("topkrouter")
        and hasattr(m, "top_k")
        and hasattr(m, "num_experts")
    ]


def expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed int type holding every expert index and -1."""
    return torch.int8 if num_experts <= 127 else torch.int16


def replay_scores(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The weights the router gives experts ``idx`` [N, k]: its softmax over all experts at
    them, renormalised to sum 1 if the router does (what its own forward computes for its
    own top-k), differentiable in ``logits``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, idx)
    if getattr(router, "norm_topk_prob", False):
        scores = scores / scores.sum(-1, keepdim=True)
    return scores.to(logits.dtype)


class Routing:
    """Forward hooks on every router of ``model`` while open (a ``with`` block, or
    :meth:`open` / :meth:`close`).

    Every forward through the model is one *step*. Before one, :meth:`plan` may give its
    tokens' recorded experts (``[N, L, k]``, N the forward's tokens in ``input_ids``
    order, -1 rows unrecorded) and kinds (``where`` [N]: PAD, PROMPT, RESPONSE). With
    ``replay`` each recorded token is routed to its recorded experts. Per step the hooks
    keep each layer's own top-k (the router's choice, before replay), the experts used and,
    with ``keep_logits``, the router logits (with their graph, for the loss); an engine
    takes each step's experts (:meth:`take`), a log-prob pass hands all its steps to its
    caller (:meth:`terms`). Hooks act only in the thread that opened them (an engine in a
    background thread may share the module).
    """

    def __init__(
        self, model: torch.nn.Module, *, replay: bool = False, keep_logits: bool = False
    ) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("Routing: the model has no top-k router modules (not an MoE model)")
        first = self.routers[0]
        self.num_layers, self.top_k = len(self.routers), int(cast(int, first.top_k))
        self.num_experts = int(cast(int, first.num_experts))
        self.dtype = expert_dtype(self.num_experts)
        self.replay, self.keep_logits = replay, keep_logits
        self.steps: list[dict[str, Any]] = []
        self._plan: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self._handles: list[Any] = []
        self._thread: int | None = None

    # --- hooks --------------------------------------------------------------------------
    def open(self) -> Routing:
        self._thread = threading.get_ident()
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._thread = [], None

    def __enter__(self) -> Routing:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _hook(self, layer: int) -> Callable[[torch.nn.Module, Any, Any], Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if threading.get_ident() != self._thread:
                return None
            logits, _scores, own = output
            if layer == 0:  # the first router of a forward opens its step
                self.steps.append({"own": [], "used": [], "logits": [], "plan": self._plan})
                self._plan = (None, None)
            step = self.steps[-1]
            recorded = step["plan"][0]
            used = own
            if self.replay and recorded is not None:
                want = recorded[:, layer].to(device=own.device, dtype=own.dtype)
                if want.shape != own.shape:
                    raise ValueError(
                        f"routing replay: layer {layer} routes {tuple(own.shape)} tokens x "
                        f"experts, the plan has {tuple(want.shape)}"
                    )
                rec = (want >= 0).all(-1, keepdim=True)
                used = torch.where(rec, want, own)
                output = (logits, replay_scores(module, logits, used), used)
            step["own"].append(own.detach().to(self.dtype))
            step["used"].append(used.detach().to(self.dtype))
            if self.keep_logits:
                step["logits"].append(logits)
            return output

        return hook

    # --- what callers give and take --------------------------------------------------------
    def plan(self, experts: torch.Tensor | None, where: torch.Tensor | None) -> None:
        """The next forward's tokens: recorded experts ``[..., L, k]`` (or None) and kinds
        ``[...]`` (or None: every token real), flattened in ``input_ids`` order."""
        if experts is not None:
            experts = experts.reshape(-1, self.num_layers, self.top_k)
        self._plan = (experts, None if where is None else where.reshape(-1))

    def take(self) -> torch.Tensor:
        """The experts the last forward used, ``[N, L, k]`` (and forget the step)."""
        step = self.steps.pop()
        return torch.stack(step["used"], 1)

    def terms(self) -> RouterTerms:
        """What the forwards so far leave for the trainer's router loss and metrics: every
        step, as the pass's own value (the hooks keep nothing after this)."""
        steps, self.steps = self.steps, []
        return RouterTerms(steps, self.num_layers, self.num_experts, self.dtype, self.keep_logits)


# --- the engine side -------------------------------------------------------------------------
@contextmanager
def recording(model: torch.nn.Module) -> Iterator[Routing | None]:
    """A capturing :class:`Routing` on ``model`` for one engine generate call (None: a dense
    model), closed when the call ends, also when it raises: no hook outlives its call."""
    if not routers(model):
        yield None
        return
    routing = Routing(model).open()
    try:
        yield routing
    finally:
        routing.close()


# --- the record side (the trainer's passes read the record's expert columns) -----------------
def has_experts(batch: TensorDict) -> bool:
    keys = set(batch.keys())
    return all(c in keys for c in EXPERT_COLUMNS)


def token_layout(batch: TensorDict) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The batch's recorded experts ``[B, P+R, L, k]`` (None without them) and token kinds
    ``[B, P+R]``, laid out as the padded pass's ``cat([prompt_ids, response_ids], 1)``."""
    where = torch.cat(
        [batch["prompt_mask"].long() * PROMPT, batch["response_mask"].long() * RESPONSE], 1
    )
    if not has_experts(batch):
        return None, where
    for key, ids in zip(EXPERT_COLUMNS, ("prompt_ids", "response_ids"), strict=True):
        if batch[key].shape[:2] != batch[ids].shape:
            raise ValueError(
                f"record column {key} is {tuple(batch[key].shape[:2])} rows x tokens but "
                f"{ids} is {tuple(batch[ids].shape)}: a part that reshaped the record's "
                "token columns left the experts out (see core/record.py PROMPT_COLUMNS)"
            )
    return torch.cat([batch["prompt_experts"], batch["response_experts"]], 1), where


def scatter_layout(
    experts: torch.Tensor | None,
    where: torch.Tensor,
    mask: torch.Tensor,
    bins: torch.Tensor,
    cols: torch.Tensor,
    shape: tuple[int, ...],
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`token_layout` moved to a packed input of ``shape`` (bins x width): the real
    tokens (``mask``, row-major) go to ``(bins, cols)``, one entry per real token, as the
    packed ids do; fillers are PAD, unrecorded."""
    out_where = torch.zeros(shape, dtype=torch.long, device=where.device)
    out_where[bins, cols] = where[mask]
    if experts is None:
        return None, out_where
    out = torch.full((*shape, *experts.shape[2:]), -1, dtype=experts.dtype, device=experts.device)
    out[bins, cols] = experts[mask]
    return out, out_where


def check_replay(policy: str, batch: TensorDict, routing: Routing) -> None:
    """``replay: rollout`` needs the record's expert columns, of this model's shape."""
    if not has_experts(batch):
        raise UserError(
            f"policies.{policy}.moe.replay is 'rollout' but the record has no "
            "prompt_experts/response_experts columns: the engine did not record its experts "
            "(engine.name: hf records them; other engines may not), or the workflow dropped "
            "them. Use an engine that records experts, or set moe.replay: off"
        )
    shape = tuple(batch["response_experts"].shape[2:])
    if shape != (routing.num_layers, routing.top_k):
        raise UserError(
            f"policies.{policy}.moe.replay: the record's response_experts hold {shape[0]} "
            f"layers x top-{shape[1]}, but the model has {routing.num_layers} MoE layers "
            f"with top-{routing.top_k}: the experts were recorded by another model"
        )
