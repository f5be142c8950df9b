"""Policies: a trainable model with its own optimizer, schedule, reference and checkpoint.

The trainer holds ``{name: Policy}``; one entry is the single-agent case. A policy kind
(causal LM here; VLM and diffusion kinds come from plugins) only has to compute
log-probs of a record's response tokens; the trainer does the rest. A kind also offers
``load_tokenizer(cfg)`` (a static method), so the session can check the data with the
policy's tokenizer before any weights load. The forward-pass layouts that compute the
log-probs (padded, packed, prefix trees) are :mod:`polyrl.core.train.passes`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Unpack, cast

import torch
from tensordict import TensorDict

from polyrl.core.config import NONNEGATIVE, ConfigError, doc, doc_factory
from polyrl.core.interfaces import PolicyBuild, PolicyCaps, policy_caps
from polyrl.core.record import to_device
from polyrl.core.registry import ENGINES, MODELS, POLICIES
from polyrl.core.runner.builds import ensure_model
from polyrl.core.train import moe, prefix
from polyrl.core.train.algorithms import AggInfo
from polyrl.core.train.passes import packs, prefix_units, response_logprobs, shares
from polyrl.core.train.router_terms import RoutedPass, RouterTerms

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class OptimConfig:
    lr: float = doc(
        1e-5,
        "peak learning rate (AdamW); 0: RL leaves the policy as its SFT warm start made it "
        "(a frozen baseline that still warm-starts, at sft.lr)",
    )
    weight_decay: float = doc(0.0, "AdamW weight decay")
    betas: list[float] = doc([0.9, 0.999], "AdamW betas")
    eps: float = doc(1e-8, "AdamW epsilon")
    warmup_steps: int = doc(0, "linear warm-up in optimizer steps")
    schedule: Literal["constant", "linear", "cosine"] = doc(
        "constant", "after warm-up: constant, or linear / cosine decay to 0"
    )
    max_grad_norm: float = doc(1.0, "gradient clipping norm; 0 disables clipping")


@dataclass
class LoraConfig:
    r: int = doc(0, "LoRA rank; 0 trains all weights")
    alpha: float = doc(16.0, "LoRA alpha")
    dropout: float = doc(0.0, "LoRA dropout")
    target_modules: list[str] = doc(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "module names that get adapters",
    )


@dataclass
class EngineConfig:
    name: str = doc(
        "auto",
        "rollout engine: auto (vllm on a CUDA GPU when installed, else hf; "
        "args.probe=true times both on CPU), hf (transformers, works "
        "everywhere) or vllm",
    )
    args: Any = doc({}, "options of the engine", options=ENGINES, chooser="engine.name")


@dataclass
class PolicyConfig:
    model: str = doc("", "local path or hub id of the model")
    kind: str = doc("causal_lm", "policy kind (causal_lm; plugins add vlm, diffusion kinds)")
    build: str | None = doc(None, "model builder that creates `model` offline if it is missing")
    build_args: Any = doc({}, "options of the model builder", options=MODELS, chooser="build")
    dtype: Literal["float32", "bfloat16"] = doc("float32", "parameter dtype")
    device: str = doc(
        "auto",
        "local mode: where the policy trains (auto: cuda when a GPU is "
        "visible, else cpu; or cpu, cuda, cuda:N). Ray mode places "
        "workers by distributed.args.num_gpus_per_worker instead",
    )
    train: bool = doc(True, "false: the policy acts but is never updated (frozen agent)")
    lora: LoraConfig = doc_factory(LoraConfig, "LoRA adapter (r=0: full fine-tune)")
    optim: OptimConfig = doc_factory(OptimConfig, "optimizer and schedule")
    micro_batch_size: int = doc(32, "rows per forward/backward; gradients accumulate")
    engine: EngineConfig = doc_factory(EngineConfig, "rollout engine for this policy")
    gradient_checkpointing: bool = doc(False, "trade compute for activation memory")
    shared_prefix: bool = doc(
        True,
        "compute each prefix that rows of a micro-batch share (a group's prompt, earlier "
        "turns, an agent team's history; found from the token ids) once in the log-prob, "
        "reference and update passes. Packed sdpa/eager passes: a tree of prefixes packed "
        "with its suffixes, where a cost model from the lengths says it is cheaper; "
        "padded passes (pack false, or flash attention): each distinct prompt once, its "
        "KV cache shared with its group's rows. qwen_vl: images in the prefix too (a tree "
        "pass where the cost model says it pays, else its padded pass)",
    )
    shared_prefix_min_tokens: int = doc(
        16,
        "packed passes: share a prefix only when at least this many tokens long",
        bound=NONNEGATIVE,
    )
    pack: bool = doc(
        True,
        "padding-free log-prob passes: a micro-batch's rows packed end to end, position "
        "ids restarting per row (sdpa/eager: bins as wide as the longest row; flash "
        "attention: one sequence). Same values as the padded pass; causal_lm and "
        "lora_agent kinds (VLM kinds stay padded, packed only as shared_prefix trees)",
    )
    max_tokens_per_micro_batch: int | None = doc(
        None,
        "with pack: micro-batches by real tokens (rows grouped by length up to this "
        "many; a longer row goes alone) instead of micro_batch_size rows; null: "
        "micro_batch_size x the longest row, never more than a padded micro-batch",
    )
    moe: moe.MoeConfig = doc_factory(
        moe.MoeConfig, "mixture-of-experts models: routing replay, load-balancing loss"
    )
    args: Any = doc(
        {},
        "options of the policy kind (e.g. freezing a vision tower)",
        options=POLICIES,
        chooser="kind",
    )


def resolve_device(spec: str) -> torch.device:
    """``PolicyConfig.device`` as a torch device; a GPU asked for but absent is an error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"policy device {spec!r}: use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"policy device {spec!r}: no CUDA device is visible here "
            "(device: auto falls back to cpu)"
        )
    return device


