"""Several LoRA adapters of one shared PEFT model in ONE forward: each row (each token)
through its own adapter.

PEFT's own mixed batches (``adapter_names=``) refuse training mode, so this is built from
hooks on supported modules: every adapter of the group is made active at once, a forward
pre-hook on each adapter's ``lora_A`` keeps only the tokens routed to it (a gather: the
other tokens never reach its matrices or its dropout) and a forward hook on its ``lora_B``
scatters the result back into zeros of the full shape. A token's LoRA term is then its own
adapter's, with that adapter's dropout and scaling, and the gradient of adapter ``k`` comes
only from its own tokens -- the per-adapter pass's, summed into one backward.

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

Leaving the context restores the active adapter; the autograd graph built inside stays
valid, so the backward may run after it (the ``trainable`` adapters' weights keep requiring
grad for it). Not supported
(refused): LoRA variants (DoRA), non-Linear LoRA layers (embeddings, convolutions), and
gradient checkpointing (its recompute would run the hooks again after the routing moved on).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class Router:
    """The routing state of one :func:`adapter_rows` context (see the module docstring)."""

    def __init__(self, names: Sequence[str], vocab: int) -> None:
        self.names = list(names)
        self.vocab = vocab
        self.rows: torch.Tensor | None = None
        self._index: list[torch.Tensor] = []  # per adapter: its flat token positions
        self._shape: tuple[int, ...] = ()  # the current forward's (batch, seq)

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
        self._index = [torch.nonzero(flat == k).squeeze(1) for k in range(len(self.names))]
        self._shape = tuple(ids.shape)
        return ids

    def _model_pre_hook(self, module, args, kwargs):
        if "input_ids" in kwargs and kwargs["input_ids"] is not None:
            kwargs["input_ids"] = self._route(kwargs["input_ids"])
        elif args and isinstance(args[0], torch.Tensor):
            args = (self._route(args[0]), *args[1:])
        else:
            raise ValueError("adapter_rows: the model was called without input_ids")
        return args, kwargs

    def _select(self, k: int):
        def pre_hook(module, args):
            x = args[0]
            if x.shape[:-1] != self._shape:
                raise ValueError(
                    f"adapter_rows: a LoRA layer saw tokens of shape {tuple(x.shape[:-1])}, "
                    f"the model's input was {self._shape}"
                )
            return (x.reshape(-1, x.shape[-1]).index_select(0, self._index[k].to(x.device)),)

        return pre_hook

    def _scatter(self, k: int):
        def hook(module, args, out):
            full = out.new_zeros(math.prod(self._shape), out.shape[-1])
            return full.index_copy(0, self._index[k].to(out.device), out).view(
                *self._shape, out.shape[-1]
            )

        return hook


def lora_layers(peft_model: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Module]:
    """The model's LoRA layers that hold any of ``names``, checked to be plain Linear LoRA."""
    layers = []
    for mod_name, mod in peft_model.named_modules():
        lora_a = getattr(mod, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not any(n in lora_a for n in names):
            continue
        variants = getattr(mod, "lora_variant", {}) or {}
        embeds = getattr(mod, "lora_embedding_A", {}) or {}
        for n in names:
            plain = n not in lora_a or isinstance(lora_a[n], torch.nn.Linear)
            if n in variants or n in embeds or not plain:
                raise ValueError(
                    f"adapter_rows: adapter {n!r} at {mod_name!r} is not a plain Linear LoRA "
                    "(DoRA, embedding and convolution adapters are not supported); batch "
                    "only plain LoRA adapters"
                )
        layers.append(mod)
    return layers


@contextmanager
def adapter_rows(
    peft_model: torch.nn.Module, names: Sequence[str], trainable: Sequence[str] = ()
) -> Iterator[Router]:
    """A context in which ``peft_model``'s forwards run each row (token) through one of the
    adapters ``names`` (see the module docstring); yields the :class:`Router` to set rows on.

    Of the LoRA weights, those of the adapters in ``trainable`` require grad, the others
    not; they stay so after the context (a backward after it needs them), until the next
    ``set_adapter`` (e.g. a ``lora_agent`` policy's ``model``). The active adapter is put
    back on leaving.
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
    layers = lora_layers(peft_model, names)
    marks = tuple(f".lora_{ab}.{n}." for n in trainable for ab in "AB")

    def pin() -> None:  # PEFT's set_adapter sets requires_grad by activity; ours instead
        for k, p in peft_model.named_parameters():
            if "lora_" in k:
                p.requires_grad_(any(m in k for m in marks))

    active = peft_model.active_adapter
    handles = [base.register_forward_pre_hook(router._model_pre_hook, with_kwargs=True)]
    try:
        peft_model.base_model.set_adapter(names)
        pin()
        for layer in layers:
            for k, n in enumerate(names):
                if n in layer.lora_A:
                    handles.append(layer.lora_A[n].register_forward_pre_hook(router._select(k)))
                    handles.append(layer.lora_B[n].register_forward_hook(router._scatter(k)))
        yield router
    finally:
        for h in handles:
            h.remove()
        peft_model.base_model.set_adapter(active)
        pin()
