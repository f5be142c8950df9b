"""Shared prefixes in a micro-batch: found from the token ids, computed once.

Rows of a GRPO group share their prompt; a multi-turn episode's ``step`` rows extend the
rows of its earlier turns; agents of a team share a history. None of that needs a record
column: sorting the rows' real tokens (prompt then response) puts rows with a common
prefix next to each other, and the longest common prefix (LCP) of neighbours is all a
compressed trie of the rows needs. The distinct tokens of a run of sorted rows are
``sum(len) - sum(LCP of neighbours)``.

:func:`plan_units` splits a micro-batch's rows into *units*: a unit is run as one tree
(its distinct tokens once) or is a single row. The split is chosen by a cost model
(:func:`cost_weights`): a tree of ``S`` distinct tokens costs ``S * (a + b * S)`` (the
per-token matmuls ``a``, and attention over a dense block of ``S`` columns ``b``, as the
sdpa/eager kernels compute it), a row of ``L`` tokens ``L * (a + b * L)``; a prefix is
shared where that is cheaper, it is at least ``min_shared`` tokens long and the unit fits
the token budget, and a micro-batch shares at all only when the plan's cost is under
:data:`MARGIN` of its rows run apart (the packed pass). A long prefix common to every row (a
system prompt or tool list before different tasks) therefore does not make one huge tree:
the rows split at its branches, and each task's group shares its own prompt.

:func:`tree_layout` lays units out packed: each tree in depth-first order (every token
after its ancestors), trees packed first-fit-decreasing into bins as wide as the largest
unit, with position ids continuing each suffix from its prefix's length and a mask where a
token sees the earlier tokens of its own node and of its ancestors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

MARGIN = 0.9  # share only where the plan's estimated cost is under 90% of no sharing


@dataclass
class Unit:
    """Rows run together, in sorted order; ``lcp[k]`` is the common prefix of ``rows[k-1]``
    and ``rows[k]`` (``lcp[0] = 0``); ``distinct`` their distinct tokens."""

    rows: list[int]
    lcp: list[int]
    distinct: int

    @property
    def shared(self) -> bool:
        return len(self.rows) > 1


def row_tokens(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real tokens (prompt then response), left-aligned ``[B, L]`` (-1 after the
    row), and the rows' lengths."""
    prompt, pmask = batch["prompt_ids"], batch["prompt_mask"].bool()
    mask = torch.cat([pmask, batch["response_mask"].bool()], 1)
    ids = torch.cat([prompt, batch["response_ids"]], 1)
    lengths = mask.sum(-1)
    width = int(lengths.max()) if len(lengths) else 0
    out = torch.full((len(lengths), width), -1, dtype=ids.dtype, device=ids.device)
    col = mask.long().cumsum(-1) - 1
    row = torch.arange(len(lengths), device=ids.device)[:, None].expand_as(mask)
    out[row[mask], col[mask]] = ids[mask]
    return out, lengths