def token_budget(
    batch: TensorDict, cfg: PolicyConfig, packed: bool, model: torch.nn.Module | None = None
) -> tuple[torch.Tensor, int] | tuple[torch.Tensor, int, list[list[int]]] | None:
    """Real tokens per row of ``batch`` and the micro-batch token budget, for packed passes
    (None: micro-batches of ``micro_batch_size`` rows).

    With ``model`` and prefixes shared (:func:`polyrl.core.train.passes.shares`), also the units
    the passes will run as trees (:func:`polyrl.core.train.prefix.plan_units`, each within the
    budget): the trainer keeps a unit's rows in one micro-batch, and each row counts only
    the tokens it adds to its unit (a shared prefix once)."""
    if not packed:
        return None
    lengths = batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)
    budget = cfg.max_tokens_per_micro_batch
    if budget is None:
        budget = cfg.micro_batch_size * int(lengths.max()) if len(lengths) else 1
    if model is None or not shares(model, packed, cfg.shared_prefix) or len(lengths) < 2:
        return lengths.cpu(), budget
    units = prefix_units(model, batch, cfg.shared_prefix_min_tokens, budget)
    if not any(u.shared for u in units):
        return lengths.cpu(), budget
    tokens = prefix.charged_tokens(units, lengths.tolist(), len(lengths))
    return tokens, budget, [u.rows for u in units]


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Warm-up then constant/linear/cosine decay, as a LambdaLR factor."""
    if cfg.schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"optim.schedule={cfg.schedule!r}: use constant, linear or cosine")

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total_steps - cfg.warmup_steps)
        frac = min(1.0, (step - cfg.warmup_steps) / span)
        return 1.0 - frac if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return factor


class CausalLMPolicy:
    """A `transformers` causal LM, fully fine-tuned or with a PEFT LoRA adapter."""

    # its passes route experts: moe options are honoured (check_moe_options)
    caps = PolicyCaps(routes_experts=True)
    # a class default, so kinds that build their model without this __init__ keep it
    is_moe = False  # the model routes tokens to experts (set from the model in __init__)

    def __init__(self, name: str, cfg: PolicyConfig, **build: Unpack[PolicyBuild]) -> None:
        from transformers import AutoModelForCausalLM

        self.name, self.cfg = name, cfg
        self.device = torch.device(build.get("device") or "cpu")
        if cfg.args:
            raise ValueError(
                f"policies.{name}.args {sorted(cfg.args)}: the causal_lm policy kind "
                "takes no options; remove them or set the kind they belong to"
            )
        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        self.tokenizer = self.load_tokenizer(cfg)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        # transformers types the model's wrapped .to() as taking the model itself
        model = model.to(self.device)  # type: ignore[arg-type]
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.need_reference = build["need_reference"]
        self.reference_warmed = False  # a warm start has not moved the reference yet
        self.model, self.reference, self.optimizer, self.scheduler = prepare_for_training(
            model, cfg, need_reference=self.need_reference, total_steps=build["total_steps"]
        )
        self.is_moe = check_moe(name, cfg, self.model)

    @staticmethod
    def load_tokenizer(cfg: PolicyConfig) -> PreTrainedTokenizerBase:
        """The policy's tokenizer alone (building the model first if it is missing)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            ensure_model(cfg.model, cfg.build, cfg.build_args)
        )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    # --- what the trainer calls -------------------------------------------------------
    def logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self._pass(batch, temperature, with_entropy, keep_logits=False)
        return out.logprobs, out.entropy

    def routed_logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> RoutedPass:
        """interfaces.RoutesExperts: :meth:`logprobs` with the pass's routing (MoE models:
        its :class:`~polyrl.core.train.router_terms.RouterTerms`, the router logits kept with
        their graph when gradients are on), what :meth:`router_loss` takes."""
        if not self.is_moe:  # dense, or a kind with a pass of its own that does not route
            return RoutedPass(*self.logprobs(batch, temperature, with_entropy))
        return self._pass(batch, temperature, with_entropy, keep_logits=torch.is_grad_enabled())

    def _pass(
        self, batch: TensorDict, temperature: float, with_entropy: bool, *, keep_logits: bool
    ) -> RoutedPass:
        pack = packs(self.model, self.cfg.pack)
        batch = to_device(batch, self.device)
        routing = self.open_routing(batch, keep_logits)
        with routing or contextlib.nullcontext():
            logp, ent = response_logprobs(
                self.model,
                batch,
                temperature,
                with_entropy,
                # the padded pass shares through a KV cache, which checkpointing cannot keep
                self.cfg.shared_prefix and (pack or not self.cfg.gradient_checkpointing),
                pack=pack,
                min_shared=self.cfg.shared_prefix_min_tokens,
                routing=routing,
            )
        return RoutedPass(logp, ent, None if routing is None else routing.terms())

    def open_routing(self, batch: TensorDict, keep_logits: bool = False) -> moe.Routing | None:
        """MoE models: the :class:`~polyrl.core.train.moe.Routing` of a log-prob pass over
        ``batch`` (replaying the record's experts under ``moe.replay: rollout``; keeping
        the router logits for :meth:`router_loss` with ``keep_logits``); None if dense.
        Rows no engine sampled (a warm start's data: no experts, no advantages) route
        freely; a rollout record without experts is an error under replay."""
        if not self.is_moe:
            return None
        replay = self.cfg.moe.replay == "rollout"
        routing = moe.Routing(self.model, replay=replay, keep_logits=keep_logits)
        if replay and (moe.has_experts(batch) or "advantages" in batch.keys()):  # noqa: SIM118
            moe.check_replay(self.name, batch, routing)  # an RL record must have them
        return routing

    def router_loss(
        self,
        router: RouterTerms,
        batch: TensorDict,
        agg: AggInfo,
        metrics: dict[str, list[float]],
    ) -> torch.Tensor | float:
        """interfaces.RoutesExperts: the load-balancing loss of the pass over ``batch`` (the
        micro-batch) whose routing is ``router`` (:meth:`routed_logprobs`), weighted by the
        micro-batch's share of the mini-batch's loss tokens so micro-batches sum to the
        mini-batch's value (0.0 when ``moe.aux_loss_coef`` is 0 or the pass kept no router
        logits); its router metrics and ``moe/aux_loss`` go to ``metrics``."""
        if not router.keep_logits:
            return 0.0
        for key, value in router.metrics().items():
            metrics.setdefault(key, []).append(value)
        coef = self.cfg.moe.aux_loss_coef
        with contextlib.nullcontext() if coef else torch.no_grad():
            aux = router.aux_loss()
        metrics.setdefault("moe/aux_loss", []).append(float(aux.detach()))
        if not coef:
            return 0.0
        total = agg.batch_num_tokens
        share = float(batch["loss_mask"].sum()) * agg.dp_size / total if total else 1.0
        return coef * share * aux

    @torch.no_grad()
    def ref_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Reference log-probs: the frozen copy, or the base with the adapter disabled."""
        batch = to_device(batch, self.device)
        model = self.model if self.reference is None else self.reference
        pack = packs(model, self.cfg.pack)
        kw: dict[str, Any] = dict(
            shared_prefix=self.cfg.shared_prefix,
            pack=pack,
            min_shared=self.cfg.shared_prefix_min_tokens,
        )
        if self.reference is not None:
            return response_logprobs(model, batch, temperature, **kw)[0]
        with self.model.disable_adapter():
            return response_logprobs(model, batch, temperature, **kw)[0]

    def token_budget(
        self, batch: TensorDict
    ) -> tuple[torch.Tensor, int] | tuple[torch.Tensor, int, list[list[int]]] | None:
        """Tokens per row and per micro-batch when the passes are packed, and the rows that
        share a prefix (PacksRows, :func:`token_budget`). A kind that replaces
        :meth:`logprobs` (a VLM's own pass) is not packed by it, so it keeps row-count
        micro-batches unless it says otherwise."""
        packed = type(self).logprobs is CausalLMPolicy.logprobs and packs(self.model, self.cfg.pack)
        return token_budget(batch, self.cfg, packed, self.model)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must hold to restore the weights (adapter only for LoRA)."""
        return trainable_weights(self.model, lora=self.cfg.lora.r > 0)

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        load_weights(self.name, self.model, state, lora=self.cfg.lora.r > 0)

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer and schedule: what a checkpoint holds for this policy."""
        return checkpoint_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_checkpoint_state(self, state)

    def sft_optimizer(self, lr: float | None) -> contextlib.AbstractContextManager[None]:
        """A constant-rate optimizer for a supervised warm start; RL then starts afresh."""
        return warm_start_optimizer(
            self, [p for p in self.model.parameters() if p.requires_grad], lr
        )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full (merged) weights under the base model's names, for engine weight sync."""
        if self.cfg.lora.r > 0:
            merged = copy.deepcopy(self.model).merge_and_unload()
            return merged.state_dict().items()
        return self.model.state_dict().items()

    def export(self, out_dir: str | Path) -> Path:
        """Hugging Face format (a PEFT adapter folder for LoRA policies)."""
        out = Path(out_dir)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out


def check_moe_options(
    name: str, cfg: PolicyConfig, source: str = "<config>", kind: Any = None
) -> None:
    """``moe`` options on a policy kind whose passes cannot route experts fail at config
    time, naming the key: a kind routes them when its ``caps`` say ``routes_experts``
    (causal_lm, lora_agent); a kind with a pass of its own (qwen_vl) or no token routers
    at all (diffusion) does not. ``kind``: the kind's class (default: ``cfg.kind``'s); a
    kind registered as a factory is not checked here."""
    asked = cfg.moe.replay != "off" or cfg.moe.aux_loss_coef != 0
    cls = kind or (POLICIES.get(cfg.kind) if cfg.kind in POLICIES else None)
    if asked and isinstance(cls, type) and not policy_caps(cls).routes_experts:
        raise ConfigError(
            f"policies.{name}.moe (replay: {cfg.moe.replay}, aux_loss_coef: "
            f"{cfg.moe.aux_loss_coef}) in {source}: the {cfg.kind} policy kind does not "
            "route experts in its passes (no routing replay, no load-balancing loss); "
            "remove the moe options"
        )


def check_moe(name: str, cfg: PolicyConfig, model: torch.nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts; ``moe`` options it cannot honour fail."""
    routed = bool(moe.routers(model))
    asked = cfg.moe.replay != "off" or cfg.moe.aux_loss_coef != 0
    if asked and not routed:
        raise ConfigError(
            f"policies.{name}.moe (replay: {cfg.moe.replay}, aux_loss_coef: "
            f"{cfg.moe.aux_loss_coef}): model {cfg.model!r} has no top-k router modules, so "
            "it is not a mixture-of-experts model PolyRL can route; remove the moe options"
        )
    if cfg.moe.replay != "off" and cfg.gradient_checkpointing:
        raise ConfigError(
            f"policies.{name}: moe.replay with gradient_checkpointing is not supported (the "
            "backward's recompute would route freely); turn one of them off"
        )
    return routed


def check_lora_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Each LoRA target names a linear layer of the model (PEFT's own error comes late and
    does not list what exists)."""
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ConfigError(
            f"lora.target_modules {missing} name no linear layer of "
            f"{type(model).__name__}; its linear layers are: {', '.join(linear)}"
        )


def prepare_for_training(
    model: torch.nn.Module,
    cfg: PolicyConfig,
    *,
    need_reference: bool,
    total_steps: int,
    lora_targets: Any = None,
) -> tuple:
    """LoRA wrap (or a frozen reference copy), freezing and the RL optimizer + schedule.

    Returns ``(model, reference, optimizer, scheduler)``; ``reference`` is None under LoRA
    (the base with the adapter disabled is the reference) or when no KL needs it, and the
    optimizer is None for a frozen policy. ``lora_targets``: PEFT ``target_modules``
    (default ``cfg.lora.target_modules``), e.g. a regex that leaves a vision tower out.
    """
    reference = None
    if cfg.lora.r > 0:
        from peft import LoraConfig as PeftLora
        from peft import get_peft_model

        if lora_targets is None:
            check_lora_targets(model, cfg.lora.target_modules)
        model = get_peft_model(
            model,
            PeftLora(
                r=cfg.lora.r,
                # peft types lora_alpha int; a float scales (alpha / r) as well
                lora_alpha=cfg.lora.alpha,  # type: ignore[arg-type]
                lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules if lora_targets is None else lora_targets,
            ),
        )
    elif need_reference:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    model.train(False)
    if not cfg.train:
        model.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return model, reference, None, None
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.optim.lr,
        betas=cast("tuple[float, float]", tuple(cfg.optim.betas)),  # two: checked in recipe.py
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    return (
        model,
        reference,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, total_steps)),
    )


