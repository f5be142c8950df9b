"""One loaded base model and the LoRA adapters of every client on it.

Training clients are adapters with their own AdamW state; sampler snapshots are frozen
adapters copied from a training adapter at ``save_weights_for_sampler``; samplers of the
base model itself share one rank-1 adapter whose B is zero (created first, never freed, so
the PEFT model always has an adapter while clients come and go). Forward/backward
requests of several clients run as ONE pass (``marl.multi_lora.adapter_rows``: each row
through its own adapter, each adapter's gradient from its own rows only); sample requests
of several samplers run as one decode loop (``HFEngine.generate_mixed`` over the same
``adapter_rows``). Gradients accumulate in each adapter's ``.grad`` until its client's
``optim_step``, as Tinker's API defines."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.marl.multi_lora import adapter_rows
from polyrl.marl.tinker_api.losses import LOSSES
from polyrl.marl.tinker_api.wire import BadRequest, Datum, Sequence_

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
BASE_ADAPTER = "base"  # rank 1, B zero: what samplers of the base model itself run through


@dataclass
class TrainingAdapter:
    """A training client: its adapter, rank and optimizer (its own Adam moments)."""

    model_id: str
    adapter: str
    rank: int
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


@dataclass
class FwdBwdJob:
    """One client's forward(_backward) request as the pass sees it."""

    client: TrainingAdapter
    loss_fn: str
    config: dict[str, Any]
    data: list[Datum]
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class _AdapterView:
    """What ``HFEngine`` needs of a policy, for one frozen adapter of the shared model
    (``core.interfaces.MixesRows``: its rows share decode loops with the other adapters')."""

    def __init__(self, base: BaseModel, adapter: str) -> None:
        self.base, self.adapter, self.name = base, adapter, adapter
        self.tokenizer = base.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        raise RuntimeError("tinker service: adapters decode only through generate_mixed")

    def row_group(self) -> Any:
        return ("tinker", id(self.base.peft))

    @contextmanager
    def rows_of(self, owners: Sequence[Any]) -> Iterator[Callable]:
        # several calls of one sampler (one adapter) in a decode loop: one routing slot
        names = list(dict.fromkeys(o.adapter for o in owners))
        slot = torch.tensor([names.index(o.adapter) for o in owners], dtype=torch.long)
        with adapter_rows(self.base.peft, names) as router:

            def select(ids: torch.Tensor | None) -> Any:
                if ids is not None:
                    router.set_rows(slot[ids.cpu()])
                return self.base.peft

            yield select