def sorted_lcp(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows in lexicographic order of their tokens (a prefix before its extensions) and the
    LCP of each with the one before it (0 for the first)."""
    seqs = tokens.cpu().tolist()
    lens = lengths.tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][: lens[i]])
    if len(order) < 2:
        return order, [0] * len(order)
    idx = torch.as_tensor(order, device=tokens.device)
    a, b = tokens[idx[:-1]], tokens[idx[1:]]
    same = (a == b).long().cumprod(-1).sum(-1)
    lcp = torch.minimum(same, torch.minimum(lengths[idx[:-1]], lengths[idx[1:]]))
    return order, [0, *lcp.tolist()]


def cost_weights(config: object) -> tuple[float, float]:
    """(a, b) of the cost model from a transformers config: multiply-adds per token of one
    layer's projections and MLP, and per (query, key) pair of its attention. Configs
    without these fields get a 20M-like shape."""
    cfg = getattr(config, "text_config", None) or config
    h = getattr(cfg, "hidden_size", 512)
    heads = getattr(cfg, "num_attention_heads", 8)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    mlp = getattr(cfg, "intermediate_size", None) or 4 * h
    a = h * hd * (2 * heads + 2 * kv) + 3 * h * mlp
    b = 2 * heads * hd
    return float(a), float(b)


def unit_cost(tokens: int, weights: tuple[float, float]) -> float:
    a, b = weights
    return tokens * (a + b * tokens)


def plan_units(
    lengths: list[int],
    order: list[int],
    lcp: list[int],
    *,
    min_shared: int,
    weights: tuple[float, float],
    limit: int | None = None,
) -> list[Unit]:
    """Split sorted rows into units (see the module docstring); every row is in one unit.

    Recursive over the rows' LCP intervals: a run of rows whose common prefix is ``d``
    tokens is either one tree or split where its neighbours' LCP is ``d``. A run over
    ``limit`` distinct tokens is split into chunks of whole sub-runs, each under it."""
    total = [0]  # prefix sums over the sorted rows: lengths, and neighbours' LCPs
    shared_sum = [0]
    for k, r in enumerate(order):
        total.append(total[-1] + lengths[r])
        shared_sum.append(shared_sum[-1] + (lcp[k] if k else 0))

    def distinct(lo: int, hi: int) -> int:
        return total[hi] - total[lo] - (shared_sum[hi] - shared_sum[lo + 1])

    def best(lo: int, hi: int) -> tuple[list[Unit], float]:
        whole = Unit(order[lo:hi], [0, *lcp[lo + 1 : hi]], distinct(lo, hi))
        if hi - lo == 1:
            return [whole], unit_cost(whole.distinct, weights)
        depth = min(lcp[lo + 1 : hi])
        cuts = [lo] + [k for k in range(lo + 1, hi) if lcp[k] == depth] + [hi]
        subs = list(zip(cuts[:-1], cuts[1:], strict=True))
        if limit is not None and whole.distinct > limit:  # chunks of sub-runs that fit
            chunks, (a, b) = [], subs[0]
            for x, y in subs[1:]:
                if distinct(a, y) <= limit:
                    b = y
                else:
                    chunks.append((a, b))
                    a, b = x, y
            subs = [*chunks, (a, b)]
        split: list[Unit] = []
        split_cost = 0.0
        for a, b in subs:
            us, c = best(a, b)
            split += us
            split_cost += c
        if depth >= min_shared and (limit is None or whole.distinct <= limit):
            cost = unit_cost(whole.distinct, weights)
            if cost <= split_cost:
                return [whole], cost
        return split, split_cost

    alone = [Unit([r], [0], lengths[r]) for r in order]
    if len(order) < 2:
        return alone
    units, cost = best(0, len(order))
    if cost > MARGIN * sum(unit_cost(u.distinct, weights) for u in alone):
        return alone  # too little to gain for a pass with its own mask
    return units


def charged_tokens(units: list[Unit], lengths: list[int], n: int) -> torch.Tensor:
    """Tokens each row adds to its unit's pass (its length less its LCP with the row before
    it in the unit): a unit's rows sum to its distinct tokens."""
    out = torch.zeros(n, dtype=torch.long)
    for u in units:
        for r, c in zip(u.rows, u.lcp, strict=True):
            out[r] = lengths[r] - c
    return out


def pack_rows(
    lengths: list[int], width: int | None, segments: Sequence[int] | None = None
) -> tuple[list, list, int, int]:
    """First-fit-decreasing packing of rows of ``lengths`` into bins of ``width`` tokens
    (None: one bin holding every row, in order). Returns each row's bin and start column,
    the number of bins and their width. ``segments``: rows of different segments never
    share a bin; each segment's bins follow the previous segment's (ascending)."""
    if width is None:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        return [0] * len(lengths), starts, 1, sum(lengths)
    if segments is not None and len(set(segments)) > 1:
        row_bin, row_start, offset = [0] * len(lengths), [0] * len(lengths), 0
        for seg in sorted(set(segments)):
            rows = [i for i, s in enumerate(segments) if s == seg]
            seg_bin, seg_start, n, _ = pack_rows([lengths[i] for i in rows], width)
            for i, bi, si in zip(rows, seg_bin, seg_start, strict=True):
                row_bin[i], row_start[i] = bi + offset, si
            offset += n
        return row_bin, row_start, offset, width
    used: list[int]  # tokens used in each bin
    row_bin, row_start, used = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, u in enumerate(used) if u + lengths[i] <= width), len(used))
        if b == len(used):
            used.append(0)
        row_bin[i], row_start[i] = b, used[b]
        used[b] += lengths[i]
    return row_bin, row_start, len(used), width


@dataclass
class Layout:
    """A packed tree pass: ``ids``/``positions`` ``[bins, width]``, ``visible`` the mask
    ``[bins, 1, width, width]`` (True: may attend) and each row's column of each of its
    tokens (``cols[i][p]``: where position ``p`` of row ``i`` sits in its bin)."""

    ids: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    row_bin: list[int]
    cols: list[torch.Tensor]


