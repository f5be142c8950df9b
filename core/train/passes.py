"""Forward-pass layouts: log-probs of a record's response tokens under a causal LM.

One computation, several layouts of the same rows (equal values up to float rounding):
padded, with each distinct prompt's KV cache shared by its group's rows
(:func:`response_logprobs`); packed end to end without padding (:func:`packed_logprobs`);
packed as trees of shared prefixes (:func:`shared_logprobs`, planned by
:mod:`polyrl.core.train.prefix`). MoE models replay the engine's experts in every layout
(a :class:`polyrl.core.train.moe.Routing` told each forward's token layout). The policy kinds
(:mod:`polyrl.core.train.policy`, marl's LoRA agents, the VLM forward) choose a layout from
their config and call these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from tensordict import TensorDict

from polyrl.core.train import moe, prefix
from polyrl.core.train.prefix import pack_rows


class RowOwners(Protocol):
    """Which of several owners each row of a pass belongs to, for a computation inside the
    model that runs each owner's tokens its own way (marl.multi_lora: each row through its
    own LoRA adapter). The pass reads ``rows`` (each batch row's owner index) to keep
    owners apart in its layout (no shared prefix, packed row or prompt cache spans two),
    and before each forward tells ``plan`` the owner of every token of that forward's
    input (``[input rows, width]``; a packing filler takes its packed row's owner)."""

    @property
    def rows(self) -> torch.Tensor | None: ...

    def plan(self, owners: torch.Tensor) -> None: ...


def owner_rows(owners: RowOwners | None, n: int) -> torch.Tensor | None:
    """``owners.rows`` checked against a batch of ``n`` rows (None: no owners)."""
    if owners is None:
        return None
    rows = owners.rows
    if rows is None or len(rows) != n:
        raise ValueError(
            f"row owners: a pass over {n} rows needs one owner per row, set before it "
            f"(got {None if rows is None else len(rows)})"
        )
    return rows.long()


def owner_layout(
    rows: torch.Tensor,
    real: torch.Tensor,
    bins: torch.Tensor,
    cols: torch.Tensor,
    row_bin: list[int],
    shape: tuple[int, int],
) -> torch.Tensor:
    """Each token's owner in a packed input of ``shape``: the real tokens (``real`` [B, T],
    row-major) at ``(bins, cols)`` take their row's; a filler its packed row's."""
    rows = rows.to(real.device)
    per_bin = torch.zeros(shape[0], dtype=torch.long, device=real.device)
    per_bin[torch.as_tensor(row_bin, device=real.device)] = rows
    out = per_bin[:, None].expand(shape).clone()
    out[bins, cols] = rows[:, None].expand_as(real)[real]
    return out


def owned_tokens(tokens: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``tokens`` (:func:`polyrl.core.train.prefix.row_tokens`' ids) told apart by row owner:
    rows of different owners share no prefix (its activations depend on the owner)."""
    if rows is None or len(torch.unique(rows)) < 2:
        return tokens
    owner = rows.to(tokens.device)[:, None].expand_as(tokens)
    both = torch.stack([tokens.long(), owner], -1).flatten(0, 1)
    ids = torch.unique(both, dim=0, return_inverse=True)[1].view(tokens.shape)
    return torch.where(tokens >= 0, ids.to(tokens.dtype), tokens)


def packs(model: torch.nn.Module, pack: bool) -> bool:
    """Whether ``model``'s log-prob passes run packed: ``pack`` asked for, and an attention
    implementation that keeps packed rows apart (see :func:`packed_logprobs`)."""
    impl = str(getattr(model.config, "_attn_implementation", None))
    return pack and (impl in ("sdpa", "eager") or "flash" in impl)


def shares(model: torch.nn.Module, pack: bool, shared_prefix: bool) -> bool:
    """Whether packed passes may share prefixes: a tree needs its own attention mask, which
    sdpa and eager take (flash attention's varlen kernel cannot express it) and which a
    sliding window would contradict."""
    impl = str(getattr(model.config, "_attn_implementation", None))
    cfg = getattr(model.config, "text_config", None) or model.config
    windowed = "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or bool(
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    )
    return pack and shared_prefix and impl in ("sdpa", "eager") and not windowed


def routed_tokens(batch: TensorDict, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`polyrl.core.train.prefix.row_tokens`' ids, told apart where the engine routed equal
    tokens to different experts (MoE records): a prefix computed once is routed once, so
    under routing replay rows may share it only where their recorded experts agree too
    (an engine that routes as the trainer does records equal experts: sharing is kept)."""
    if "response_experts" not in batch.keys():  # noqa: SIM118 (TensorDict)
        return tokens
    mask = torch.cat([batch["prompt_mask"].bool(), batch["response_mask"].bool()], 1)
    experts = torch.cat([batch["prompt_experts"], batch["response_experts"]], 1).flatten(2)
    if experts.shape[:2] != mask.shape:  # malformed: the replay pass names the column
        return tokens
    keys = torch.full((*tokens.shape, experts.shape[-1]), -2, dtype=torch.long)
    keys = keys.to(tokens.device)
    col = mask.long().cumsum(-1) - 1
    row = torch.arange(len(mask), device=mask.device)[:, None].expand_as(mask)
    keys[row[mask], col[mask]] = experts.to(tokens.device)[mask].long()
    both = torch.cat([tokens[..., None].long(), keys], -1).flatten(0, 1)
    ids = torch.unique(both, dim=0, return_inverse=True)[1].view(tokens.shape)
    return torch.where(tokens >= 0, ids.to(tokens.dtype), tokens)


def prefix_units(
    model: torch.nn.Module,
    batch: TensorDict,
    min_shared: int,
    limit: int | None = None,
    owners: torch.Tensor | None = None,
) -> list[prefix.Unit]:
    """How :func:`shared_logprobs` would run ``batch``'s rows: trees and single rows
    (``owners``: each row's owner, :class:`RowOwners`; a tree holds one owner's rows)."""
    min_shared = max(1, min_shared)
    tokens, lengths = prefix.row_tokens(batch)
    tokens = owned_tokens(routed_tokens(batch, tokens), owners)
    head = tokens[:, :min_shared][lengths >= min_shared]
    if len(head) < 2 or len(torch.unique(head, dim=0)) == len(head):  # nothing can share
        return [prefix.Unit([i], [0], n) for i, n in enumerate(lengths.tolist())]
    order, lcp = prefix.sorted_lcp(tokens, lengths)
    return prefix.plan_units(
        lengths.tolist(),
        order,
        lcp,
        min_shared=min_shared,
        weights=prefix.cost_weights(model.config),
        limit=limit,
    )


def response_logprobs(
    model: torch.nn.Module,
    batch: TensorDict,
    temperature: float = 1.0,
    with_entropy: bool = False,
    shared_prefix: bool = True,
    pack: bool = False,
    min_shared: int = 16,
    routing: moe.Routing | None = None,
    owners: RowOwners | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of each response token given everything before it.

    ``pack`` runs the rows without padding: :func:`shared_logprobs` where
    ``shared_prefix`` is on, the attention takes a tree mask (:func:`shares`) and the cost
    model shares some prefix of at least ``min_shared`` tokens; else
    :func:`packed_logprobs`.

    Only the response positions reach the LM head (``logits_to_keep``), which saves
    the vocabulary projection over the prompt. With ``shared_prefix`` the rows that share
    a prompt (a GRPO group) share one pass over it: the distinct prompts run once, their
    KV cache is expanded to the rows (gradients flow back through the expansion), and the
    responses attend to it -- equal to the full pass up to float rounding, and about
    (n-1)/n of the prompt compute cheaper.

    ``routing`` (MoE models): an open :class:`polyrl.core.train.moe.Routing`, told each forward's
    token layout (recorded experts to replay, token kinds).

    ``owners`` (:class:`RowOwners`): each row's owner, told to the model's per-owner
    computation for every forward. Rows of different owners share nothing; packed rows
    hold one owner's rows and come in owner order, so with the batch's rows in owner
    order every owner's tokens lie together in the model's input (what marl.multi_lora's
    adapters read without a gather).
    """
    rows = owner_rows(owners, batch.batch_size[0])
    if pack:
        sharing = shares(model, pack, shared_prefix) and batch.batch_size[0] > 1
        if sharing and bool(batch["response_mask"].any()):
            units = prefix_units(model, batch, min_shared, owners=rows)
            if any(u.shared for u in units):
                return shared_logprobs(
                    model, batch, units, temperature, with_entropy, routing, owners
                )
        return packed_logprobs(model, batch, temperature, with_entropy, routing, owners)
    prompt, pmask = batch["prompt_ids"], batch["prompt_mask"]
    r = batch["response_ids"].shape[1]
    inverse = None
    if shared_prefix and r > 0:
        key = [prompt, pmask] + ([] if rows is None else [rows.to(prompt)[:, None]])
        distinct, inverse = torch.unique(torch.cat(key, 1), dim=0, return_inverse=True)
        if distinct.shape[0] == prompt.shape[0]:
            inverse = None  # nothing shared
    if inverse is None:
        ids = torch.cat([prompt, batch["response_ids"]], dim=1)
        mask = torch.cat([pmask, batch["response_mask"]], dim=1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        if routing is not None:
            routing.plan(*moe.token_layout(batch))
        if owners is not None and rows is not None:
            owners.plan(rows[:, None].expand(ids.shape))
        logits = (
            model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                logits_to_keep=r + 1,
                use_cache=False,
            )
            .logits[:, :-1]
            .float()
        )
    else:
        width = prompt.shape[1]
        d_ids, d_mask = distinct[:, :width], distinct[:, width : 2 * width]
        d_pos = (d_mask.cumsum(-1) - 1).clamp(min=0)
        if routing is not None:  # a distinct prompt's experts: its first row's
            experts, where = moe.token_layout(batch)
            rows = torch.arange(len(inverse), device=inverse.device)
            first = torch.full((len(distinct),), len(inverse), device=inverse.device)
            first = first.scatter_reduce(0, inverse, rows, "amin")
            routing.plan(None if experts is None else experts[first, :width], where[first, :width])
        if owners is not None:  # a distinct prompt's owner: its column of the key
            owners.plan(distinct[:, 2 * width :].long().expand(d_ids.shape))
        head = model(
            input_ids=d_ids,
            attention_mask=d_mask,
            position_ids=d_pos,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = head.past_key_values
        cache.batch_select_indices(inverse)
        mask = torch.cat([d_mask[inverse], batch["response_mask"]], dim=1)
        pos = d_pos[inverse][:, -1:] + 1 + torch.arange(r, device=prompt.device)[None]
        if routing is not None:
            routing.plan(None if experts is None else experts[:, width:], where[:, width:])
        if owners is not None and rows is not None:
            owners.plan(rows[:, None].expand(batch["response_ids"].shape))
        tail = model(
            input_ids=batch["response_ids"],
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
        ).logits
        logits = torch.cat([head.logits[inverse], tail[:, :-1]], dim=1).float()
    return token_logprobs(logits, batch["response_ids"], temperature, with_entropy)


def packed_logprobs(
    model: torch.nn.Module,
    batch: TensorDict,
    temperature: float = 1.0,
    with_entropy: bool = False,
    routing: moe.Routing | None = None,
    owners: RowOwners | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_logprobs` without padding: the rows' real tokens (prompt then
    response) are packed end to end, with position ids restarting at 0 on each row. With
    no attention mask and no cache, transformers reads the restarts as sequence boundaries
    (``masking_utils.find_packed_sequence_indices`` for sdpa/eager, flash-attention's
    varlen path), so no row attends to another and the padded computation's values come
    out. Flash attention takes one sequence ``[1, total]`` (its varlen kernel costs the
    sum of squared row lengths). sdpa and eager build a dense mask over their whole input,
    so for them the rows are packed first-fit-decreasing into bins as wide as the longest
    row: the attention then costs at most what the padded batch's does, and the rest of
    the model runs on about the real tokens. Only positions that predict a response token
    reach the LM head. Padded response slots hold 0.
    """
    prompt, pmask = batch["prompt_ids"], batch["prompt_mask"]
    rmask = batch["response_mask"].bool()
    if not bool(rmask.any()):
        zeros = torch.zeros(rmask.shape, device=prompt.device)
        return zeros, (zeros.clone() if with_entropy else None)
    mask = torch.cat([pmask.bool(), rmask], dim=1)
    lengths = mask.sum(-1).tolist()
    if not bool(pmask.bool().any(-1).all()):
        raise ValueError(
            "packed log-probs: a row has no prompt token to predict its first response "
            "token from; give every row a prompt, or set the policy's pack: false"
        )
    one_sequence = "flash" in str(getattr(model.config, "_attn_implementation", ""))
    rows = owner_rows(owners, len(lengths))
    row_bin, row_start, bins, width = pack_rows(
        lengths, None if one_sequence else max(lengths), None if rows is None else rows.tolist()
    )
    device = prompt.device
    pos = mask.long().cumsum(-1) - 1  # each row's own positions, as in the padded pass
    token_bin = torch.as_tensor(row_bin, device=device)[:, None].expand_as(mask)
    token_col = torch.as_tensor(row_start, device=device)[:, None] + pos
    ids = torch.zeros(bins, width, dtype=prompt.dtype, device=device)
    ids[token_bin[mask], token_col[mask]] = torch.cat([prompt, batch["response_ids"]], 1)[mask]
    positions = torch.zeros(bins, width, dtype=torch.long, device=device)  # fillers: 0 each
    positions[token_bin[mask], token_col[mask]] = pos[mask]
    # a response token is predicted by the token before it in its row
    r_bin = token_bin[:, prompt.shape[1] :][rmask]
    r_col = token_col[:, prompt.shape[1] :][rmask] - 1
    keep, slot = torch.unique(r_col, return_inverse=True) if bins > 1 else (r_col, None)
    if routing is not None:
        ex, where = moe.token_layout(batch)
        where_at = (token_bin[mask], token_col[mask], tuple(ids.shape))
        routing.plan(*moe.scatter_layout(ex, where, mask, *where_at))
    if owners is not None and rows is not None:
        at = (token_bin[mask], token_col[mask], row_bin, (bins, width))
        owners.plan(owner_layout(rows, mask, *at))
    logits = model(
        input_ids=ids, position_ids=positions, logits_to_keep=keep, use_cache=False
    ).logits
    logits = logits[0] if slot is None else logits[r_bin, slot]
    logp, ent = token_logprobs(
        logits.float(), batch["response_ids"][rmask], temperature, with_entropy
    )
    out = torch.zeros(rmask.shape, dtype=logp.dtype, device=device).masked_scatter(rmask, logp)
    if ent is not None:
        ent = torch.zeros_like(out).masked_scatter(rmask, ent)
    return out, ent


@dataclass
class TreeInputs:
    """What a model family supplies to the tree pass (:func:`shared_logprobs`) in place of
    a causal LM's token ids, counted positions and forward (the VL family: images at their
    placeholders, M-RoPE positions)."""

    # the rows' real tokens, left-aligned [B, L] (-1 after each row; prefix.row_tokens),
    # what the trees are built from: a family may mark a token (< -1) to tell equal ids
    # with different inputs apart (an image placeholder by its feature)
    tokens: torch.Tensor
    # [..., B, P + R]: the position ids of each prompt and response slot (padded layout)
    positions: torch.Tensor
    # (layout ids [bins, W] with the marks, attention mask, position ids [..., bins, W],
    # the columns to keep) -> logits [bins, len(columns), V]
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def shared_logprobs(
    model: torch.nn.Module,
    batch: TensorDict | Mapping[str, torch.Tensor],
    units: list[prefix.Unit],
    temperature: float = 1.0,
    with_entropy: bool = False,
    routing: moe.Routing | None = None,
    owners: RowOwners | None = None,
    inputs: TreeInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`packed_logprobs` with each unit's shared prefixes computed once.

    A unit of rows (a tree, :func:`polyrl.core.train.prefix.tree_layout`) is packed as its
    distinct tokens, each node after its parent, with position ids continuing from the
    prefix's length and a mask where each token sees its own node's earlier tokens and its
    ancestors' (sdpa: a boolean mask, eager: an additive one). A row's response token is
    predicted from the column holding the row's token before it, which rows sharing that
    token share too; gradients through a prefix sum every suffix's. Equal to the padded
    pass up to float rounding. Padded response slots hold 0.

    ``inputs``: the model family's tokens, positions and forward (:class:`TreeInputs`;
    each row's positions are placed at its columns: a shared prefix has the same
    positions in every row, since they depend only on what comes before); None: the
    model's own forward over token ids.
    """
    rmask = batch["response_mask"].bool()
    if not bool(batch["prompt_mask"].bool().any(-1).all()):
        raise ValueError(
            "packed log-probs: a row has no prompt token to predict its first response "
            "token from; give every row a prompt, or set the policy's pack: false"
        )
    tokens, lengths = prefix.row_tokens(batch)
    if inputs is not None:
        tokens = inputs.tokens
    unit_segments = None
    rows = owner_rows(owners, len(lengths))
    if rows is not None:
        segments = rows.tolist()
        unit_segments = [segments[u.rows[0]] for u in units]
        if any(segments[r] != s for u, s in zip(units, unit_segments, strict=True) for r in u.rows):
            raise ValueError("shared log-probs: a prefix tree spans rows of several owners")
    layout = prefix.tree_layout(units, tokens, lengths.tolist(), len(lengths), unit_segments)
    plen = batch["prompt_mask"].sum(-1).tolist()
    r_bin, r_col = [], []
    for i, cols in enumerate(layout.cols):  # response token k of row i: from position p+k-1
        n = int(rmask[i].sum())
        if n:
            r_col.append(cols[plen[i] - 1 : plen[i] - 1 + n])
            r_bin.append(torch.full((n,), layout.row_bin[i], device=cols.device))
    r_bin_t, r_col_t = torch.cat(r_bin), torch.cat(r_col)
    keep, slot = torch.unique(r_col_t, return_inverse=True)
    mask = layout.visible
    if str(getattr(model.config, "_attn_implementation", "")) == "eager":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
    real = torch.cat([batch["prompt_mask"].bool(), rmask], 1)
    bins = torch.as_tensor(layout.row_bin, device=real.device).repeat_interleave(lengths)
    cols = torch.cat(layout.cols)
    if routing is not None:  # a shared prefix's columns take each of its rows' experts
        ex, where = moe.token_layout(batch)
        routing.plan(*moe.scatter_layout(ex, where, real, bins, cols, tuple(layout.ids.shape)))
    if owners is not None and rows is not None:
        shape = (layout.ids.shape[0], layout.ids.shape[1])
        owners.plan(owner_layout(rows, real, bins, cols, layout.row_bin, shape))
    if inputs is None:
        logits = model(
            input_ids=layout.ids,
            attention_mask=mask,
            position_ids=layout.positions,
            logits_to_keep=keep,
            use_cache=False,
        ).logits
    else:  # each row's positions at its columns
        given = inputs.positions
        pos = given.new_zeros((*given.shape[:-2], *layout.ids.shape))
        pos[..., bins, cols] = given[..., real]
        logits = inputs.forward(layout.ids, mask, pos, keep)
    logits = logits[r_bin_t, slot]
    logp, ent = token_logprobs(
        logits.float(), batch["response_ids"][rmask], temperature, with_entropy
    )
    out = torch.zeros(rmask.shape, dtype=logp.dtype, device=rmask.device).masked_scatter(
        rmask, logp
    )
    if ent is not None:
        ent = torch.zeros_like(out).masked_scatter(rmask, ent)
    return out, ent


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``ids`` under softmax(logits / temperature), and optionally the entropy
    of that distribution: the one the engine sampled from, so the first ratio is exactly 1."""
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy
