"""``lora_agent``: one shared base model, one LoRA adapter (and optimizer) per policy.

Several policies with ``kind: lora_agent`` and the same ``model`` load the base weights
once (kept in the session's ``shared`` dict) and each adds its own PEFT adapter, named after
the policy. Before any forward (generation, log-probs, update) the policy activates its
adapter, so its gradients reach only its adapter; the base weights never train. The
reference model is the base with the adapters disabled. Checkpoints and exports hold the
adapter only.

    policies:
      speaker:  {model: ..., kind: lora_agent, lora: {r: 8}}
      listener: {model: ..., kind: lora_agent, lora: {r: 8}}

The trained adapters of one base update together (``args.batch_update``, on by default;
:class:`~polyrl.core.interfaces.UpdatesTogether`): each micro-batch of every adapter runs
in ONE forward/backward over the base, each row through its own adapter
(:mod:`polyrl.marl.multi_lora`), while each policy keeps its own optimizer, learning rate,
clipping and micro-batches.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch
from tensordict import TensorDict

from polyrl.core.config import doc
from polyrl.core.interfaces import MixesRows, PolicyBuild, PolicyCaps
from polyrl.core.options import Options, bind
from polyrl.core.record import concat, to_device
from polyrl.core.registry import POLICIES
from polyrl.core.runner.builds import ensure_model
from polyrl.core.train.passes import packs, response_logprobs
from polyrl.core.train.policy import (
    CausalLMPolicy,
    check_moe,
    checkpoint_state,
    load_checkpoint_state,
    lr_lambda,
    token_budget,
    warm_start_optimizer,
)
from polyrl.core.train.router_terms import RoutedPass


@dataclass
class LoraAgentOptions(Options):
    """``policies.<name>.args`` of the ``lora_agent`` policy kind."""

    batch_update: bool = doc(
        True,
        "update together with the other trained lora_agent policies on the same base "
        "(same pack setting, no gradient checkpointing): one forward/backward per "
        "micro-batch over all their rows, each through its own adapter; gradients, "
        "optimizers and metrics stay each policy's own. false: this policy's update runs "
        "its own passes (so does every policy on a mixture-of-experts base, whose passes "
        "replay and balance each policy's routing: moe.replay, moe.aux_loss_coef)",
    )


class LoraAgentPolicy:
    """A policy that is one named LoRA adapter on a base model shared with other policies."""

    load_tokenizer = staticmethod(CausalLMPolicy.load_tokenizer)

    def __init__(self, name: str, cfg: Any, **build: Unpack[PolicyBuild]) -> None:
        from peft import LoraConfig as PeftLora
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        if cfg.lora.r <= 0:
            raise ValueError(
                f"policy {name!r}: kind lora_agent needs lora.r > 0 (got {cfg.lora.r})"
            )
        self.name, self.cfg = name, cfg
        self.options = bind(  # typed by the recipe; bound here too for a config built in code
            LoraAgentOptions,
            cfg.args,
            f"policies.{name}.args",
            "<config>",
            "policy kind 'lora_agent'",
        )
        self.device = torch.device(build.get("device") or "cpu")
        need_reference, total_steps = build["need_reference"], build["total_steps"]
        shared = build.get("shared")
        self.adapter = name
        self.need_reference = need_reference
        self.reference = None
        self.reference_warmed = False  # a warm start has not moved the reference yet
        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        self.tokenizer = self.load_tokenizer(cfg)
        peft_cfg = PeftLora(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules),
        )
        shared = {} if shared is None else shared
        key = ("lora_agent", str(Path(path).expanduser().resolve()), cfg.dtype, str(self.device))
        if key not in shared:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
            base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device)
            if cfg.gradient_checkpointing:
                base.gradient_checkpointing_enable()
            shared[key] = get_peft_model(base, peft_cfg, adapter_name=name)
        else:
            if name in shared[key].peft_config:
                raise ValueError(f"policy {name!r}: an adapter of that name already exists")
            shared[key].add_adapter(name, peft_cfg)
        self._peft = shared[key]
        self._shared, self._key = shared, key  # shadow(): one engine-side copy per base
        self._trains = bool(cfg.train)
        self._peft.train(False)
        self.is_moe = check_moe(name, cfg, self._peft)  # refuses moe options on a dense base
        marker = (f".lora_A.{name}.", f".lora_B.{name}.")
        self._own = {k: p for k, p in self._peft.named_parameters() if any(m in k for m in marker)}
        for p in self._own.values():
            p.requires_grad_(bool(cfg.train))
        params = list(self._own.values()) if cfg.train else []
        self.optimizer = (
            torch.optim.AdamW(
                params,
                lr=cfg.optim.lr,
                betas=tuple(cfg.optim.betas),
                eps=cfg.optim.eps,
                weight_decay=cfg.optim.weight_decay,
            )
            if params
            else None
        )
        self.scheduler = (
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.optim, total_steps))
            if params
            else None
        )

    @property
    def model(self) -> torch.nn.Module:
        """The shared PEFT model with this policy's adapter active (and only it trainable)."""
        if self._peft.active_adapter != self.adapter:
            self._peft.set_adapter(self.adapter)
        for k, p in self._peft.named_parameters():  # set_adapter re-enables grads; pin ours
            if "lora_" in k:
                p.requires_grad_(k in self._own and self._trains)
        return self._peft

    def shadow(self) -> LoraAgentPolicy:
        """interfaces.Shadows: this policy on the engine-side copy of the shared model, for
        asynchronous rollouts (core.rollout.rollouts.shadow), frozen. The lora_agent policies of
        one base share one copy (made by the first to ask; the base weights themselves
        are shared, never trained), so an engine call still mixes their rows and each
        engine's weight versions load into its own adapter there."""
        key = ("lora_agent shadow", *self._key)
        if key not in self._shared:
            base = {id(p): p for k, p in self._peft.named_parameters() if "lora_" not in k}
            copied = copy.deepcopy(self._peft, memo=base)
            copied.requires_grad_(False)
            copied.train(False)
            self._shared[key] = copied
        twin = copy.copy(self)
        twin._peft = self._shared[key]
        twin._own = {k: p for k, p in twin._peft.named_parameters() if k in self._own}
        twin._trains, twin.optimizer, twin.scheduler = False, None, None
        return twin

    # --- what the trainer calls -------------------------------------------------------
    # MoE routing as a causal_lm's: replay of the record's experts in the passes
    # (moe.replay), the load-balancing loss and router metrics (interfaces.RoutesExperts)
    caps = PolicyCaps(routes_experts=True)  # moe options are honoured (check_moe_options)
    is_moe = False  # set from the base in __init__
    logprobs = CausalLMPolicy.logprobs
    routed_logprobs = CausalLMPolicy.routed_logprobs
    open_routing = CausalLMPolicy.open_routing
    router_loss = CausalLMPolicy.router_loss

    def _pass(
        self, batch: TensorDict, temperature: float, with_entropy: bool, *, keep_logits: bool
    ) -> RoutedPass:
        model = self.model
        batch = to_device(batch, self.device)
        routing = self.open_routing(batch, keep_logits)
        with routing or contextlib.nullcontext():
            logp, ent = response_logprobs(
                model, batch, temperature, with_entropy, **self._layout(True), routing=routing
            )
        return RoutedPass(logp, ent, None if routing is None else routing.terms())

    @torch.no_grad()
    def ref_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        model = self.model
        with model.disable_adapter():
            return response_logprobs(
                model, to_device(batch, self.device), temperature, **self._layout(False)
            )[0]

    def _layout(self, grads: bool) -> dict[str, Any]:
        """The pass layout the policy's config asks for (``pack``, ``shared_prefix``,
        ``shared_prefix_min_tokens``); a padded pass under gradient checkpointing does not
        share prompts (their KV cache would not survive the recompute)."""
        pack = packs(self._peft, self.cfg.pack)
        ckpt = grads and self.cfg.gradient_checkpointing
        return {
            "shared_prefix": self.cfg.shared_prefix and (pack or not ckpt),
            "pack": pack,
            "min_shared": self.cfg.shared_prefix_min_tokens,
        }

    def row_group(self) -> Any:
        """interfaces.MixesRows: the adapters of one shared PEFT model run together; on a
        mixture-of-experts base each runs alone (marl.multi_lora adds a layer's adapter
        terms per token of the model's input, which an experts layer's gathered tokens do
        not keep)."""
        return None if self.is_moe else ("lora_agent", id(self._peft))

    @contextmanager
    def rows_of(self, owners: Sequence[Any]) -> Iterator[Callable[[torch.Tensor | None], Any]]:
        """interfaces.MixesRows: ``select(ids)`` sets the next forwards' row ``i`` to run
        through ``owners[ids[i]]``'s adapter (marl.multi_lora, as the batched update routes
        rows) and returns the model."""
        from polyrl.marl.multi_lora import adapter_rows

        for o in owners:
            if not isinstance(o, MixesRows) or o.row_group() != self.row_group():
                raise ValueError(
                    f"policy {self.name!r}: policy {getattr(o, 'name', o)!r} is not a "
                    f"lora_agent on the same base; it cannot share a batch with it"
                )
        with adapter_rows(self._peft, [o.adapter for o in owners]) as router:

            def select(ids: torch.Tensor | None) -> Any:
                if ids is not None:
                    router.set_rows(ids)
                return self._peft

            yield select

    def update_group(self) -> Any:
        """interfaces.UpdatesTogether: the policies whose passes can merge -- adapters of one
        shared model, passes laid out alike (pack); None (alone) when ``args.batch_update`` is
        off, gradient checkpointing is on (multi_lora cannot route its recompute) or the
        base is a mixture of experts (multi_lora routes rows by token position, which the
        experts' gathered tokens lose; and replay and the balancing loss are per pass)."""
        if not self.options.batch_update or self.cfg.gradient_checkpointing or self.is_moe:
            return None
        return ("lora_agent", id(self._peft), packs(self._peft, self.cfg.pack))

    def logprobs_together(
        self,
        policies: Sequence[Any],
        batches: Sequence[TensorDict],
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """interfaces.UpdatesTogether: ``policies[i].logprobs(batches[i])`` for every ``i`` from
        one forward over the union of the rows, each row through its own policy's adapter
        (marl.multi_lora; the pass lays each adapter's rows out together and tells the
        router where they went), gradients to every trained one."""
        from polyrl.marl.multi_lora import adapter_rows

        self._check_group(policies)
        union, sizes = self._union(batches)
        owner = torch.repeat_interleave(torch.arange(len(policies)), torch.tensor(sizes))
        names = [p.adapter for p in policies]
        trainable = [p.adapter for p in policies if p.cfg.train]
        with adapter_rows(self._peft, names, trainable) as router:
            router.set_rows(owner)  # in adapter order: each adapter's tokens together
            logp, ent = response_logprobs(
                self._peft, union, temperature, with_entropy, **self._layout(True), owners=router
            )
        out = []
        for b, lp, en in zip(
            batches,
            logp.split(sizes),
            ent.split(sizes) if ent is not None else [None] * len(sizes),
            strict=True,
        ):
            width = b["response_ids"].shape[1]
            out.append((lp[:, :width], en[:, :width] if en is not None else None))
        return out

    @torch.no_grad()
    def ref_logprobs_together(
        self, policies: Sequence[Any], batches: Sequence[TensorDict], temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """interfaces.UpdatesTogether: ``policies[i].ref_logprobs(batches[i])`` for every
        ``i`` from one pass of the base (every adapter off) over the union of the rows; no
        row owners, so rows of different agents with one prompt share it where the pass
        shares prefixes."""
        self._check_group(policies)
        union, sizes = self._union(batches)
        with self._peft.disable_adapter():
            logp, _ = response_logprobs(self._peft, union, temperature, **self._layout(False))
        return [
            lp[:, : b["response_ids"].shape[1]]
            for b, lp in zip(batches, logp.split(sizes), strict=True)
        ]

    def _check_group(self, policies: Sequence[Any]) -> None:
        if any(p.update_group() != self.update_group() for p in policies):
            raise ValueError(
                f"policy {self.name!r}: passes together take lora_agent policies of one "
                f"update group, got {[getattr(p, 'name', p) for p in policies]}"
            )

    def _union(self, batches: Sequence[TensorDict]) -> tuple[TensorDict, list[int]]:
        """The rows of ``batches`` in one record (the columns a log-prob pass reads), on
        this policy's device, and each batch's row count."""
        keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        union = concat(
            [TensorDict({k: b[k] for k in keys}, batch_size=b.batch_size) for b in batches]
        )
        return to_device(union, self.device), [b.batch_size[0] for b in batches]

    def token_budget(self, batch: TensorDict):
        """Tokens per row and per micro-batch when the passes are packed, and the rows that
        share a prefix (PacksRows)."""
        return token_budget(batch, self.cfg, packs(self._peft, self.cfg.pack), self._peft)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._own.items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(state) - set(self._own))
        if unknown or len(state) != len(self._own):
            raise RuntimeError(
                f"policy {self.name!r}: checkpoint does not match adapter "
                f"{self.adapter!r} (unexpected {unknown[:3]})"
            )
        with torch.no_grad():
            for k, v in state.items():
                self._own[k].copy_(v)

    def state_dict(self) -> dict[str, Any]:
        return checkpoint_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_checkpoint_state(self, state)

    def sft_optimizer(self, lr: float | None):
        return warm_start_optimizer(self, list(self._own.values()), lr)

    def named_weights(self):
        """Base weights with this adapter merged in, under the base model's names."""
        merged = copy.deepcopy(self.model)
        merged.set_adapter(self.adapter)
        return merged.merge_and_unload(adapter_names=[self.adapter]).state_dict().items()

    def base_state(self) -> dict[str, torch.Tensor]:
        """The shared base weights (what no adapter may change), for checks."""
        return {k: v.detach().clone() for k, v in self._peft.named_parameters() if "lora_" not in k}

    def save_adapter(self, out_dir: str | Path) -> Path:
        """This adapter alone in PEFT format (adapter_config.json + weights) in ``out_dir``,
        loadable as is by ``PeftModel.from_pretrained`` and by vLLM's ``LoRARequest``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, selected_adapters=[self.adapter])
        nested = out / self.adapter  # PEFT puts a non-default adapter in a subfolder; lift
        if (nested / "adapter_config.json").is_file():  # it so PeftModel.from_pretrained(out)
            for f in nested.iterdir():
                f.replace(out / f.name)
            nested.rmdir()
        return out

    def export(self, out_dir: str | Path) -> Path:
        """This adapter in PEFT format (adapter_config.json + weights) plus the tokenizer."""
        out = self.save_adapter(out_dir)
        self.tokenizer.save_pretrained(out)
        return out


POLICIES.register("lora_agent", LoraAgentPolicy, options=LoraAgentOptions)
