"""The contracts between the core and its parts, in one place.

Each kind of part is a :class:`typing.Protocol`: what the core calls on it. A part also
may implement optional hooks; each hook is a protocol of its own (the methods the core
calls), so the core asks ``isinstance(part, Hook)`` rather than probing attribute names,
and a reader finds every hook here. What an engine or a policy kind can do without a
method of its own to call is data: one frozen dataclass each (:class:`EngineCaps`,
:class:`PolicyCaps`), declared as the class's ``caps``. Parts register in the registries of :mod:`polyrl.core.registry`, with their
typed options (:mod:`polyrl.core.options`).

How to add each kind of part, with an example, is in ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Any,
    ClassVar,
    Concatenate,
    Literal,
    Protocol,
    Required,
    TypeAlias,
    TypedDict,
    Unpack,
    runtime_checkable,
)

import torch
from tensordict import TensorDict

from polyrl.core.train.router_terms import RoutedPass, RouterTerms

# --------------------------------------------------------------------------- tasks


@runtime_checkable
class Task(Protocol):
    """A synthetic task that writes its own data (``task.name``): a module or an object.

    ``write_dataset(out_dir, seed=..., **options)`` writes train and eval JSONL files and
    returns their paths; its keyword parameters are the task's options (``task.args``).
    :func:`polyrl.core.tasks.common.split_task` makes one from a row maker.
    """

    def write_dataset(self, out_dir: str | Path, *, seed: int, **options: Any) -> tuple: ...


@runtime_checkable
class HasSFTRows(Protocol):
    """A task that can say what a supervised warm start trains on (``sft.steps`` with no
    ``sft.data.path``): prompt -> response rows made from its training rows."""

    def sft_rows(self, rows: list[dict]) -> list[dict]: ...


@runtime_checkable
class HasCorpus(Protocol):
    """A task whose texts train a tiny tokenizer/model offline (``build_args.corpus``)."""

    def corpus(self) -> list[str]: ...


# --------------------------------------------------------------------------- policies


class PolicyBuild(TypedDict, total=False):
    """The keyword arguments every policy kind is built with, besides its name and config."""

    total_steps: Required[int]  # updates in the run: the learning-rate schedule's length
    need_reference: Required[bool]  # keep a frozen KL reference (full fine-tunes)
    shared: dict | None  # one dict per run: what the run's policies share (a LoRA base)
    device: str | torch.device | None  # absent or None: the kind's default


@dataclass(frozen=True)
class PolicyCaps:
    """What a policy kind can do beyond :class:`Policy`, declared once as its class's
    ``caps`` (a subclass replaces fields), read with :func:`policy_caps`; a kind that
    declares none can do none of these."""

    ray_lora: bool = False  # its LoRA adapters train under the Ray backend
    # its passes route experts (routing replay, load-balancing loss), so ``moe`` options
    # are honoured; a kind with a pass of its own (qwen_vl) or no routers (diffusion) not
    routes_experts: bool = False


def policy_caps(policy: object) -> PolicyCaps:
    """What ``policy`` (a policy or its kind's class) declares it can do."""
    caps = getattr(policy, "caps", None)
    return caps if isinstance(caps, PolicyCaps) else PolicyCaps()


@runtime_checkable
class Policy(Protocol):
    """A trainable model with its own optimizer, schedule and checkpoint (``POLICIES``).

    Constructed as ``kind(name, cfg, *, total_steps, need_reference, shared, device)``;
    ``cfg.args`` holds the kind's declared options. ``load_tokenizer(cfg)`` is a static
    method, so data can be checked before any weights load.
    """

    name: str
    cfg: Any  # its policies.<name> entry (core.train.policy.PolicyConfig)
    device: torch.device  # where it trains
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer | None  # None: a frozen policy (train: false)
    scheduler: Any
    # The frozen KL reference (None: no KL, or LoRA, whose reference is the adapter-off
    # base) and whether a warm start has moved it to the warmed-up weights.
    reference: torch.nn.Module | None
    reference_warmed: bool

    def __init__(self, name: str, cfg: Any, **build: Unpack[PolicyBuild]) -> None:
        """How the core builds a policy: ``POLICIES.get(kind)(name, cfg, **build)``."""

    @staticmethod
    def load_tokenizer(cfg: Any) -> Any:
        """The tokenizer (or processor) ``cfg`` names, without loading any weights."""

    def logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def ref_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export(self, out_dir: str | Path) -> Path: ...

    def sft_optimizer(self, lr: float | None) -> AbstractContextManager[Any]:
        """A context in which updates use a constant-rate optimizer (``sft.lr``; None: the
        RL rate), for a supervised warm start; the RL optimizer and schedule come back
        after it, untouched."""


@runtime_checkable
class HasProcessor(Protocol):
    """A policy whose processor (tokenizer, image processor, chat template) is what an
    export saves beside the weights (a VLM)."""

    processor: Any


@runtime_checkable
class TakesImageTurns(Protocol):
    """A policy whose conversations may carry images turn after turn (a VLM), as a
    multi-turn workflow uses it without knowing the model family.

    The workflow renders each turn's messages with one ``image_token_id`` per image (the
    chat template's placeholder), then calls ``encode_images`` once per turn: each image's
    token ids to splice in place of its placeholder (expanded once, never re-encoded) and
    one opaque per-turn handle. ``join_images(handles, starts, key)`` joins a prompt's (or a
    row's) handles, in order, into the one object an engine request's ``vision`` and the
    policy's log-prob pass take from the record's ``vision`` column; ``starts`` are each
    image's first spliced token, counted from the row's first prompt token, so the model's
    placeholders are known by position (a sampled placeholder id stays text). ``key``
    names the joined object (rows sharing a key share it). Errors name what was wrong.
    """

    image_token_id: int

    def encode_images(self, images: list[Any]) -> tuple[list[list[int]], Any]: ...

    def join_images(self, handles: list[Any], starts: list[int], key: str) -> Any: ...


def splice_images(
    ids: Sequence[int], token: int, expansions: Sequence[Sequence[int]], where: str
) -> tuple[list[int], list[int]]:
    """``ids`` (a turn the chat template rendered with one ``token`` per image) with each
    placeholder replaced by its image's ids from ``encode_images``, and where each image's
    ids start. ``where`` names the turn in the error when the counts differ."""
    at = [i for i, t in enumerate(ids) if t == token]
    if len(at) != len(expansions):
        raise ValueError(
            f"{where}: the chat template rendered {len(at)} image placeholders for "
            f"{len(expansions)} images; does the text itself contain the image token?"
        )
    out: list[int] = []
    starts, prev = [], 0
    for i, expansion in zip(at, expansions, strict=True):
        out += ids[prev:i]
        starts.append(len(out))
        out += expansion
        prev = i + 1
    return out + list(ids[prev:]), starts


@runtime_checkable
class HostImageTurns(Protocol):
    """A policy class whose image turns need only its tokenizer (the processor it loads),
    not its weights: the Ray driver's handle on such a policy takes image turns as the
    local policy does, while the model trains on the workers."""

    @classmethod
    def image_turns(cls, tokenizer: Any) -> TakesImageTurns: ...


@runtime_checkable
class ShardsItsRoot(Protocol):
    """A policy whose FSDP root is not ``model`` itself (a VLM's language model), so the
    parts around it are gathered by the Ray worker."""

    def fsdp_root(self, model: torch.nn.Module) -> torch.nn.Module: ...


@runtime_checkable
class ExportsWeights(Protocol):
    """A policy that writes its own export format from gathered weights (rank 0)."""

    def export_weights(self, out_dir: str | Path, gathered: dict[str, torch.Tensor]) -> Path: ...


@runtime_checkable
class LoadsTrainableState(Protocol):
    """A policy that restores only its trainable tensors (LoRA adapters) in a worker."""

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class MixesRows(Protocol):
    """A policy whose model runs rows of other policies in the same forward (LoRA adapters
    on one shared base), as an engine serving them in one call needs: policies with equal
    ``row_group()`` (None: none) may share a batch. ``rows_of(owners)`` is a context that
    yields ``select``: ``select(ids)`` (a long tensor, one entry per row of the next
    forwards) makes row ``i`` run as policy ``owners[ids[i]]`` and returns the model to call
    (``select(None)``: the model, rows unchanged)."""

    def row_group(self) -> Any: ...

    def rows_of(
        self, owners: Sequence[Any]
    ) -> AbstractContextManager[Callable[[torch.Tensor | None], torch.nn.Module]]: ...


@runtime_checkable
class Shadows(Protocol):
    """A policy that makes its own engine-side copy for asynchronous rollouts
    (``core.rollout.rollouts.shadow``): same tokenizer and config, frozen weights of its own that
    the trainer's updates do not touch. For when a copy of ``model`` alone does not fit
    (LoRA adapters on a base shared by several policies: their copies share one copied
    model, so one engine call still serves them all)."""

    def shadow(self) -> Any: ...


@runtime_checkable
class ConfigOnDriver(Protocol):
    """A policy whose model lives elsewhere (a Ray worker group): the driver reads the
    model's Hugging Face config from its folder, for throughput's FLOP count (MFU)."""

    def model_config(self) -> Any | None:
        """The model's transformers config; None where its folder holds none (diffusers)."""
        ...


@runtime_checkable
class MakesImages(Protocol):
    """A policy whose rows are images made in denoising steps, not tokens (a diffusion
    policy): :mod:`polyrl.core.observe.throughput` reports its images/s, and its MFU from what one
    step costs (the record's ``response_mask`` marks a row's steps, ``loss_mask`` the
    trained ones)."""

    def step_flops(self, record: TensorDict) -> tuple[torch.Tensor, ...] | None:
        """Per row of ``record``: the FLOPs of one denoising step as sampled, as trained
        (forward and backward) and as a log-prob pass without gradient (old or reference
        log-probs); None where the model's count is not known."""
        ...


@runtime_checkable
class CountsVisionFlops(Protocol):
    """A token policy with a vision tower (a VL model): :mod:`polyrl.core.observe.throughput` adds
    what the tower costs to the language model's FLOPs of each row."""

    def vision_flops(self, record: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``record``: the FLOPs of the tower encoding the row's images and
        videos in one forward, and in one training pass (forward and backward; the forward
        alone when the tower takes no gradient)."""
        ...


@runtime_checkable
class OwnsKL(Protocol):
    """A policy whose KL to its reference is not a function of per-token log-probs (say,
    two Gaussians compared through their means), for the estimators it names.

    When ``algorithm.kl_estimator`` is one of ``kl_estimators`` the trainer stores
    ``reference_terms`` as the batch's ``ref_logprobs`` (once per update, no gradient) and
    gets log-probs, entropy and the per-token KL from one forward of ``logprobs_and_kl``;
    for any other estimator it uses ``ref_logprobs`` and ``KL_ESTIMATORS``, as for every
    policy.
    """

    kl_estimators: ClassVar[tuple[str, ...]]

    def reference_terms(
        self, batch: TensorDict, temperature: float, estimator: str
    ) -> torch.Tensor:
        """What ``estimator`` needs from the reference, one entry per row of ``batch``."""

    def logprobs_and_kl(
        self,
        batch: TensorDict,
        temperature: float,
        *,
        with_entropy: bool,
        estimator: str,
        reference: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(log-probs [B,T], entropy [B,T] or None, KL [B,T]) from one forward, where
        ``reference`` is this batch's ``reference_terms``."""


@runtime_checkable
class UpdatesTogether(Protocol):
    """A policy whose update passes may merge with other policies' (LoRA adapters on one
    shared base): the session updates the trained policies with equal ``update_group()``
    (None: alone) in one ``trainer.update_together`` (local backend), which runs micro-batch
    ``k`` of each as ONE forward/backward, each policy's rows through its own weights.

    ``logprobs_together(policies, batches, temperature, with_entropy)`` is called on the
    first of them; it answers, for each batch, what ``policies[i].logprobs(batches[i], ...)``
    would (gradients reaching each policy's own weights only); ``ref_logprobs_together``
    likewise what ``policies[i].ref_logprobs(batches[i], ...)`` would."""

    def update_group(self) -> Any: ...

    def ref_logprobs_together(
        self, policies: Sequence[Any], batches: Sequence[TensorDict], temperature: float = 1.0
    ) -> list[torch.Tensor]: ...

    def logprobs_together(
        self,
        policies: Sequence[Any],
        batches: Sequence[TensorDict],
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]: ...


@runtime_checkable
class UpdatesTogetherBackend(Protocol):
    """A backend that runs the update of several policies in shared passes
    (:func:`polyrl.core.train.trainer.update_together`; LoRA adapters on one base, local)."""

    def update_together(
        self,
        policies: list[Any],
        batches: list[TensorDict],
        algo: Any,
        *,
        temperature: float,
        generator: torch.Generator,
        correction: str | None = None,
    ) -> list[dict[str, float]]: ...


@runtime_checkable
class PacksRows(Protocol):
    """A policy whose log-prob pass drops padding (rows packed into one sequence), so the
    trainer may form micro-batches by a token budget instead of a row count."""

    def token_budget(
        self, batch: TensorDict
    ) -> tuple[torch.Tensor, int] | tuple[torch.Tensor, int, list[list[int]]] | None:
        """(tokens per row of ``batch``, tokens per micro-batch), or None for row-count
        micro-batches (packing off, or not exact for this model). A third item, when the
        passes share prefixes: the units (lists of rows) that must share a micro-batch;
        each row's tokens are then what it adds to its unit (a shared prefix once)."""


@runtime_checkable
class RoutesExperts(Protocol):
    """A policy whose model may route tokens to experts (mixture of experts, core/train/moe.py).
    Its update passes are ``routed_logprobs``: the log-probs with the pass's own routing
    (:class:`~polyrl.core.train.router_terms.RoutedPass`; ``router`` None when dense). The trainer
    adds ``router_loss(router, batch, agg, metrics)`` to the loss: the load-balancing term
    of that pass over ``batch`` (the micro-batch), weighted by its share of the mini-batch
    ``agg`` describes, 0.0 when off; the policy appends its router metrics (expert load,
    engine/trainer routing mismatch, the aux loss) to ``metrics``."""

    def routed_logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> RoutedPass: ...

    def router_loss(
        self, router: RouterTerms, batch: TensorDict, agg: Any, metrics: dict[str, list[float]]
    ) -> torch.Tensor | float: ...


# --------------------------------------------------------------------------- engines


@runtime_checkable
class Engine(Protocol):
    """Rollout generation for one policy (``ENGINES``), built as
    ``engine(policy, seed=..., **options)``."""

    def generate(self, prompts: Sequence[Any], params: Any) -> list:
        """``params.n`` completions per prompt, grouped by prompt (prompt 0's first).
        ``prompts``: :class:`~polyrl.core.rollout.engine.Request` objects or bare id lists (text)."""

    def sync(self) -> None:
        """Pull the policy's current weights (after an update)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do, declared once as its class's ``caps`` (a subclass replaces
    fields: ``dataclasses.replace(Base.caps, ...)``; a handle or wrapper sets its own from
    its engine's). The core reads it with :func:`engine_caps`, never by probing attributes;
    an engine that declares none can do none of these."""

    # its log-probs are the trainer's own computation (the same module in the same dtype,
    # e.g. the HF engine): ``algorithm.rollout_correction.level: auto`` leaves its rows
    # uncorrected when they are also not stale
    exact_logprobs: bool = False
    # it hands each token to its request's ``Request.on_token`` as it is sampled (from the
    # engine's thread, at every decoding step), so a server can send tokens while the call
    # still decodes; others (vLLM's offline ``LLM.generate``, a Ray actor's handle) return
    # whole completions only and never call ``on_token``
    streams_tokens: bool = False
    gives_top_logprobs: bool = False  # it honours ``SamplingParams.top_logprobs``
    # its requests may carry images and videos (``Request.vision``, ``Request.images``);
    # engines without it refuse them
    takes_images: bool = False
    # it needs the resized images themselves (``Request.images``), not only their processed
    # pixels, e.g. to hand them to vLLM (an engine that also ``takes_images``)
    needs_images: bool = False
    # it serves image requests in one ``paint`` call (core/rollout/paint.py PaintsImages)
    paints_images: bool = False
    # it takes newer weights in the middle of a call (``rollout.partial``; the contract of
    # :class:`PartialRollouts`)
    partial_rollouts: bool = False
    # its methods beyond :class:`Engine` that the Ray backend forwards to its actor, by name
    # (e.g. a VL engine's image-aware generate)
    remote_methods: tuple[str, ...] = ()


def engine_caps(engine: object) -> EngineCaps:
    """What ``engine`` (an engine, its class or a Ray handle) declares it can do."""
    caps = getattr(engine, "caps", None)
    return caps if isinstance(caps, EngineCaps) else EngineCaps()


def streams_tokens(engine: object) -> bool:
    """Whether ``engine`` calls ``Request.on_token`` while it decodes."""
    return engine_caps(engine).streams_tokens


def takes_images(engine: object) -> bool:
    """Whether ``engine`` (an engine, its class or a Ray handle) takes image requests."""
    return engine_caps(engine).takes_images


@runtime_checkable
class PartialRollouts(Protocol):
    """An engine that takes newer weights in the middle of a call (``rollout.partial``;
    its class declares ``EngineCaps.partial_rollouts``): after ``set_refresh(refresh)``,
    the engine calls ``refresh()`` before each decoding step; it loads any newer weights and
    returns their version, and the requests in flight go on under them with the KV cache
    they have. Each :class:`Completion`'s token segment then carries the weights version of
    every token. An engine may ask at coarser points and say so: the diffusion engine asks
    once per sampling pass, so each trajectory is sampled by one version, recorded on each
    of its denoising steps (``token_version``). ``set_refresh(None)`` ends it."""

    def set_refresh(self, refresh: Callable[[], int] | None) -> None: ...


@runtime_checkable
class MixedCalls(Protocol):
    """An engine that serves other engines' requests in its own call (LoRA adapters on one
    shared base): the batcher merges the waiting requests of engines whose ``mix_key()`` is
    equal (None: this engine serves only its own) into one ``generate_mixed`` on the first
    of them. ``calls``: (engine, requests) per engine; the answer: each engine's
    ``params.n`` completions per request, grouped by request as ``generate`` gives them,
    each engine's rows sampled as its own (its adapter, weights and seeds)."""

    def mix_key(self) -> Any: ...

    def generate_mixed(self, calls: Sequence[tuple[Any, Sequence[Any]]], params: Any) -> list: ...


@runtime_checkable
class Closable(Protocol):
    """A part holding processes or memory to give back when the run ends."""

    def close(self) -> None: ...


# --------------------------------------------------------------------------- workflows


Phase = Literal["train", "eval"]  # what a rollout is for: the core says, never inferred


@runtime_checkable
class Workflow(Protocol):
    """Turns prompt items into one rollout record (``WORKFLOWS``), built as
    ``workflow(ctx, **options)``. ``phase``: a training batch or a held-out evaluation
    (sampled with ``eval``'s settings); a workflow that treats them differently (saves
    image grids, skips exploration) reads it here."""

    def rollout(self, items: list, params: Any, phase: Phase = "train") -> TensorDict: ...


@runtime_checkable
class ChecksConfig(Protocol):
    """A workflow class that checks the recipe beyond its own options at config time
    (agents that name policies, say), before any model loads."""

    @staticmethod
    def validate_config(cfg: Any) -> None: ...


@runtime_checkable
class Learns(Protocol):
    """A workflow that fits parts of its own on the credited record (a critic)."""

    def learn(self, record: TensorDict) -> dict[str, float]: ...


@runtime_checkable
class Stateful(Protocol):
    """A part whose state goes into the checkpoint (a workflow's critic)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class ReportsRollout(Protocol):
    """A workflow with metrics of its last rollout (calls per engine, turns, ...)."""

    def rollout_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class WritesTranscriptKeys(Protocol):
    """A workflow whose rows carry facts (in ``meta``) worth writing to transcripts."""

    transcript_keys: tuple[str, ...]


# --------------------------------------------------------------------------- scoring


# Scoring parts are plain functions: their leading positional arguments are typed, and
# what follows (``...``) is each part's own keyword options, which no protocol could list.

# ``reward(sample, **options) -> float`` (sync or async); batched rewards, registered with
# ``batched=True``, take ``list[Sample]`` and return one value per sample (``REWARDS``)
Reward: TypeAlias = Callable[Concatenate[Any, ...], Any]
# ``credit(record, algorithm_config, **options) -> metrics``: writes the record's
# ``advantages`` (``CREDIT``; options in ``algorithm.credit_args``)
Credit: TypeAlias = Callable[Concatenate[TensorDict, Any, ...], dict[str, float]]
# ``advantage(rewards [B,R], mask [B,R], groups [B], algorithm_config) -> advantages [B,R]``
# (``ADVANTAGES``, called by a credit scheme)
Advantage: TypeAlias = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
# ``loss(logprobs, old_logprobs, advantages, mask, algorithm_config, agg, *, weights=None)
# -> (loss, metrics)`` (``POLICY_LOSSES``): reads its options from ``algorithm.loss_args``;
# ``weights`` [B,R] (rollout correction) multiply each token's loss
PolicyLoss: TypeAlias = Callable[
    Concatenate[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any, ...],
    tuple[torch.Tensor, dict[str, float]],
]
# ``estimator(logprobs, ref_logprobs) -> per-token KL`` (``KL_ESTIMATORS``)
KLEstimator: TypeAlias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