def _tree(unit: Unit, lengths: list[int]) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """The compressed trie of a unit's sorted rows: its nodes in depth-first order as
    ``[start, end, rep, parent, id]`` (``rep``: a row through the node; id 0 is the empty
    root, left out), each row's last node and each node's children."""
    nodes = [[0, 0, -1, -1]]
    children: list[list[int]] = [[]]
    end_node = {}
    ending: list[list[int]] = [[]]  # rows ending at each node
    stack = [0]
    for r, shared in zip(unit.rows, unit.lcp, strict=True):
        while stack[-1] != 0 and nodes[stack[-1]][0] >= shared:
            stack.pop()
        top = stack[-1]
        if shared < nodes[top][1]:  # the new row leaves top's segment part way: split it
            low = len(nodes)
            nodes.append([shared, nodes[top][1], nodes[top][2], top])
            children.append(children[top])
            ending.append(ending[top])
            for c in children[low]:
                nodes[c][3] = low
            for row in ending[low]:
                end_node[row] = low
            nodes[top][1], children[top], ending[top] = shared, [low], []
        if lengths[r] > nodes[top][1]:
            leaf = len(nodes)
            nodes.append([nodes[top][1], lengths[r], r, top])
            children.append([])
            ending.append([r])
            children[top].append(leaf)
            end_node[r] = leaf
            stack.append(leaf)
        else:  # the same tokens as the path to top
            ending[top].append(r)
            end_node[r] = top
    # depth-first order from the root's children
    preorder, todo = [], list(reversed(children[0]))
    while todo:
        v = todo.pop()
        preorder.append(v)
        todo.extend(reversed(children[v]))
    ordered = [nodes[v] + [v] for v in preorder]
    return ordered, [end_node[r] for r in unit.rows], children


def tree_layout(
    units: list[Unit],
    tokens: torch.Tensor,
    lengths: list[int],
    n: int,
    segments: Sequence[int] | None = None,
) -> Layout:
    """Pack ``units`` (trees) first-fit-decreasing into bins as wide as the largest one
    (``segments``: each unit's; see :func:`pack_rows`); see :class:`Layout`."""
    sizes = [u.distinct for u in units]
    unit_bin, unit_start, bins, width = pack_rows(sizes, max(sizes), segments)
    device = tokens.device
    src_row, src_pos, tok_bin, tok_col, tok_end = [], [], [], [], []
    row_bin, cols = [0] * n, cast("list[torch.Tensor]", [None] * n)  # each row's set below
    for u, b, base in zip(units, unit_bin, unit_start, strict=True):
        nodes, last, children = _tree(u, lengths)
        col = {}  # node id -> first column
        c = base
        for start, end, _rep, _parent, v in nodes:
            col[v] = c
            c += end - start
        end_col: dict[int, int] = {}  # node id -> column after its subtree
        for start, end, _rep, _parent, v in reversed(nodes):
            end_col[v] = max([col[v] + end - start] + [end_col[k] for k in children[v]])
        info = {v: (start, end, rep, parent) for start, end, rep, parent, v in nodes}
        for start, end, rep, _parent, v in nodes:
            span = end - start
            src_row.append(torch.full((span,), rep))
            src_pos.append(torch.arange(start, end))
            tok_col.append(torch.arange(col[v], col[v] + span))
            tok_end.append(torch.full((span,), end_col[v]))
            tok_bin.append(torch.full((span,), b))
        for r, v in zip(u.rows, last, strict=True):
            path = []
            while v > 0:
                start, end, _rep, parent = info[v]
                path.append(torch.arange(col[v], col[v] + end - start))
                v = parent
            row_bin[r], cols[r] = b, torch.cat(path[::-1]).to(device)
    src_row_t = torch.cat(src_row).to(device)
    src_pos_t = torch.cat(src_pos).to(device)
    tok_bin_t = torch.cat(tok_bin).to(device)
    tok_col_t = torch.cat(tok_col).to(device)
    ids = torch.zeros(bins, width, dtype=tokens.dtype, device=device)
    ids[tok_bin_t, tok_col_t] = tokens[src_row_t, src_pos_t]
    positions = torch.zeros(bins, width, dtype=torch.long, device=device)
    positions[tok_bin_t, tok_col_t] = src_pos_t
    # a filler column sees only itself: its end is the next column
    ends = torch.arange(1, width + 1, device=device).repeat(bins, 1)
    ends[tok_bin_t, tok_col_t] = torch.cat(tok_end).to(device)
    c = torch.arange(width, device=device)
    visible = (c[None, :] <= c[:, None])[None] & (c[None, :, None] < ends[:, None, :])
    return Layout(ids, positions, visible[:, None], row_bin, cols)
