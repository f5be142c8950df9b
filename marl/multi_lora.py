"""Several LoRA adapters of one shared PEFT model in ONE forward: each row (each token)
through its own adapter. The one per-row LoRA router of PolyRL: generation (an engine's
prefill and decode steps over rows of several ``lora_agent`` policies, the tinker service's
sampling) and training (``lora_agent``'s batched update, the tinker service's passes).

PEFT's own mixed batches (``adapter_names=``) refuse training mode, so this is built from
supported parts: inside the context every LoRA layer runs its base layer only
(``enable_adapters(False)``), and a forward hook on each layer adds each routed adapter's
term to that adapter's tokens, in place, with each LoRA product one batched product over
the adapters (:class:`_StackedTerms`; adapters with dropout in training take PEFT's own
modules). A token's LoRA term is then its own adapter's, and the gradient of adapter ``k``
comes only from its own tokens -- the per-adapter pass's, summed into one backward. The
LoRA work is that of the tokens routed, whatever the number of adapters; without
gradients (generation) the same products run, nothing is kept for a backward.

Which adapter a token belongs to travels once, as each row's adapter index:

* :meth:`Router.set_rows`: row ``i`` runs through ``names[rows[i]]``. A forward whose
  input rows are the batch's rows (a generation's prefill and decode steps, a padded pass)
  reads it as is.
* Packed and prefix-sharing passes lay several rows out in one input row: they read the
  rows' adapters (``Router.rows``, :class:`polyrl.core.train.passes.RowOwners`) to keep adapters
  apart in their layout (no shared prefix, packed row or prompt cache spans two: a
  prefix's activations depend on the adapter) and tell :meth:`Router.plan` each forward's
  adapter of every input token.

    with adapter_rows(peft_model, ["speaker", "listener"]) as router:
        router.set_rows(torch.tensor([0, 0, 1]))       # rows 0, 1: speaker; row 2: listener
        out = peft_model(input_ids=ids, attention_mask=mask)
        logp, _ = response_logprobs(peft_model, batch, pack=True, owners=router)

A layer that sees fewer positions than the input (an LM-head LoRA under
``logits_to_keep``) gives each row's kept positions the row's adapter, where every input
row has one. Leaving the context turns the layers' adapters back on; the autograd graph
built inside stays valid, so the backward may run after it (the ``trainable`` adapters'
weights keep requiring grad for it). Not supported (refused): LoRA variants (DoRA),
non-Linear LoRA layers (embeddings, convolutions), and gradient checkpointing (its
recompute would run the hooks again after the routing moved on).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


class _Grouping:
    """The tokens of one forward's layer input grouped by adapter: the order that sorts
    them by adapter (None: already sorted), its inverse, the tokens per adapter, and the
    stacked layouts of :class:`_StackedTerms` (shared by every layer of that shape)."""

    def __init__(self, owners: torch.Tensor, adapters: int) -> None:
        flat = owners.reshape(-1)
        self.order: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        if len(flat) > 1 and not bool((flat[1:] >= flat[:-1]).all()):
            self.order = torch.argsort(flat, stable=True)
            self.inverse = torch.empty_like(self.order)
            self.inverse[self.order] = torch.arange(len(flat), device=flat.device)
        self.counts: list[int] = torch.bincount(flat, minlength=adapters).tolist()
        self._slots: dict[tuple, tuple] = {}

    def slots(self, present: tuple[int, ...], device: torch.device) -> tuple:
        """Where each token of the adapters ``present`` sits in the stacked ``[adapter,
        position]`` layout of :class:`_StackedTerms`: (input rows, stack index, position,
        longest count, whether the stack is a plain view of the tokens)."""
        key = (present, device)
        if key not in self._slots:
            counts, order = self.counts, self.order
            starts = [0]
            for n in counts[:-1]:
                starts.append(starts[-1] + n)
            rows = torch.cat([torch.arange(starts[k], starts[k] + counts[k]) for k in present])
            stack = torch.cat([torch.full((counts[k],), j) for j, k in enumerate(present)])
            pos = torch.cat([torch.arange(counts[k]) for k in present])
            longest = max(counts[k] for k in present)
            total = sum(counts)
            view = order is None and len(rows) == total and longest * len(present) == total
            if order is not None:
                rows = order.cpu()[rows]
            self._slots[key] = (
                rows.to(device),
                stack.to(device),
                pos.to(device),
                longest,
                view,
            )
        return self._slots[key]


class Router:
    """The routing state of one :func:`adapter_rows` context (see the module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._rows: torch.Tensor | None = None
        self._plan: torch.Tensor | None = None  # the next forward's per-token adapters
        self._owners: torch.Tensor | None = None  # the current forward's, [rows, width]
        self._groups: dict[tuple[int, ...], _Grouping | None] = {}  # by layer input shape

    @property
    def rows(self) -> torch.Tensor | None:
        """Each row's adapter index (into ``names``), as :meth:`set_rows` gave it."""
        return self._rows

    def set_rows(self, rows: torch.Tensor | Sequence[int]) -> None:
        """Per-row adapter indices (into ``names``) for the following forwards."""
        self._rows = self._checked(torch.as_tensor(rows, dtype=torch.long))

    def plan(self, owners: torch.Tensor) -> None:
        """The next forward's adapter of every input token ``[rows, width]`` (a packed
        pass's layout: :class:`polyrl.core.train.passes.RowOwners`); one forward uses it."""
        self._plan = self._checked(owners.long())

    def _checked(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= len(self.names)):
            raise ValueError(
                f"adapter_rows: row adapter ids must lie in [0, {len(self.names)}) for "
                f"adapters {self.names}; got {sorted(set(ids.reshape(-1).tolist()))}"
            )
        return ids

    # --- hooks ----------------------------------------------------------------------------
    def _route(self, shape: tuple[int, ...], device: torch.device) -> None:
        """Each token's adapter for a forward whose input is ``shape`` (rows, width)."""
        plan, self._plan = self._plan, None
        if plan is not None:
            if tuple(plan.shape) != shape:
                raise ValueError(
                    f"adapter_rows: a forward over {shape} tokens, but the pass planned "
                    f"{tuple(plan.shape)} (Router.plan)"
                )
            owners = plan.to(device)
        else:
            if self._rows is None or len(self._rows) != shape[0]:
                raise ValueError(
                    f"adapter_rows: a forward over {shape[0]} rows, but "
                    f"{'no' if self._rows is None else len(self._rows)} per-row adapter ids "
                    "were set (Router.set_rows)"
                )
            owners = self._rows.to(device)[:, None].expand(shape)
        self._owners = owners
        self._groups = {shape: _Grouping(owners, len(self.names))}

    def _model_pre_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        given = kwargs.get("input_ids")
        if given is None:
            given = kwargs.get("inputs_embeds")
        if given is None and args and isinstance(args[0], torch.Tensor):
            given = args[0]
        if given is None:
            raise ValueError("adapter_rows: the model was called without input_ids")
        self._route(tuple(given.shape[:2]), given.device)

    def _grouping(self, shape: tuple[int, ...]) -> _Grouping | None:
        """The grouping of a layer input of ``shape``: the forward's tokens, or each row's
        last positions (an LM head under ``logits_to_keep``) where every input row has
        one adapter; None when the tokens cannot be told."""
        if shape not in self._groups:
            owners, group = self._owners, None
            rows_alike = (
                owners is not None
                and len(shape) == 2
                and shape[0] == owners.shape[0]
                and bool((owners == owners[:, :1]).all())  # one adapter per input row
            )
            if owners is not None and rows_alike:
                group = _Grouping(owners[:, :1].expand(shape), len(self.names))
            self._groups[shape] = group
        return self._groups[shape]

    def _add_terms(self, slots: list[tuple[int, str]]):
        """A forward hook on a LoRA layer (its adapters disabled: the output is the base
        layer's) that adds each adapter's term to its own tokens only
        (:class:`_StackedTerms`: in place, each product one batched product over the
        adapters). A layer whose adapters drop out in training takes the autograd path
        (:meth:`_terms_by_autograd`)."""
        here = dict(slots)

        def hook(module, args, out):
            x = args[0]
            group = self._grouping(tuple(x.shape[:-1]))
            if group is None:
                raise ValueError(
                    f"adapter_rows: a LoRA layer saw tokens of shape {tuple(x.shape[:-1])}, "
                    f"the model's input was {tuple(self._owners.shape)}"
                    if self._owners is not None
                    else "adapter_rows: a LoRA layer ran before the model's forward"
                )
            drops = [module.lora_dropout[n] for n in here.values()]
            dropping = any(not isinstance(d, torch.nn.Identity) and d.training for d in drops)
            if dropping or x.dtype != out.dtype or not out.is_contiguous():
                return self._terms_by_autograd(module, here, x, out, group)
            present = [k for k, n in enumerate(group.counts) if n and k in here]
            if not present:
                return out
            pairs = [
                w
                for k in present
                for w in (module.lora_A[here[k]].weight, module.lora_B[here[k]].weight)
            ]
            rates = torch.tensor([float(module.scaling[here[k]]) for k in present])
            slots = group.slots(tuple(present), x.device)
            return _StackedTerms.apply(out, x, slots, rates.to(x.device), *pairs)

        return hook

    def _terms_by_autograd(self, module, here: dict[int, str], x, out, group: _Grouping):
        """The terms through PEFT's own modules (dropout, dtype casts) and autograd: the
        tokens sorted by adapter, each adapter's slice through its dropout, A, B and
        scaling, put back in token order and added."""
        mine = x.reshape(-1, x.shape[-1])
        if group.order is not None:  # not already grouped by adapter
            mine = mine.index_select(0, group.order.to(x.device))
        terms = []
        for k, part in enumerate(mine.split(group.counts)):
            name = here.get(k)
            if not len(part):
                continue
            if name is None:
                terms.append(out.new_zeros(len(part), out.shape[-1]))
                continue
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            part = module.lora_dropout[name](part.to(lora_a.weight.dtype))
            terms.append((lora_b(lora_a(part)) * module.scaling[name]).to(out.dtype))
        term = torch.cat(terms) if len(terms) > 1 else terms[0]
        if group.inverse is not None:
            term = term.index_select(0, group.inverse.to(x.device))
        return out + term.view_as(out)


class _StackedTerms(torch.autograd.Function):
    """``out[t] += s_k * B_k A_k x[t]`` for each token ``t`` of adapter ``k``, written into
    ``out`` in place as batched products: the tokens stacked per adapter (``[adapters,
    longest count, features]``, zero-padded; a plain view when the tokens come grouped and
    every adapter has as many), the adapters' ``A`` and ``B`` stacked (a lower rank
    zero-padded to the highest), so each product of the forward and the backward is ONE
    ``bmm`` over all adapters: a fixed number of operations (kernel launches) per layer
    whatever the number of adapters, with no full-size temporaries beyond the stacks.
    ``out`` comes first: autograd's in-place bookkeeping for a view (a Linear's output over
    3-D input is one) takes the first input as the one written. Adapter weights in another
    dtype than the activations (PEFT keeps them in float32 over a bfloat16 base) get their
    tokens cast to theirs and their terms cast back, as PEFT's own layer does. ``slots``
    from :meth:`_Grouping.slots`; ``rates`` the adapters' scalings; ``pairs`` their
    ``A, B``."""

    @staticmethod
    def forward(ctx, out, x, slots, rates, *pairs):
        rows, stack, pos, longest, view = slots
        flat, xf = out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
        ranks = [w.shape[0] for w in pairs[0::2]]
        top, wdt = max(ranks), functools.reduce(torch.promote_types, [w.dtype for w in pairs])
        a = torch.stack([F.pad(w.to(wdt), (0, 0, 0, top - w.shape[0])) for w in pairs[0::2]])
        b = torch.stack([F.pad(w.to(wdt), (0, top - w.shape[1])) for w in pairs[1::2]])
        k = len(a)
        if view:
            xp = xf.view(k, longest, -1).to(wdt)
        else:
            xp = xf.new_zeros((k, longest, xf.shape[-1]), dtype=wdt)
            xp[stack, pos] = xf[rows].to(wdt)
        hs = torch.bmm(xp, a.transpose(1, 2)).mul_(rates.to(wdt)[:, None, None])
        term = torch.bmm(hs, b.transpose(1, 2))  # [K, longest, out]
        if view:
            flat.add_(term.view(flat.shape).to(flat.dtype))
        else:
            flat.index_put_((rows,), term[stack, pos].to(flat.dtype), accumulate=True)
        ctx.mark_dirty(out)
        ctx.slots, ctx.x_meta = slots, (x.shape, x.dtype)
        ctx.ranks, ctx.dtypes = ranks, [w.dtype for w in pairs]
        ctx.save_for_backward(xp, hs, a, b, rates)
        return out

    @staticmethod
    def backward(ctx, grad):
        xp, hs, a, b, rates = ctx.saved_tensors
        rows, stack, pos, longest, view = ctx.slots
        gf = grad.reshape(-1, grad.shape[-1])
        if view:
            gp = gf.view(len(a), longest, -1).to(b.dtype)
        else:
            gp = gf.new_zeros((len(a), longest, gf.shape[-1]), dtype=b.dtype)
            gp[stack, pos] = gf[rows].to(b.dtype)
        d_b = torch.bmm(gp.transpose(1, 2), hs)  # [K, out, r]
        dh = torch.bmm(gp, b).mul_(rates.to(b.dtype)[:, None, None])  # [K, longest, r]
        d_a = torch.bmm(dh.transpose(1, 2), xp)  # [K, r, in]
        dx = None
        if ctx.needs_input_grad[1]:
            x_shape, x_dtype = ctx.x_meta
            dxp = torch.bmm(dh, a)
            if view:
                dx = dxp.reshape(x_shape).to(x_dtype)
            else:
                dx = dxp.new_zeros((math.prod(x_shape[:-1]), x_shape[-1]), dtype=x_dtype)
                dx[rows] = dxp[stack, pos].to(x_dtype)
                dx = dx.view(x_shape)
        grads: list[torch.Tensor | None] = []
        for j, r in enumerate(ctx.ranks):
            da, db = d_a[j, :r].to(ctx.dtypes[2 * j]), d_b[j, :, :r].to(ctx.dtypes[2 * j + 1])
            grads.append(da if ctx.needs_input_grad[4 + 2 * j] else None)
            grads.append(db if ctx.needs_input_grad[5 + 2 * j] else None)
        return grad, dx, None, None, *grads


def lora_layers(peft_model: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Module]:
    """Every LoRA layer of the model (all are switched to the base layer in the context),
    the adapters ``names`` checked to be plain Linear LoRA where they are."""
    layers = _lora_parts(peft_model)[0]
    check_plain(peft_model, layers, names)
    return layers


_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lora_parts(peft_model: torch.nn.Module) -> tuple[list, list[tuple[str, torch.Tensor]]]:
    """The model's LoRA layers and every LoRA weight with its adapter's name, found by one
    walk over the modules and kept until the model's adapters change (a context per
    micro-batch would otherwise walk the whole model three times)."""
    key = tuple(sorted(getattr(peft_model, "peft_config", {})))
    hit = _PARTS.get(peft_model)
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    layers, weights = [], []
    for mod in peft_model.modules():
        lora_a = getattr(mod, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and hasattr(mod, "enable_adapters"):
            layers.append(mod)
        for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            table = getattr(mod, attr, None)
            if isinstance(table, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
                for adapter, part in table.items():
                    if isinstance(part, torch.nn.Module):
                        weights += [(adapter, w) for w in part.parameters(recurse=True)]
                    else:
                        weights.append((adapter, part))
        variants = getattr(mod, "lora_magnitude_vector", None)
        if isinstance(variants, torch.nn.ModuleDict):
            for adapter, part in variants.items():
                weights += [(adapter, w) for w in part.parameters()]
    _PARTS[peft_model] = (key, layers, weights)
    return layers, weights


def check_plain(
    peft_model: torch.nn.Module, layers: list[torch.nn.Module], names: Sequence[str]
) -> None:
    """Refuse merged layers and adapters of ``names`` that are not plain Linear LoRA."""

    def where(mod: torch.nn.Module) -> str:
        return next(n for n, m in peft_model.named_modules() if m is mod)

    for mod in layers:
        if getattr(mod, "merged", False):
            raise ValueError(
                f"adapter_rows: adapters are merged into {where(mod)!r}; unmerge them first"
            )
        lora_a = mod.lora_A
        variants = getattr(mod, "lora_variant", {}) or {}
        embeds = getattr(mod, "lora_embedding_A", {}) or {}
        for n in names:
            plain = n not in lora_a or isinstance(lora_a[n], torch.nn.Linear)
            if n in variants or n in embeds or not plain:
                raise ValueError(
                    f"adapter_rows: adapter {n!r} at {where(mod)!r} is not a plain Linear LoRA"
                    " (DoRA, embedding and convolution adapters are not supported); batch "
                    "only plain LoRA adapters"
                )


@contextmanager
def adapter_rows(
    peft_model: torch.nn.Module, names: Sequence[str], trainable: Sequence[str] = ()
) -> Iterator[Router]:
    """A context in which ``peft_model``'s forwards run each row (token) through one of the
    adapters ``names`` (see the module docstring); yields the :class:`Router` to set rows on.

    Of the LoRA weights, those of the adapters in ``trainable`` require grad inside, the
    others not; after the context the ``trainable`` ones still do (a backward after it
    needs them) and every other weight is as it was before. The active adapter is left as
    it was.
    """
    names = list(names)
    missing = [n for n in [*names, *trainable] if n not in peft_model.peft_config]
    if missing or len(set(names)) != len(names) or not set(trainable) <= set(names):
        raise ValueError(
            f"adapter_rows: adapters {names} must be distinct and exist on the model, and "
            f"trainable {list(trainable)} among them (unknown: {missing}; the model has "
            f"{sorted(peft_model.peft_config)})"
        )
    base = peft_model.get_base_model()
    if getattr(base, "is_gradient_checkpointing", False) and base.training:
        raise ValueError(
            "adapter_rows: gradient checkpointing is on; its recompute would route tokens by "
            "a later forward's rows. Train these adapters one by one (or turn it off)"
        )
    router = Router(names)
    layers, lora_weights = _lora_parts(peft_model)
    check_plain(peft_model, layers, names)
    keep = set(trainable)
    before = [w.requires_grad for _, w in lora_weights]

    enabled = [layer for layer in layers if not layer.disable_adapters]
    handles = [base.register_forward_pre_hook(router._model_pre_hook, with_kwargs=True)]
    try:
        for layer in enabled:
            layer.enable_adapters(False)  # the base layer's output; the hooks add the terms
        for adapter, w in lora_weights:  # PEFT's set_adapter sets them by activity; ours
            w.requires_grad_(adapter in keep)
        for layer in layers:
            slots = [(k, n) for k, n in enumerate(names) if n in layer.lora_A]
            if slots:
                handles.append(layer.register_forward_hook(router._add_terms(slots)))
        yield router
    finally:
        for h in handles:
            h.remove()
        for layer in enabled:
            layer.enable_adapters(True)  # this sets the active adapters' grads: ours again
        for (adapter, w), was in zip(lora_weights, before, strict=True):
            w.requires_grad_(adapter in keep or was)
