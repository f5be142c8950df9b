"""Several LoRA adapters of one shared PEFT model in ONE forward: each row (each token)
through its own adapter.

PEFT's own mixed batches (``adapter_names=``) refuse training mode, so this is built from
supported parts: inside the context every LoRA layer runs its base layer only
(``enable_adapters(False)``), and a forward hook on each layer adds each routed adapter's
term to that adapter's tokens, in place, with each LoRA product one batched product over
the adapters (:class:`_StackedTerms`; adapters with dropout in training take PEFT's own
modules). A token's LoRA term is then its
own adapter's, and the gradient of adapter ``k`` comes only from its own tokens -- the
per-adapter pass's, summed into one backward. The LoRA work is that of the tokens routed,
whatever the number of adapters.

Which adapter a token belongs to, for each forward while the context is open:

* **Per row** (:meth:`Router.set_rows`): row ``i`` of the model input runs through
  ``names[rows[i]]``. Used when the forward's rows are the batch's rows in order: a padded
  log-prob pass, a generation's prefill and decode steps.
* **Tagged ids** (:meth:`Router.tag`): packed and prefix-sharing passes lay several rows out
  in one input row, so the adapter travels with the token ids instead: ``tag`` adds
  ``(k + 1) * vocab`` to row ``i``'s prompt ids (``k = rows[i]``); the hook on the base model
  strips the offset before the embedding and gives each token the adapter of the nearest
  tagged token at or before it in its input row (a row's response follows its own prompt
  in every layout; a shared-prefix tree starts with its root). Tagged prompts of different
  adapters also differ as tokens, so no layout shares a prefix across adapters (it would be
  wrong: the prefix's activations depend on the adapter). An input with no tagged token
  falls back to the per-row ids (the tail of a padded pass that reuses a prompt cache).

    with adapter_rows(peft_model, ["speaker", "listener"]) as router:
        router.set_rows(torch.tensor([0, 0, 1]))       # rows 0, 1: speaker; row 2: listener
        out = peft_model(input_ids=ids, attention_mask=mask)
        batch["prompt_ids"] = router.tag(batch["prompt_ids"], rows)  # for packed passes

Leaving the context turns the layers' adapters back on; the autograd graph built inside
stays valid, so the backward may run after it (the ``trainable`` adapters' weights keep
requiring grad for it). Not supported (refused): LoRA variants (DoRA), non-Linear LoRA layers (embeddings, convolutions), and
gradient checkpointing (its recompute would run the hooks again after the routing moved on).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F


class Router:
    """The routing state of one :func:`adapter_rows` context (see the module docstring)."""

    def __init__(self, names: Sequence[str], vocab: int) -> None:
        self.names = list(names)
        self.vocab = vocab
        self.rows: torch.Tensor | None = None
        self._order: torch.Tensor | None = None  # token order grouping them by adapter
        self._inverse: torch.Tensor | None = None
        self._counts: list[int] = []  # tokens per adapter in the current forward
        self._shape: tuple[int, ...] = ()  # the current forward's (batch, seq)
        self._slots: dict[tuple, tuple] = {}  # the current forward's stacked layouts

    def set_rows(self, rows: torch.Tensor | Sequence[int]) -> None:
        """Per-row adapter indices (into ``names``) for the following forwards."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(self.names)):
            raise ValueError(
                f"adapter_rows: row adapter ids must lie in [0, {len(self.names)}) for "
                f"adapters {self.names}; got {rows.tolist()}"
            )
        self.rows = rows

    def tag(self, ids: torch.Tensor, rows: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``ids`` ([rows, width]) with row ``i`` offset by ``(rows[i] + 1) * vocab``: the
        adapter then travels with the tokens through packed layouts. Also sets the rows."""
        self.set_rows(rows)
        return ids + ((self.rows.to(ids.device) + 1) * self.vocab)[:, None]

    # --- hooks ----------------------------------------------------------------------------
    def _route(self, ids: torch.Tensor) -> torch.Tensor:
        """Strip the tags of the base model's input ids and set each token's adapter."""
        tag = torch.div(ids, self.vocab, rounding_mode="floor")
        if bool((tag > 0).any()):
            col = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            last = torch.where(tag > 0, col, -1).cummax(dim=1).values  # nearest tag at/before
            if bool((last < 0).any()):
                raise ValueError(
                    "adapter_rows: an input row starts with untagged tokens; tag every row's "
                    "prompt ids (Router.tag) so each token follows a tagged one"
                )
            token = tag.gather(1, last) - 1
            ids = ids - tag * self.vocab
        else:
            if self.rows is None or len(self.rows) != ids.shape[0]:
                raise ValueError(
                    f"adapter_rows: a forward over {ids.shape[0]} untagged rows, but "
                    f"{'no' if self.rows is None else len(self.rows)} per-row adapter ids were "
                    "set (Router.set_rows)"
                )
            token = self.rows.to(ids.device)[:, None].expand_as(ids)
        flat = token.reshape(-1)
        self._order = self._inverse = None  # tokens already grouped by adapter
        if len(flat) > 1 and not bool((flat[1:] >= flat[:-1]).all()):
            self._order = torch.argsort(flat, stable=True)
            self._inverse = torch.empty_like(self._order)
            self._inverse[self._order] = torch.arange(len(flat), device=flat.device)
        self._counts = torch.bincount(flat, minlength=len(self.names)).tolist()
        self._shape = tuple(ids.shape)
        self._slots = {}
        return ids

    def _model_pre_hook(self, module, args, kwargs):
        if "input_ids" in kwargs and kwargs["input_ids"] is not None:
            kwargs["input_ids"] = self._route(kwargs["input_ids"])
        elif args and isinstance(args[0], torch.Tensor):
            args = (self._route(args[0]), *args[1:])
        else:
            raise ValueError("adapter_rows: the model was called without input_ids")
        return args, kwargs

    def _add_terms(self, slots: list[tuple[int, str]]):
        """A forward hook on a LoRA layer (its adapters disabled: the output is the base
        layer's) that adds each adapter's term to its own tokens only
        (:class:`_StackedTerms`: in place, each product one batched product over the
        adapters). A layer whose adapters drop out in training takes the autograd path
        (:meth:`_terms_by_autograd`)."""
        here = dict(slots)

        def hook(module, args, out):
            x = args[0]
            if tuple(x.shape[:-1]) != self._shape:
                raise ValueError(
                    f"adapter_rows: a LoRA layer saw tokens of shape {tuple(x.shape[:-1])}, "
                    f"the model's input was {self._shape}"
                )
            order = None if self._order is None else self._order.to(x.device)
            drops = [module.lora_dropout[n] for n in here.values()]
            dropping = any(not isinstance(d, torch.nn.Identity) and d.training for d in drops)
            if dropping or x.dtype != out.dtype or not out.is_contiguous():
                return self._terms_by_autograd(module, here, x, out, order)
            present = [k for k, n in enumerate(self._counts) if n and k in here]
            if not present:
                return out
            pairs = [
                w
                for k in present
                for w in (module.lora_A[here[k]].weight, module.lora_B[here[k]].weight)
            ]
            rates = torch.tensor([float(module.scaling[here[k]]) for k in present])
            slots = self._stack_slots(tuple(present), order, x.device)
            return _StackedTerms.apply(out, x, slots, rates.to(x.device), *pairs)

        return hook

    def _stack_slots(self, present: tuple[int, ...], order, device) -> tuple:
        """Where each token of the adapters ``present`` sits in the stacked ``[adapter,
        position]`` layout of :class:`_StackedTerms` (one per forward and adapter set, shared
        by every layer): (input rows, stack index, position, longest count, whether the
        stack is a plain view of the tokens)."""
        key = (present, device)
        if key not in self._slots:
            starts = [0]
            for n in self._counts[:-1]:
                starts.append(starts[-1] + n)
            rows = torch.cat(
                [torch.arange(starts[k], starts[k] + self._counts[k]) for k in present]
            )
            stack = torch.cat([torch.full((self._counts[k],), j) for j, k in enumerate(present)])
            pos = torch.cat([torch.arange(self._counts[k]) for k in present])
            longest = max(self._counts[k] for k in present)
            total = sum(self._counts)
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

    def _terms_by_autograd(self, module, here: dict[int, str], x, out, order):
        """The terms through PEFT's own modules (dropout, dtype casts) and autograd: the
        tokens sorted by adapter, each adapter's slice through its dropout, A, B and
        scaling, put back in token order and added."""
        mine = x.reshape(-1, x.shape[-1])
        if order is not None:  # not already grouped by adapter
            mine = mine.index_select(0, order)
        terms = []
        for k, part in enumerate(mine.split(self._counts)):
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
        if order is not None:
            term = term.index_select(0, self._inverse.to(x.device))
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
    from :meth:`Router._stack_slots`; ``rates`` the adapters' scalings; ``pairs`` their
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

    Of the LoRA weights, those of the adapters in ``trainable`` require grad, the others
    not; they stay so after the context (a backward after it needs them), until the next
    ``set_adapter`` (e.g. a ``lora_agent`` policy's ``model``). The active adapter is left
    as it was.
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
    router = Router(names, base.get_input_embeddings().num_embeddings)
    layers, lora_weights = _lora_parts(peft_model)
    check_plain(peft_model, layers, names)
    keep = set(trainable)

    def pin() -> None:  # PEFT's set_adapter sets requires_grad by activity; ours instead
        for adapter, w in lora_weights:
            w.requires_grad_(adapter in keep)

    enabled = [layer for layer in layers if not layer.disable_adapters]
    handles = [base.register_forward_pre_hook(router._model_pre_hook, with_kwargs=True)]
    try:
        for layer in enabled:
            layer.enable_adapters(False)  # the base layer's output; the hooks add the terms
        pin()
        for layer in layers:
            slots = [(k, n) for k, n in enumerate(names) if n in layer.lora_A]
            if slots:
                handles.append(layer.register_forward_hook(router._add_terms(slots)))
        yield router
    finally:
        for h in handles:
            h.remove()
        for layer in enabled:
            layer.enable_adapters(True)
        pin()
