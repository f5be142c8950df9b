"""Rollout engines: sample token ids and their log-probs from a policy.

Every engine keeps the same small interface (``generate`` and ``sync``), so a recipe
switches between the `transformers` engine here and the vLLM engine by name. One call
takes requests (:class:`Request`; a plain list of token ids is a text request) and returns
:class:`Completion` objects; a vision-language engine (``caps.takes_images``) reads each request's
images from the same call. The log-prob recorded for a sampled token is that of the
temperature-scaled distribution (before top-p truncation), which is what the trainer
recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from polyrl.core.interfaces import Engine, EngineCaps, MixedCalls, MixesRows, Policy
from polyrl.core.observe.timeline import span
from polyrl.core.record import pad_left
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.kv_cache import reserved_cache
from polyrl.core.segment import Tokens
from polyrl.core.train import moe


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # A call with its own sampling stream: the same seed, prompts and params give the same
    # samples, and the engine's own stream (its state_dict) does not advance.
    seed: int | None = None
    # Per sampled token, also the log-probs of the k likeliest tokens (Completion.tokens.top;
    # engines with ``gives_top_logprobs``); 0: none. Sampling is the same either way.
    top_logprobs: int = 0


# Request.on_token(sample, token id, log-prob, top): ``sample`` the completion's index among
# the request's ``params.n``; ``top`` its k likeliest (ids, log-probs) if top_logprobs > 0
TokenSink = Callable[[int, int, float, "tuple[list[int], list[float]] | None"], None]


@dataclass
class Request:
    """One prompt of an engine call.

    ``max_new_tokens``: this prompt's own budget, at most the call's (None: the call's), so
    requests with different budgets share one call. ``on_token``: called from the engine's
    thread with each token of this prompt's completions as it is sampled, while the call
    still decodes (:data:`TokenSink`; engines whose ``caps.streams_tokens`` only, others
    never call it); it must return quickly and not raise. ``vision``: the prompt's joined image
    and video inputs, opaque to the core (a VL policy's ``TakesImageTurns.join_images``, or
    the plugin's own processing); ``images``: the resized images themselves, for an engine
    that hands them to another server (None: it recovers them from ``vision``). Only
    engines whose ``caps.takes_images`` take either.
    """

    prompt: list[int]
    max_new_tokens: int | None = None
    vision: Any = None
    images: list[Any] | None = None
    on_token: TokenSink | None = None

    @property
    def text_only(self) -> bool:
        return self.vision is None and not self.images

    def budget(self, params: SamplingParams) -> int:
        if self.max_new_tokens is None:
            return params.max_new_tokens
        if self.max_new_tokens < 1:
            raise ValueError(f"a request's max_new_tokens must be >= 1, got {self.max_new_tokens}")
        return min(self.max_new_tokens, params.max_new_tokens)


Prompt = Request | Sequence[int]  # a bare id list is a text request


def as_requests(prompts: Sequence[Prompt]) -> list[Request]:
    return [p if isinstance(p, Request) else Request(list(p)) for p in prompts]


def text_requests(engine: Engine, prompts: Sequence[Prompt]) -> list[Request]:
    """The requests, for an engine that takes no images (a clear error if one has any)."""
    out = as_requests(prompts)
    for i, r in enumerate(out):
        if not r.text_only:
            raise TypeError(
                f"{type(engine).__name__}: prompt {i} carries images, and this engine takes "
                "text only; set the policy's engine.name to hf_vl (or vllm_vl)"
            )
    return out


@dataclass
class Completion:
    """One sampled answer to a request: ``tokens`` the sampled tokens with every fact the
    engine recorded of them (log-probs, loss mask 1, weights versions under
    ``rollout.partial``, top alternatives when ``params.top_logprobs`` > 0, MoE routing;
    :class:`~polyrl.core.segment.Tokens`), ``prompt`` the request's prompt with what the
    engine's prefill recorded of it (MoE routing), so ``prompt + tokens`` is the row a
    workflow records. A response's last token is never fed back: its routing is -1."""

    prompt_index: int
    prompt: Tokens
    tokens: Tokens
    finish_reason: str  # "stop" (eos / stop string) or "length"
    text: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.ids

    @property
    def logprobs(self) -> list[float]:
        return self.tokens.logprobs or [0.0] * len(self.tokens)


def token_sinks(requests: Sequence[Request], n: int) -> list[tuple[TokenSink, int] | None] | None:
    """Per sampled row (request-major, ``n`` each): its request's ``on_token`` and sample
    index; None when no request streams."""
    if all(r.on_token is None for r in requests):
        return None
    return [(r.on_token, s) if r.on_token else None for r in requests for s in range(n)]


def stream_tokens(
    sinks: Sequence[tuple[TokenSink, int] | None],
    rows: torch.Tensor,
    done: torch.Tensor,
    tok: torch.Tensor,
    lp: torch.Tensor,
    tops: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Hand each decoding row's new token to its sink: ``rows[j]`` is decode-batch row j's
    index into ``sinks``; rows already ``done`` sampled a token no completion keeps."""
    where, toks, lps = rows.tolist(), tok.tolist(), lp.tolist()
    skip = done.tolist()
    alts = (tops[1].tolist(), tops[0].tolist()) if tops is not None else None  # (ids, lps)
    for j, row in enumerate(where):
        if skip[j] or sinks[row] is None:
            continue
        sink, sample = sinks[row]
        sink(sample, toks[j], lps[j], (alts[0][j], alts[1][j]) if alts is not None else None)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | RowStreams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick next tokens; return (ids, log-probs under the temperature-scaled distribution)."""
    logits = logits.float()
    if params.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, -1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    ids = draw(probs, gen)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def top_logprobs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``params.top_logprobs`` likeliest tokens' log-probs and ids, in the distribution
    :func:`sample_next` gives the sampled token's log-prob in (temperature-scaled)."""
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    return torch.log_softmax(logits, -1).topk(params.top_logprobs, -1)


def seeded(seed: int) -> torch.Generator:
    """The generator of a call that asks for its own stream (``SamplingParams.seed``)."""
    return torch.Generator(device="cpu").manual_seed(seed)


class RowStreams:
    """The random streams of a merged call (``generate_mixed``): each request's rows draw
    from the stream its own engine's separate call would (the engine's generator, or a fresh
    one of ``params.seed``), as many numbers per step as that call would, so a merged call
    samples what the separate calls would (up to the logits' float rounding in another
    batch). A separate call draws one number per row of its decode batch, finished rows
    included until they leave it (``drop_finished``: once an eighth of its batch is done;
    all done: it stops); each engine's decode batch is followed here as that call would
    shrink it. Exact when each engine's rows and the merged call fit one decode batch
    (``batch_size``); past it the batches split otherwise (still each engine's stream).
    """

    def __init__(
        self, gens: Sequence[torch.Generator], groups: Sequence[int], drops: Sequence[bool]
    ) -> None:
        self.gens, self.drops = list(gens), list(drops)
        owner = torch.tensor(list(groups), dtype=torch.long)
        # per engine: the rows (of this batch) its own call's decode batch holds now
        self.batches = [(owner == k).nonzero().squeeze(1) for k in range(len(self.gens))]
        self.ended = torch.zeros(len(owner), dtype=torch.bool)
        self.live = torch.arange(len(owner))  # decode-batch row -> row; set by the engine

    def uniforms(self) -> torch.Tensor:
        """One number per decode-batch row (``live``), each from its engine's stream;
        every engine draws for its whole own batch (rows the merged batch dropped too)."""
        live = self.live.cpu()
        at = torch.full((len(self.ended),), -1, dtype=torch.long)
        at[live] = torch.arange(len(live))
        u = torch.zeros((len(live), 1), dtype=torch.float64)
        for gen, rows in zip(self.gens, self.batches, strict=True):
            if len(rows):
                x = torch.rand((len(rows), 1), generator=gen, dtype=torch.float64)
                j = at[rows]
                u[j[j >= 0]] = x[j >= 0]
        return u

    def settle(self, live: torch.Tensor, done: torch.Tensor, can_select: bool) -> None:
        """After a step: rows ``live[done]`` are finished; shrink each engine's own batch
        as its separate call would."""
        self.ended[live.cpu()[done.cpu()]] = True
        for k, rows in enumerate(self.batches):
            ended = self.ended[rows]
            if bool(ended.all()):
                self.batches[k] = rows[:0]
            elif self.drops[k] and can_select and int(ended.sum()) * 8 >= len(rows):
                self.batches[k] = rows[~ended]


def draw(probs: torch.Tensor, gen: torch.Generator | RowStreams) -> torch.Tensor:
    """One index per row of ``probs [B, V]``, with probability proportional to its entry.

    Inverse CDF: one uniform number per row against the row's cumulative sum (float64, so
    small probabilities keep their share). On CPU ``torch.multinomial`` costs 9x (vocabulary
    120) to 16x (152k) more per draw; at a real vocabulary that is most of a decoding step.
    """
    cdf = probs.double().cumsum(-1)
    if isinstance(gen, RowStreams):
        u = gen.uniforms().to(probs.device)
    else:
        u = torch.rand((probs.shape[0], 1), generator=gen, dtype=torch.float64).to(probs.device)
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)  # u * total < total, so only rounding reaches V


@dataclass
class Prefill:
    """A model family's first forward over a decode batch's distinct prompts (left-padded)."""

    logits: torch.Tensor  # [D, V]: each prompt's next-token logits
    cache: Any  # the KV cache of the prompts, with room for the new tokens
    mask: torch.Tensor  # [D, P]: the prompts' attention mask (0 on left padding)
    next_pos: torch.Tensor  # [D]: the position of each prompt's first new token


class DecodeFamily(Protocol):
    """What a model family supplies to the decode loop (:meth:`HFEngine.decode`): the first
    forward over the prompts, and one cached step. The loop owns everything else (sampling,
    stops, budgets, finished rows leaving the batch, streams, refresh, MoE capture)."""

    def prefill(self, model: Any, requests: Sequence[Request], room: int) -> Prefill:
        """The prompts' forward; ``room``: the new positions the cache must take."""
        ...

    def step(
        self, model: Any, tokens: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Next-token logits ``[B, V]`` after ``tokens [B]`` at positions ``pos [B]``
        (``mask [B, T]``: the attention mask with them included)."""
        ...


class TextFamily:
    """Causal LMs: prompt token ids in, 1-D positions counting up from each first real token."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def prefill(self, model: Any, requests: Sequence[Request], room: int) -> Prefill:
        device = next(model.parameters()).device
        ids, mask = pad_left([r.prompt for r in requests], self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            past_key_values=reserved_cache(model, room),
            logits_to_keep=1,
        )
        return Prefill(out.logits[:, -1], out.past_key_values, mask, pos[:, -1] + 1)

    def step(
        self, model: Any, tokens: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[:, -1]


# generate_mixed: the model that runs a step's rows each as its own policy's (the rows'
# prompt indices in; None: the model alone, rows set before each forward)
Route = Callable[[torch.Tensor | None], torch.nn.Module]
Row = tuple[int, int]  # a decode row: (its request's index in the call, its token budget)


@dataclass
class Decoded:
    """What the decode loop sampled, per row of its batch (``[B, max_new_tokens, ...]``)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor  # [B]
    stopped: torch.Tensor  # [B]: ended by a stop id or string (else by its budget)
    versions: torch.Tensor | None  # partial mode: the weights version of each token
    top_ids: torch.Tensor | None  # params.top_logprobs > 0: the k likeliest of each step
    top_logprobs: torch.Tensor | None
    # MoE models: each row's prompt then response experts (see Completion.experts)
    experts: list[torch.Tensor] | None = None


class HFEngine:
    """Batched sampling with a KV cache on the policy's own `transformers` model.

    In local mode it shares the policy's module, so weight sync costs nothing.
    ``drop_finished`` (default on): rows that stopped leave the decode batch, KV cache
    included, once they are an eighth of it, so a few long responses do not keep paying
    for the many short ones; off, the whole batch decodes until its last row stops
    (what transformers' ``generate`` does). The model family's pieces (``family``, a
    :class:`DecodeFamily`) are all a subclass changes to decode another kind of model.
    """

    def __init__(
        self, policy: Policy, *, batch_size: int = 256, seed: int = 0, drop_finished: bool = True
    ) -> None:
        self.policy = policy
        self.batch_size = batch_size
        self.drop_finished = drop_finished
        self.tokenizer = policy.tokenizer
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.family: DecodeFamily = TextFamily(self.tokenizer.pad_token_id)
        self.refresh: Callable[[], int] | None = None  # set_refresh: partial mode

    # the policy's own module and dtype; Request.on_token at every step; rollout.partial
    caps = EngineCaps(
        exact_logprobs=True, streams_tokens=True, gives_top_logprobs=True, partial_rollouts=True
    )

    def set_refresh(self, refresh: Callable[[], int] | None) -> None:
        """interfaces.PartialRollouts: each call made while set hands ``refresh`` to its
        decode loop, which calls it before each decoding step."""
        self.refresh = refresh

    def mix_key(self) -> Any:
        """interfaces.MixedCalls: engines whose policies run each other's rows in one
        forward (``MixesRows``: LoRA adapters on one base) share calls; not in partial
        mode, whose weight refresh is per policy."""
        if self.refresh is not None or not isinstance(self.policy, MixesRows):
            return None
        group = self.policy.row_group()
        return None if group is None else ("hf", group)

    @torch.no_grad()
    def generate_mixed(
        self, calls: Sequence[tuple[Any, Sequence[Prompt]]], params: SamplingParams
    ) -> list[list[Completion]]:
        """interfaces.MixedCalls: one decode loop over the requests of several engines'
        policies, every forward running each row through its own policy (``rows_of``);
        each engine's rows sampled from its own stream (or ``params.seed``'s), as its
        separate call would (:class:`RowStreams`)."""
        key = self.mix_key()
        rows: list[Row] = []
        owner: list[int] = []  # per prompt of the call: which engine's
        starts: list[int] = []
        every: list[Request] = []  # the call's requests, in row order
        for k, (engine, prompts) in enumerate(calls):
            if key is None or not isinstance(engine, MixedCalls) or engine.mix_key() != key:
                raise TypeError(
                    f"HFEngine of policy {self.policy.name!r} cannot serve the requests of "
                    f"{type(engine).__name__} in its call (a policy on another base?)"
                )
            requests = self.requests(prompts)
            starts.append(len(owner))
            rows += [
                (starts[k] + i, r.budget(params))
                for i, r in enumerate(requests)
                for _ in range(params.n)
            ]
            every += requests
            owner += [k] * len(requests)
        assert isinstance(self.policy, MixesRows)  # mix_key says so
        gens = [engine.gen if params.seed is None else seeded(params.seed) for engine, _ in calls]
        drops = [engine.drop_finished for engine, _ in calls]
        groups = [owner[pi] for pi, _ in rows]
        sinks = token_sinks(every, params.n)
        owners = torch.tensor(owner, dtype=torch.long)
        out: list[Completion] = []
        with self.policy.rows_of([engine.policy for engine, _ in calls]) as select:

            def route(pis: torch.Tensor | None) -> torch.nn.Module:
                return select(None if pis is None else owners[pis.cpu()])

            for start in range(0, len(rows), self.batch_size):
                part = slice(start, start + self.batch_size)
                streams = RowStreams(gens, groups[part], drops)
                out += self._generate_batch(
                    every, rows[part], params, streams, sinks and sinks[part], route=route
                )
        answers: list[list[Completion]] = [[] for _ in calls]
        for c in out:
            k = owner[c.prompt_index]
            answers[k].append(replace(c, prompt_index=c.prompt_index - starts[k]))
        return answers

    def sync(self) -> None:  # same module as the trainer's
        return None

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["rng"])

    def requests(self, prompts: Sequence[Prompt]) -> list[Request]:
        """The call's requests (a text engine refuses images with a clear error)."""
        return text_requests(self, prompts)

    def batches(self, rows: Sequence[Row], n: int) -> list[slice]:
        """The decode batches of a call's rows: ``batch_size`` rows each."""
        return [slice(s, s + self.batch_size) for s in range(0, len(rows), self.batch_size)]

    def stream(self, gen: torch.Generator, rows: int) -> torch.Generator | RowStreams:
        """Where a decode batch of ``rows`` rows draws its random numbers: the call's
        generator, one number per row still in the batch."""
        return gen

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, grouped by prompt (prompt 0's first)."""
        requests = self.requests(prompts)
        rows = [(i, r.budget(params)) for i, r in enumerate(requests) for _ in range(params.n)]
        gen = self.gen if params.seed is None else seeded(params.seed)
        sinks = token_sinks(requests, params.n)
        out: list[Completion] = []
        for part in self.batches(rows, params.n):
            batch = rows[part]
            stream = self.stream(gen, len(batch))
            out += self._generate_batch(requests, batch, params, stream, sinks and sinks[part])
        return out

    def _stop_ids(self, params: SamplingParams, device: torch.device) -> torch.Tensor:
        """The ids that end a row: the call's stop ids and the tokenizer's eos."""
        stop_ids = set(params.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        return torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

    def _generate_batch(
        self,
        requests: Sequence[Request],
        rows: Sequence[Row],
        params: SamplingParams,
        gen: torch.Generator | RowStreams,
        sinks: list[tuple[TokenSink, int] | None] | None = None,
        route: Route | None = None,
    ) -> list[Completion]:
        model = self.policy.model if route is None else route(None)
        with (
            span("generate", engine=self.policy.name, requests=len(rows)) as traced,
            moe.recording(model) as routing,  # MoE models: each token's experts (None: dense)
        ):
            decoded = self.decode(
                model,
                requests,
                rows,
                params,
                gen,
                sinks,
                refresh=self.refresh,
                route=route,
                routing=routing,
            )
            out = self._completions(requests, rows, decoded)
            traced.add(tokens=sum(len(c.token_ids) for c in out))
            return out

    def decode(
        self,
        model: torch.nn.Module,
        requests: Sequence[Request],
        rows: Sequence[Row],
        params: SamplingParams,
        gen: torch.Generator | RowStreams,
        sinks: list[tuple[TokenSink, int] | None] | None = None,
        *,
        refresh: Callable[[], int] | None = None,
        route: Route | None = None,
        routing: moe.Routing | None = None,
    ) -> Decoded:
        """The decode loop: one decode batch of ``rows`` (a request's rows next to each
        other) sampled from ``model`` through the family's prefill and steps.

        ``refresh`` (partial mode): called before each forward, it may load newer weights
        and returns their version; ``route`` (``generate_mixed``): before each forward, its
        rows each through their own policy; ``routing`` (MoE models): an open recorder,
        whose experts each completion keeps."""
        device = next(model.parameters()).device
        stop_t = self._stop_ids(params, device)
        # Each distinct prompt is prefilled once; the n rows of its group then share its
        # KV cache (expanded by index), so a group costs one prompt pass, not n.
        distinct: dict[int, int] = {}
        for pi, _ in rows:
            distinct.setdefault(pi, len(distinct))
        caps = torch.tensor([c for _, c in rows], dtype=torch.long, device=device)
        b, steps = len(rows), params.max_new_tokens
        version = refresh() if refresh is not None else 0  # of the weights that make `logits`
        if route is not None:  # generate_mixed: each prompt through its own policy
            route(torch.tensor(list(distinct)))
        first = self.family.prefill(model, [requests[pi] for pi in distinct], steps)
        cache, mask, logits, next_pos = first.cache, first.mask, first.logits, first.next_pos
        can_select = hasattr(cache, "batch_select_indices")
        if routing is not None:  # each distinct prompt's real tokens, as prefilled
            shape = (routing.num_layers, routing.top_k)
            routed = routing.take().view(*mask.shape, *shape).cpu()
            prompt_experts = [routed[d][mask[d].bool().cpu()] for d in range(len(distinct))]
            response_experts = torch.full((b, steps, *shape), -1).to(routing.dtype)
        if len(distinct) < b:
            expand = torch.tensor([distinct[pi] for pi, _ in rows], device=device)
            if not can_select:
                raise TypeError(f"{type(cache).__name__} cannot expand a shared prompt cache")
            cache.batch_select_indices(expand)
            mask, next_pos, logits = mask[expand], next_pos[expand], logits[expand]
        can_drop = self.drop_finished and can_select
        versions = torch.zeros((b, steps), dtype=torch.long, device=device)
        tokens = torch.zeros((b, steps), dtype=torch.long, device=device)
        logps = torch.zeros((b, steps), dtype=torch.float32, device=device)
        k_top = params.top_logprobs
        top_ids = torch.zeros((b, steps, k_top), dtype=torch.long, device=device)
        top_lps = torch.zeros((b, steps, k_top), dtype=torch.float32, device=device)
        stopped = torch.zeros(b, dtype=torch.bool, device=device)  # per row of `rows`
        lengths = torch.full((b,), steps, dtype=torch.long, device=device)
        live = torch.arange(b, device=device)  # decode-batch row -> row of `rows`
        done = torch.zeros(b, dtype=torch.bool, device=device)  # per decode-batch row
        streams = gen if isinstance(gen, RowStreams) else None
        width = mask.shape[1]  # step t's mask: the first width + t + 1 columns
        mask = torch.cat([mask, mask.new_ones((b, steps))], 1)
        whole = True  # no row has left the batch yet: rows are written by slice
        for t in range(steps):
            if streams is not None:
                streams.live = live
            tok, lp = sample_next(logits, params, gen)
            at = slice(None) if whole else live
            tokens[at, t], logps[at, t] = tok, lp
            if refresh is not None:
                versions[at, t] = version
            if k_top:
                top_lps[at, t], top_ids[at, t] = top_logprobs(logits, params)
            if sinks:
                step_top = (top_lps[at, t], top_ids[at, t]) if k_top else None
                stream_tokens(sinks, live, done, tok, lp, step_top)
            hit = torch.isin(tok, stop_t)
            if params.stop:
                hit |= self._hit_stop_string(tokens[at, : t + 1], done, params.stop)
            ending = ~done & (hit | (caps[at] <= t + 1))  # stopped, or its own budget spent
            if bool(ending.any()):
                lengths[live[ending]] = t + 1
                stopped[live[ending & hit]] = True
                done |= ending
                if streams is not None:
                    streams.settle(live, done, can_select)
                if bool(done.all()):
                    break
                if can_drop and int(done.sum()) * 8 >= done.numel():
                    keep = (~done).nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    live, tok, next_pos, mask = live[keep], tok[keep], next_pos[keep], mask[keep]
                    done, whole = done[keep], False
            if t == steps - 1:
                break
            if refresh is not None:  # newer weights go on from the cache the old ones made
                version = refresh()
            if route is not None:  # this step's rows, each through its own policy
                route(torch.tensor([rows[k][0] for k in live.tolist()]))
            logits = self.family.step(model, tok, mask[:, : width + t + 1], next_pos, cache)
            if routing is not None:  # the tokens fed in: response position t
                response_experts[live.cpu(), t] = routing.take().cpu()
            next_pos = next_pos + 1
        experts = None
        if routing is not None:
            experts = [
                torch.cat([prompt_experts[distinct[pi]], response_experts[k, : int(lengths[k])]])
                for k, (pi, _) in enumerate(rows)
            ]
        return Decoded(
            tokens,
            logps,
            lengths,
            stopped,
            versions if refresh is not None else None,
            top_ids if k_top else None,
            top_lps if k_top else None,
            experts,
        )

    def _completions(
        self, requests: Sequence[Request], rows: Sequence[Row], out: Decoded
    ) -> list[Completion]:
        """The completions of a decode batch's rows (``requests``: the call's)."""
        lengths = out.lengths.tolist()
        tokens_of = [t[:n] for t, n in zip(out.tokens.tolist(), lengths, strict=True)]
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens_of]
        logps, stopped = out.logprobs.tolist(), out.stopped.tolist()
        result = []
        for k, (pi, _) in enumerate(rows):
            n = lengths[k]
            reason = "stop" if stopped[k] else "length"
            facts: dict[str, Any] = {}
            if out.versions is not None:
                facts["versions"] = out.versions[k, :n].tolist()
            if out.top_ids is not None and out.top_logprobs is not None:
                ids, lps = out.top_ids[k, :n].tolist(), out.top_logprobs[k, :n].tolist()
                facts["top"] = list(zip(ids, lps, strict=True))
            prompt = Tokens.given(requests[pi].prompt)
            if out.experts is not None:  # the prompt's then the response's
                routed = out.experts[k]
                facts["experts"] = routed[len(routed) - n :]
                prompt = Tokens.given(prompt.ids, experts=routed[: len(routed) - n])
            tokens = Tokens.sampled(tokens_of[k], logps[k][:n], **facts)
            result.append(Completion(pi, prompt, tokens, reason, texts[k]))
        return result

    def _hit_stop_string(
        self, tokens: torch.Tensor, done: torch.Tensor, stops: list[str]
    ) -> torch.Tensor:
        hit = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for k in range(tokens.shape[0]):
            if done[k]:
                continue
            tail = self.tokenizer.decode(tokens[k, -16:].tolist())
            hit[k] = any(s in tail for s in stops)
        return hit


ENGINES.register("hf", HFEngine)