# --- state helpers every policy kind shares (diffusion and marl kinds call them too) -----
def trainable_weights(model: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """The weights a checkpoint must hold: the trainable (adapter) ones under LoRA, else all."""
    if lora:
        return {k: v.detach().cpu() for k, v in model.named_parameters() if v.requires_grad}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def load_weights(
    name: str, model: torch.nn.Module, state: dict[str, torch.Tensor], lora: bool
) -> None:
    """Load :func:`trainable_weights` back; a mismatch names the policy and the keys."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or (not lora and missing):
        raise ConfigError(  # the recipe's model is not the run's: a user error, not a crash
            f"policy {name!r}: checkpoint does not match the model of policies.{name}.model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}): it was written for another "
            "model; give the recipe the run was made with (its config.yaml), or start a "
            "fresh run (another run.dir). The checkpoint is unchanged"
        )


def checkpoint_state(policy: Any) -> dict[str, Any]:
    """Weights, optimizer and schedule of ``policy``: what a checkpoint holds for it (and
    the reference's weights once a warm start has set them: they are no longer the
    model's initial ones, so a resumed run could not rebuild them)."""
    state = {
        "weights": policy.trainable_state(),
        "optimizer": policy.optimizer.state_dict() if policy.optimizer else None,
        "scheduler": policy.scheduler.state_dict() if policy.scheduler else None,
    }
    if policy.reference_warmed:
        state["reference"] = policy.reference.state_dict()
    return state


def load_checkpoint_state(policy: Any, state: dict[str, Any]) -> None:
    policy.load_trainable_state(state["weights"])
    if policy.optimizer is not None:
        policy.optimizer.load_state_dict(state["optimizer"])
        policy.scheduler.load_state_dict(state["scheduler"])
    if "reference" in state:
        policy.reference.load_state_dict(state["reference"])
        policy.reference_warmed = True


@contextlib.contextmanager
def warm_start_optimizer(
    policy: Any, params: list[torch.nn.Parameter], lr: float | None
) -> Iterator[None]:
    """Swap in a constant-rate AdamW over ``params`` for a supervised warm start; the RL
    optimizer and schedule come back untouched afterwards, and a frozen reference copy
    takes the warmed-up weights: KL anchors RL to the policy it starts from (the SFT
    model, as in RLHF), not to the weights before the warm start."""
    saved = policy.optimizer, policy.scheduler
    policy.optimizer = torch.optim.AdamW(
        params, lr=lr or policy.cfg.optim.lr, weight_decay=policy.cfg.optim.weight_decay
    )
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda _: 1.0)
    try:
        yield
    finally:
        policy.optimizer, policy.scheduler = saved
    if (reference := policy.reference) is not None:
        with torch.no_grad():
            reference.load_state_dict(policy.model.state_dict())
        policy.reference_warmed = True


POLICIES.register("causal_lm", CausalLMPolicy)