class BaseModel:
    """A base checkpoint loaded once, with every client's adapter on it."""

    def __init__(self, name: str, path: str, *, device: str, dtype: str, alpha: float, seed: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name, self.path = name, path
        self.device = torch.device(device)
        self.alpha = alpha
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        self.peft: Any = None
        self.engines: dict[str, HFEngine] = {}
        self._engines_made = 0
        self.seed = seed
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.vocab = self.model.get_input_embeddings().num_embeddings
        head = self.model.get_output_embeddings()  # train_unembed's LoRA target
        self.unembed = next(n for n, m in self.model.named_modules() if m is head)

    # --- adapters -------------------------------------------------------------------
    def add_adapter(self, adapter: str, rank: int, targets: list[str], seed: int | None) -> None:
        from peft import LoraConfig, get_peft_model

        if self.peft is None:  # first the base's own adapter, never freed (module docstring)
            zero = LoraConfig(r=1, lora_alpha=1.0, lora_dropout=0.0, target_modules=ATTN[:1])
            self.peft = get_peft_model(self.model, zero, adapter_name=BASE_ADAPTER)
            self.peft.eval()
            for p in self.adapter_params(BASE_ADAPTER):
                p.requires_grad_(False)
        cfg = LoraConfig(r=rank, lora_alpha=self.alpha, lora_dropout=0.0, target_modules=targets)
        fork = torch.random.fork_rng(devices=[]) if seed is not None else _null()
        with fork, warnings.catch_warnings():
            # PEFT warns of a LoRA on a tied unembedding: it matters for merging, never done
            warnings.filterwarnings("ignore", ".*tie_word_embeddings.*", UserWarning)
            if seed is not None:
                torch.manual_seed(seed)
            self.peft.add_adapter(adapter, cfg)
        for p in self.adapter_params(adapter):
            p.requires_grad_(False)

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        marker = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
        return [p for k, p in self.peft.named_parameters() if any(m in k for m in marker)]

    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        marker = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
        return {
            k.replace(f".{adapter}.", ".<a>."): p.detach().clone()
            for k, p in self.peft.named_parameters()
            if any(m in k for m in marker)
        }

    def load_adapter_state(self, adapter: str, state: dict[str, torch.Tensor]) -> None:
        own = self.adapter_state(adapter)
        if set(own) != set(state) or any(own[k].shape != state[k].shape for k in own):
            raise BadRequest(
                "load: the checkpoint's adapter does not fit this client (another rank or "
                "other target layers); create the client from the checkpoint instead"
            )
        marker = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
        with torch.no_grad():
            for k, p in self.peft.named_parameters():
                if any(m in k for m in marker):
                    p.copy_(state[k.replace(f".{adapter}.", ".<a>.")])

    def snapshot(self, source: str, snap: str, rank: int, targets: list[str]) -> None:
        """A frozen copy of adapter ``source`` under the name ``snap`` (a sampler)."""
        self.add_adapter(snap, rank, targets, seed=None)
        self.load_adapter_state(snap, self.adapter_state(source))

    def remove_adapter(self, adapter: str) -> None:
        """Free an adapter's weights (and its sampler engine); never the base's own."""
        if adapter != BASE_ADAPTER:
            with warnings.catch_warnings():  # "adapter X was active": none is, between passes
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(adapter)
            self.engines.pop(adapter, None)

    # --- passes ---------------------------------------------------------------------
    def forward_backward(self, jobs: list[FwdBwdJob], backward: bool) -> None:
        """One pass over every job's datums, each row through its client's adapter; with
        ``backward`` the summed loss's gradient lands in each client's adapter."""
        names = list(dict.fromkeys(j.client.adapter for j in jobs))
        rows = [(names.index(j.client.adapter), j, d) for j in jobs for d in j.data]
        width = max(len(d.tokens) for _, _, d in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (_, _, d) in enumerate(rows):
            n = len(d.tokens)
            ids[i, :n] = torch.tensor(d.tokens)
            mask[i, :n] = 1
            targets[i, :n] = d.inputs["target_tokens"].long()
        ids, mask, targets = ids.to(self.device), mask.to(self.device), targets.to(self.device)
        owner = torch.tensor([k for k, _, _ in rows])
        with torch.set_grad_enabled(backward):
            with adapter_rows(self.peft, names, names if backward else ()) as router:
                router.set_rows(owner)
                logits = self.peft(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
            total = logp.new_zeros(())
            for i, (_, job, d) in enumerate(rows):
                n = len(d.tokens)
                fn = LOSSES[job.loss_fn][0]
                inputs = {
                    k: v.to(self.device, torch.float32)
                    for k, v in d.inputs.items()
                    if k != "target_tokens"
                }
                per_token = fn(logp[i, :n], inputs, job.config)
                total = total + per_token.sum()
                job.outputs.append(
                    {
                        "logprobs": logp[i, :n].detach().float().cpu().numpy(),
                        "elementwise_loss": per_token.detach().float().cpu().numpy(),
                    }
                )
                job.metrics["loss:sum"] = job.metrics.get("loss:sum", 0.0) + float(
                    per_token.detach().sum()
                )
            if backward:
                total.backward()

    def optim_step(self, client: TrainingAdapter, adam: Any) -> dict[str, float]:
        """One AdamW step of ``client``'s adapter with this step's Adam parameters."""
        for g in client.optimizer.param_groups:
            g.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        norm = torch.sqrt(
            sum((p.grad.float() ** 2).sum() for p in client.params if p.grad is not None) + 0.0
        )
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(client.params, adam.grad_clip_norm)
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return {"grad_norm:mean": float(norm)}

    def engine(self, adapter: str) -> HFEngine:
        if adapter not in self.engines:  # each sampler its own stream (seed, sampler number)
            seed = self.seed * 1_000_003 + self._engines_made
            self._engines_made += 1
            self.engines[adapter] = HFEngine(_AdapterView(self, adapter), seed=seed)
        return self.engines[adapter]

    @torch.no_grad()
    def sample(
        self, calls: list[tuple[str, list[int], int]], params: SamplingParams
    ) -> list[list[Sequence_]]:
        """``calls``: (adapter, prompt, num_samples); one decode loop over all of them."""
        engines = [self.engine(a) for a, _, _ in calls]
        first = engines[0]
        groups: list[list[Sequence_]] = []
        # generate_mixed takes one n per call; requests with other counts repeat the prompt
        mixed = [(e, [p] * n) for e, (_, p, n) in zip(engines, calls, strict=True)]
        out = first.generate_mixed(mixed, SamplingParams(**{**params.__dict__, "n": 1}))
        for completions in out:
            groups.append(
                [
                    Sequence_(
                        c.token_ids,
                        list(c.logprobs),
                        "stop" if c.finish_reason == "stop" else "length",
                    )
                    for c in completions
                ]
            )
        return groups

    @torch.no_grad()
    def prompt_logprobs(self, adapter: str, prompt: list[int]) -> list[float]:
        """Log-prob of every prompt token given those before it (NaN at position 0)."""
        ids = torch.tensor([prompt], device=self.device)
        with adapter_rows(self.peft, [adapter]) as router:
            router.set_rows(torch.zeros(1, dtype=torch.long))
            logits = self.peft(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        return [math.nan, *lp.cpu().tolist()]


@contextmanager
def _null() -> Iterator[None]:
    yield


def atomic_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Write a checkpoint directory beside ``final`` and rename it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
