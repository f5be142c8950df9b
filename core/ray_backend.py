"""The Ray backend (``distributed.backend: ray``): each policy trains on its own FSDP2 group.

What runs where:

- **Trainer.** Each policy gets a worker group of N Ray actors (``workers_per_policy``, or
  per policy in ``policies``). Every actor loads the policy kind as in local mode, shards
  it with FSDP2 (``fully_shard`` on each decoder layer, then on the root; gloo on CPU,
  NCCL on GPU; a policy whose pass calls its model's parts one by one, as a VLM's does,
  names the root module through ``fsdp_root``) and runs
  :func:`polyrl.core.trainer.update` with ``dp=(rank, world)``: each
  rank computes its share of the rows with loss totals taken over the whole batch, and
  FSDP averages the gradients, so a step equals the single-process step.
- **Engine.** One actor per policy holds its own copy of the model and the policy's
  engine (``hf`` or ``vllm``). ``sync()`` gathers the full state dict from the FSDP group
  (rank 0, ``get_model_state_dict(full_state_dict, cpu_offload)``), puts it in the object
  store and loads it into the engine actor; the weights never pass through the driver.
- **Placement.** One placement group per policy. ``colocate``: one bundle per worker and
  the engine shares worker 0's bundle (each takes half of it; on GPU they share the
  device). ``split``: an extra bundle for the engine. ``strategy`` is Ray's (``PACK``,
  ``SPREAD``, ``STRICT_SPREAD`` to put each worker on its own node, ...).
- **Rewards.** A reward term with ``actor: {num_cpus, num_gpus, threads}`` is scored on
  its own actor (a reward model loads there once, on its own device); the others run
  on the driver. A dead reward actor is an :class:`ActorError` naming the term.
- **LoRA** (``lora.r > 0``, causal-LM kinds). Every rank wraps the base in PEFT as in
  local mode (from the driver's RNG state, so the adapter starts as local mode's would),
  takes rank 0's initial adapter, and shards the wrapped model the same way
  (frozen base and trainable adapter weights share each layer's unit; the optimizer holds
  the adapter only). The reference is the base with the adapter disabled. The engine
  actor holds a plain copy of the base model: ``sync()`` gathers only the adapter factors
  (A, B and the scale of each adapted linear layer; a small fraction of the model) and
  the engine merges ``W = W0 + scale * B @ A`` into its own weights, keeping the base
  ``W0`` of the adapted layers on the CPU (the base never trains, so it never travels).
- **Driver.** ``make_policy`` returns a :class:`RayPolicy` proxy (tokenizer loaded
  locally; ``state_dict``/``load_state_dict`` move the gathered weights, optimizer and
  scheduler; ``export`` has rank 0 write the Hugging Face folder, or the PEFT adapter
  folder for LoRA, so in a multi-node run the run directory must be on storage rank 0's
  node sees). ``make_engine`` returns a :class:`RayEngine` proxy with the engine
  interface (with ``generate_vl`` when the policy's engine takes images, so a VL workflow
  runs unchanged; its vision inputs are pickled into the call).

A dead worker or engine actor stops the run with :class:`ActorError`, naming the
role (``policy 'main' worker 1 died: ...``); the group is torn down, and the run resumes
from its last checkpoint (``run.resume=true`` / ``polyrl train --resume``) with fresh
actors. A policy's checkpoint has the same layout as in local mode (the full weights, or
the adapter weights alone under LoRA; the optimizer state keyed by parameter position;
the schedule), so a run saved under one backend resumes under the other. Not supported
yet: LoRA on other policy kinds, and base models shared between policies (the
``lora_agent`` kind: each group would need an adapter-aware gather per policy).

Actors start in the background (all policies and engines load at once); the first call
to a group or engine waits for it. Every Ray node needs the same Python environment with
polyrl installed. Ray is imported only when this backend is used.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict

from polyrl.core.config import ConfigError, doc, from_dict
from polyrl.core.registry import BACKENDS, ENGINES, POLICIES, nearest

_GROUP_FIELDS = ("workers_per_policy", "placement", "strategy", "num_cpus_per_worker",
                 "num_gpus_per_worker", "num_cpus_per_engine", "num_gpus_per_engine",
                 "threads_per_worker")


@dataclass
class RayArgs:
    """``distributed.args`` for ``distributed.backend: ray``."""

    address: str | None = doc(None, "Ray cluster to join ('auto', 'ray://host:port'); default: "
                                    "the one this process already joined, else a new local one")
    num_cpus: int | None = doc(None, "CPUs of a local Ray instance this backend starts (None: all)")
    workers_per_policy: int = doc(1, "FSDP ranks (one Ray actor each) that train each policy")
    placement: Literal["colocate", "split"] = doc(
        "colocate", "colocate: the engine shares worker 0's bundle; split: its own bundle")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = doc(
        "PACK", "Ray placement-group strategy for a policy's bundles")
    num_cpus_per_worker: float = doc(1.0, "CPUs reserved for each trainer worker")
    num_gpus_per_worker: float = doc(0.0, "GPUs for each trainer worker (>0: NCCL, CUDA)")
    num_cpus_per_engine: float = doc(1.0, "CPUs reserved for the engine actor (split placement)")
    num_gpus_per_engine: float = doc(0.0, "GPUs for the engine actor (split placement)")
    threads_per_worker: int = doc(1, "torch threads in each worker and engine actor")
    collective_timeout_s: float = doc(1800.0, "timeout of the group's torch.distributed calls")
    placement_timeout_s: float = doc(120.0, "how long to wait for Ray to place a policy's group")
    policies: dict[str, dict[str, Any]] = doc(
        {}, "per-policy overrides of the group fields, e.g. {critic: {workers_per_policy: 1}}")

    def for_policy(self, name: str) -> RayArgs:
        override = self.policies.get(name, {})
        where = f"distributed.args.policies.{name}"
        bad = [k for k in override if k not in _GROUP_FIELDS]
        if bad:
            raise ConfigError(f"{where}.{bad[0]} cannot be set per policy; per-policy keys: "
                              f"{', '.join(_GROUP_FIELDS)}")
        checked = from_dict(RayArgs, override, where)
        return dataclasses.replace(self, **{k: getattr(checked, k) for k in override})


class ActorError(RuntimeError):
    """A worker or engine actor died or failed; the message names its role."""


def _ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("distributed.backend=ray needs Ray: pip install 'polyrl[ray]'") from err
    return ray


def _resources(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


# ---------------------------------------------------------------------------------- actors


def _shard(model: torch.nn.Module, mesh, root: torch.nn.Module | None = None) -> None:
    """FSDP2: each decoder layer (the model's ``_no_split_modules``) is a unit, then the root.

    ``root`` (default: the model) is the module whose forward runs the model in training. A
    policy whose pass calls the model's parts one by one (a VLM's embeddings, vision tower,
    language model and head) names a wrapper module holding the model (``fsdp_root``): the
    root unit's parameters are gathered, and their gradients reduced, around *its* forward.
    """
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"cannot find the decoder layers of {type(model).__name__} to shard "
                           "(it declares no _no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model if root is None else root, mesh=mesh)


def _fsdp_root(policy: Any, model: torch.nn.Module) -> torch.nn.Module | None:
    """The policy's FSDP root for ``model`` (its ``fsdp_root``), or None: the model itself."""
    root_of = getattr(policy, "fsdp_root", None)
    return None if root_of is None else root_of(model)


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _rebind_optimizer(policy, names: dict[int, str]) -> None:
    """Sharding replaced the parameters (same names, now DTensors): point the optimizer's
    groups at the new ones. It has no state yet, and its schedule stays attached."""
    if policy.optimizer is None:
        return
    new = dict(policy.model.named_parameters())
    for group in policy.optimizer.param_groups:
        group["params"] = [new[names[id(p)]] for p in group["params"]]


def _optim_by_index(optim: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name -> keyed by position, as
    ``torch.optim.Optimizer.state_dict()`` writes it in a single process."""
    order = [n for g in optim["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    return {"state": {index[n]: v for n, v in optim["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in optim["param_groups"]]}


def _optim_by_name(optim: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_optim_by_index`, given the parameter names in group order."""
    if len(order) != sum(len(g["params"]) for g in optim["param_groups"]):
        raise ValueError("the checkpoint's optimizer holds a different number of parameters "
                         "than this policy; was it written for another model or LoRA setting?")
    return {"state": {order[i]: v for i, v in optim["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                             for g in optim["param_groups"]]}


def _uses_lora(cfg: Any) -> bool:
    lora = getattr(cfg, "lora", None)
    return lora is not None and lora.r > 0


def _broadcast_trainable(model: torch.nn.Module) -> None:
    """Give every rank rank 0's trainable (adapter) weights: PEFT initializes them at random,
    and FSDP would otherwise stitch together shards of different initializations."""
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A gathered, detached CPU copy of a (possibly sharded) tensor; a collective for a
    DTensor, so every rank calls it in the same order."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


@dataclass
class LoraFactors:
    """A LoRA policy's engine sync: per adapted linear layer, the name of its weight in
    the plain base model, the factors A (r x in) and B (out x r), and the scale
    (alpha / r), so the engine computes ``W0 + scale * B @ A`` itself."""

    factors: list[tuple[str, torch.Tensor, torch.Tensor, float]]


@torch.no_grad()
def lora_factors(name: str, model: torch.nn.Module) -> LoraFactors:
    """The active adapter's factors of a (sharded) PEFT model; every rank must call it."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    factors = []
    for path, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if (not isinstance(module, LoraLinear) or module.fan_in_fan_out
                or any(module.use_dora.values())):
            raise RuntimeError(f"policy {name!r}: the adapter on {path!r} ({type(module).__name__})"
                               " is not a plain LoRA linear layer; only those can be merged into "
                               "the engine's weights under distributed.backend=ray")
        for adapter in module.active_adapters:
            factors.append((f"{path}.weight", _full_tensor(module.lora_A[adapter].weight),
                            _full_tensor(module.lora_B[adapter].weight),
                            float(module.scaling[adapter])))
    if not factors:
        raise RuntimeError(f"policy {name!r}: found no LoRA layer to sync to the engine")
    return LoraFactors(factors)


class PolicyWorker:
    """One FSDP rank of a policy (a Ray actor)."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.policy: Any = None
        self._sft: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """(ip, free port) on this actor's node; rank 0's is the group's address."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return _ray().util.get_node_ip_address(), port

    def node_id(self) -> str:
        return _ray().get_runtime_context().get_node_id()

    def setup(self, name: str, cfg: Any, where: tuple[str, int], *, total_steps: int,
              need_reference: bool, gpu: bool, timeout_s: float, rng: torch.Tensor) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import polyrl.core  # noqa: F401  (registers policy kinds, losses, ...)

        if gpu:
            torch.cuda.set_device(0)  # Ray shows this actor its own GPU(s) only
        addr, port = where
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        mesh = init_device_mesh("cuda" if gpu else "cpu", (self.world,))
        kwargs = {"device": "cuda"} if gpu else {}
        torch.set_rng_state(rng)  # the driver's: a LoRA adapter starts as in local mode
        self.name, self.lora = name, _uses_lora(cfg)
        self.policy = POLICIES.get(cfg.kind)(name, cfg, total_steps=total_steps,
                                             need_reference=need_reference, shared={}, **kwargs)
        if self.lora:
            _broadcast_trainable(self.policy.model)
        names = _param_names(self.policy.model)
        _shard(self.policy.model, mesh, _fsdp_root(self.policy, self.policy.model))
        if (reference := getattr(self.policy, "reference", None)) is not None:
            _shard(reference, mesh, _fsdp_root(self.policy, reference))
        _rebind_optimizer(self.policy, names)

    def update(self, batch: TensorDict, algo: Any, temperature: float, gen_state: torch.Tensor
               ) -> tuple[dict[str, float], torch.Tensor]:
        from polyrl.core import trainer

        gen = torch.Generator()
        gen.set_state(gen_state)
        out = trainer.update(self.policy, batch, algo, temperature=temperature, generator=gen,
                             dp=(self.rank, self.world))
        return out, gen.get_state()

    def sft_update(self, batch: TensorDict) -> dict[str, float]:
        from polyrl.core import trainer

        return trainer.sft_update(self.policy, batch, dp=(self.rank, self.world))

    def enter_sft(self, lr: float | None) -> None:
        self._sft = self.policy.sft_optimizer(lr)
        self._sft.__enter__()

    def exit_sft(self) -> None:
        ctx, self._sft = self._sft, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _full(self, trainable_only: bool = False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True,
                                ignore_frozen_params=trainable_only)

    def state_dict(self) -> dict[str, Any] | None:
        """Full weights (the trainable adapter alone under LoRA), optimizer and schedule on
        rank 0, laid out as in local mode (so a checkpoint resumes under either backend)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        p = self.policy
        opts = self._full(trainable_only=self.lora)
        stepped = p.optimizer is not None and bool(p.optimizer.state)
        if stepped:
            weights, optim = get_state_dict(p.model, p.optimizer, options=opts)
        else:  # no step yet: the empty state is the local one (and DCP would create it
            # with a zero-gradient step that advances Adam's step count)
            weights = get_model_state_dict(p.model, options=opts)
            optim = p.optimizer.state_dict() if p.optimizer is not None else None
        if self.rank != 0:
            return None
        if self.lora:  # ignore_frozen_params keeps a frozen weight tied to another (lm_head)
            trainable = self._trainable_names()
            weights = {k: v for k, v in weights.items() if k in trainable}
        return {"weights": weights, "optimizer": _optim_by_index(optim) if stepped else optim,
                "scheduler": p.scheduler.state_dict() if p.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank reads the full state and keeps its own shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        p = self.policy
        opts = StateDictOptions(full_state_dict=True)
        if self.lora:
            self._check_adapter_keys(state["weights"])
        if p.optimizer is None or not state["optimizer"]["state"]:
            set_model_state_dict(p.model, state["weights"], options=opts)
            if p.optimizer is not None:  # no moments yet: nothing to shard (see state_dict)
                p.optimizer.load_state_dict(state["optimizer"])
                p.scheduler.load_state_dict(state["scheduler"])
            return
        names = _param_names(p.model)
        order = [names[id(q)] for g in p.optimizer.param_groups for q in g["params"]]
        set_state_dict(p.model, p.optimizer, model_state_dict=state["weights"],
                       optim_state_dict=_optim_by_name(state["optimizer"], order), options=opts)
        p.scheduler.load_state_dict(state["scheduler"])

    def _trainable_names(self) -> set[str]:
        return {n for n, q in self.policy.model.named_parameters() if q.requires_grad}

    def _check_adapter_keys(self, weights: dict[str, torch.Tensor]) -> None:
        """As local mode's ``load_weights``: a LoRA checkpoint may hold adapter weights only."""
        unexpected = sorted(set(weights) - self._trainable_names())
        if unexpected:
            raise RuntimeError(f"policy {self.name!r}: checkpoint does not match the LoRA "
                               f"adapter (unexpected {unexpected[:3]}); was it written for "
                               "another model or LoRA setting?")

    def full_weights(self) -> list | None:
        """What the engine needs, gathered; rank 0 returns ``[ObjectRef]`` (kept off the
        driver): the full weights, or under LoRA the adapter factors alone."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.lora:
            weights: Any = lora_factors(self.name, self.policy.model)
        else:
            weights = get_model_state_dict(self.policy.model, options=self._full())
        return [_ray().put(weights)] if self.rank == 0 else None

    def export(self, out_dir: str) -> None:
        """Rank 0 writes the Hugging Face folder from the gathered weights (under LoRA,
        PEFT's ``save_pretrained`` keeps the adapter alone, as in local mode)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        weights = get_model_state_dict(self.policy.model, options=self._full())
        if self.rank == 0:
            out = Path(out_dir)
            self.policy.model.save_pretrained(out, state_dict=weights)
            # a VLM's processor (tokenizer, image processor, chat template) when it has one
            (getattr(self.policy, "processor", None) or self.policy.tokenizer).save_pretrained(out)
        dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class EngineWorker:
    """A policy's rollout engine on its own actor, over its own copy of the model."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.policy: Any = None
        self.engine: Any = None
        self.base: dict[str, torch.Tensor] = {}  # LoRA: W0 of each adapted layer, on the CPU

    def node(self) -> str:
        return _ray().get_runtime_context().get_node_id()

    def setup(self, name: str, cfg: Any, *, seed: int, gpu: bool) -> None:
        import polyrl.core  # noqa: F401

        local = copy.deepcopy(cfg)
        local.train = False  # weights only: no optimizer, no reference
        if _uses_lora(local):  # a plain base model; sync merges the adapter into it
            local.lora = dataclasses.replace(local.lora, r=0)
        kwargs = {"device": "cuda"} if gpu else {}
        self.policy = POLICIES.get(cfg.kind)(name, local, total_steps=1, need_reference=False,
                                             shared={}, **kwargs)
        self.engine = ENGINES.get(cfg.engine.name)(self.policy, seed=seed, **cfg.engine.args)

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def generate_vl(self, prompts, visions, params, **kwargs):
        return self.engine.generate_vl(prompts, visions, params, **kwargs)

    def sync(self, weights: dict[str, torch.Tensor] | LoraFactors) -> None:
        if isinstance(weights, LoraFactors):
            self._merge(weights)
        elif (load := getattr(self.policy, "load_trainable_state", None)) is not None:
            load(weights)
        else:
            self.policy.model.load_state_dict(weights)
        self.engine.sync()

    @torch.no_grad()
    def _merge(self, update: LoraFactors) -> None:
        """``W = W0 + scale * B @ A`` into the plain model, from the pristine ``W0`` (kept
        on the first sync), so no rounding accumulates over syncs."""
        params = dict(self.policy.model.named_parameters())
        for name, a, b, scale in update.factors:
            if name not in params:
                raise RuntimeError(f"policy {self.policy.name!r}: the engine's model has no "
                                   f"weight {name!r} for the adapter on it")
            w = params[name]
            w0 = self.base.setdefault(name, w.detach().to("cpu", copy=True))
            f32 = {"device": w.device, "dtype": torch.float32}
            delta = (b.to(**f32) @ a.to(**f32)) * scale
            w.copy_((w0.to(**f32) + delta).to(w.dtype))

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)


class RewardWorker:
    """One reward term on its own actor: a reward model loads here once and stays loaded."""

    def __init__(self, term: Any, threads: int) -> None:
        import polyrl.core  # noqa: F401

        torch.set_num_threads(threads)
        self.term = term

    def score(self, samples: list, concurrency: int) -> list:
        import asyncio

        from polyrl.core.rewards import run_term

        return asyncio.run(run_term(self.term, samples, concurrency))

    def pid(self) -> int:
        return os.getpid()


def reward_actor(term: Any, concurrency: int):
    """(actor, async runner) for a reward term with ``actor`` resources."""
    opts = {"num_cpus": float(term.actor.get("num_cpus", 1.0)),
            "num_gpus": float(term.actor.get("num_gpus", 0.0))}
    actor = _ray().remote(RewardWorker).options(**opts).remote(
        term, int(term.actor.get("threads", 1)))
    label = f"reward {term.key!r} actor"

    async def run(samples: list) -> list:
        import asyncio

        ref = actor.score.remote(samples, concurrency)
        return await asyncio.to_thread(lambda: _wait([ref], [label])[0])

    return actor, run


# --------------------------------------------------------------------------- calling actors


def _wait(refs: list, labels: list[str], on_failure=None) -> list:
    """Results of ``refs`` in order. The first failure raises an error naming its role; if
    another actor of the same call died, that one is named (a rank's collective fails when
    a peer dies, and the dead peer is the news)."""
    ray = _ray()
    from ray.exceptions import RayActorError, RayError

    results: list = [None] * len(refs)
    pending = dict(zip(refs, range(len(refs)), strict=True))
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
        except RayError as err:
            failures = [(i, err)]
            if pending and not isinstance(err, RayActorError):
                done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=10)
                for r in done:
                    try:
                        ray.get(r)
                    except RayError as other:
                        failures.append((pending[r], other))
            dead = [(j, e) for j, e in failures if isinstance(e, RayActorError)]
            j, e = (dead or failures)[0]
            if on_failure is not None:
                on_failure()
            what = "died" if dead else "failed"
            raise ActorError(
                f"{labels[j]} {what}: {e}\nThe run cannot continue in this process; resume it "
                "from its last checkpoint (run.resume=true, or polyrl train --resume).") from e
    return results


class _Group:
    """A policy's placement group, its FSDP workers and (later) its engine actor."""

    def __init__(self, name: str, args: RayArgs, cfg: Any, *, total_steps: int,
                 need_reference: bool) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.args, self.world = name, args, args.workers_per_policy
        self.gpu = args.num_gpus_per_worker > 0
        self.broken = False
        self.engine: Any = None
        worker = _resources(args.num_cpus_per_worker, args.num_gpus_per_worker)
        bundles = [dict(worker) for _ in range(self.world)]
        if args.placement == "split":
            bundles.append(_resources(args.num_cpus_per_engine, args.num_gpus_per_engine))
        self.pg = placement_group(bundles, strategy=args.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=args.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"policy {name!r}: Ray could not place {len(bundles)} bundles {bundles} "
                f"(placement={args.placement}, strategy={args.strategy}) within "
                f"{args.placement_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}. "
                "Lower distributed.args.workers_per_policy or num_cpus_per_worker, or add nodes.")
        half = 0.5 if args.placement == "colocate" else 1.0  # worker 0 shares with the engine
        remote = ray.remote(PolicyWorker)
        self.workers = [
            remote.options(
                num_cpus=args.num_cpus_per_worker * (half if k == 0 else 1.0),
                num_gpus=args.num_gpus_per_worker * (half if k == 0 else 1.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=k),
            ).remote(k, self.world, args.threads_per_worker)
            for k in range(self.world)]
        self.labels = [f"policy {name!r} worker {k}" for k in range(self.world)]
        # Start-up runs in the background (so the engine and other policies load meanwhile);
        # the first call waits for it. Rank 0's node hosts the rendezvous.
        where = self.workers[0].rendezvous.remote()
        rng = torch.get_rng_state()
        self._starting = [w.setup.remote(name, cfg, where, total_steps=total_steps,
                                         need_reference=need_reference, gpu=self.gpu,
                                         timeout_s=args.collective_timeout_s, rng=rng)
                          for w in self.workers]
        self._engine_starting: list = []

    @property
    def nodes(self) -> list[str]:
        """The Ray node id of each rank."""
        return self.call("node_id")

    def _check(self) -> None:
        if self.broken:
            raise ActorError(f"policy {self.name!r}: its worker group was stopped after an "
                             "earlier failure; resume the run from its last checkpoint")
        if self._starting:
            starting, self._starting = self._starting, []
            _wait(starting, self.labels, on_failure=self.kill_workers)

    def call(self, method: str, *args, **kwargs) -> list:
        """``method`` on every rank (collectives need them all); the results in rank order."""
        self._check()
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return _wait(refs, self.labels, on_failure=self.kill_workers)

    def make_engine(self, cfg: Any, seed: int) -> None:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a = self.args
        if a.placement == "colocate":
            cpus, gpus, bundle = a.num_cpus_per_worker * 0.5, a.num_gpus_per_worker * 0.5, 0
        else:
            cpus, gpus, bundle = a.num_cpus_per_engine, a.num_gpus_per_engine, self.world
        self.engine = ray.remote(EngineWorker).options(
            num_cpus=cpus, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle),
        ).remote(a.threads_per_worker)
        self.engine_label = f"engine for policy {self.name!r}"
        self._engine_starting = [self.engine.setup.remote(self.name, cfg, seed=seed,
                                                          gpu=gpus > 0)]

    def call_engine(self, method: str, *args, **kwargs) -> Any:
        if self._engine_starting:
            starting, self._engine_starting = self._engine_starting, []
            _wait(starting, [self.engine_label])
        return _wait([getattr(self.engine, method).remote(*args, **kwargs)], [self.engine_label])[0]

    def kill_workers(self) -> None:
        ray = _ray()
        self.broken = True
        for w in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(w)

    def shutdown(self) -> None:
        ray = _ray()
        if not self.broken:
            with contextlib.suppress(Exception):
                ray.get([w.close.remote() for w in self.workers], timeout=30)
        self.kill_workers()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.engine)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.pg)


# --------------------------------------------------------------------------- driver proxies


class RayPolicy:
    """The driver's handle on a policy that trains on a Ray worker group."""

    def __init__(self, name: str, cfg: Any, group: _Group) -> None:
        self.name, self.cfg, self.group = name, cfg, group
        self.tokenizer = POLICIES.get(cfg.kind).load_tokenizer(cfg)

    @property
    def world_size(self) -> int:
        return self.group.world

    def state_dict(self) -> dict[str, Any]:
        """Full weights, optimizer and schedule, gathered on rank 0."""
        return self.group.call("state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = _ray().put(state)  # one copy in the object store, read by every rank
        self.group.call("load_state_dict", ref)

    @contextlib.contextmanager
    def sft_optimizer(self, lr: float | None):
        self.group.call("enter_sft", lr)
        try:
            yield
        finally:
            if not self.group.broken:
                self.group.call("exit_sft")

    def export(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.group.call("export", str(out))
        return out


class RayEngine:
    """The driver's handle on a policy's engine actor; the engine interface."""

    def __init__(self, policy: RayPolicy, engine_cls: Any = None) -> None:
        self.policy, self.group = policy, policy.group
        self.tokenizer = policy.tokenizer
        # a workflow reads what the engine takes (vllm_vl: the resized images themselves)
        self.needs_images = bool(getattr(engine_cls, "needs_images", False))

    def generate(self, prompts, params):
        return self.group.call_engine("generate", [list(p) for p in prompts], params)

    def sync(self) -> None:
        """Gather the trainer's full weights (rank 0) and load them into the engine actor."""
        ref = next(r for r in self.group.call("full_weights") if r is not None)[0]
        self.group.call_engine("sync", ref)

    def state_dict(self) -> dict:
        return self.group.call_engine("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self.group.call_engine("load_state_dict", state)


class RayVLEngine(RayEngine):
    """The handle on an engine actor whose engine takes images (it has ``generate_vl``), so
    ``hasattr(engine, "generate_vl")`` on the driver says what the actor's engine can do."""

    def generate_vl(self, prompts, visions, params, **kwargs):
        """The engine actor's ``generate_vl``. The processed vision inputs (tensors in
        dataclasses) and any ``images`` are pickled into the call, once per prompt (its
        group of ``n`` shares them). The cost is the ``pixel_values``: for Qwen2.5-VL one
        row of 1176 float32 per 14x14 patch, about 24 MB for a 1-megapixel image, so a step
        of many large images moves that much to the engine actor once per rollout."""
        return self.group.call_engine("generate_vl", [list(p) for p in prompts], list(visions),
                                      params, **kwargs)


# --------------------------------------------------------------------------------- backend


def _reduce(outs: list[dict[str, float]], world: int) -> dict[str, float]:
    """Per-rank metrics -> the single-process ones: losses (scaled by ``dp_size`` on each rank)
    are summed and divided by ``world``; global values (lr, grad norm, skips) come from rank
    0; the rest are averaged over the ranks that report them."""
    keys = list(dict.fromkeys(k for o in outs for k in o))
    out: dict[str, float] = {}
    for k in keys:
        vals = [o[k] for o in outs if k in o]
        if k in ("loss", "sft_loss"):
            out[k] = sum(vals) / world
        elif k in ("lr", "grad_norm", "skipped_nonfinite") and k in outs[0]:
            out[k] = outs[0][k]
        else:
            out[k] = sum(vals) / len(vals)
    return out


def _check_lora_kind(name: str, cfg: Any) -> None:
    """LoRA runs here for causal-LM kinds (one PEFT adapter on the policy's own base);
    kinds that share a base model between policies (``lora_agent``) or adapt other model
    types would need their own gather and merge."""
    from polyrl.core.policy import CausalLMPolicy

    if not _uses_lora(cfg):
        return
    kind = POLICIES.get(cfg.kind)
    if not (isinstance(kind, type) and issubclass(kind, CausalLMPolicy)):
        raise ConfigError(
            f"policies.{name}: kind {cfg.kind!r} with lora.r={cfg.lora.r} is not supported by "
            "distributed.backend=ray yet (LoRA runs there for causal_lm-type kinds only; a base "
            "model shared between policies, as lora_agent does, needs a per-adapter gather); "
            "use distributed.backend=local")


class RayBackend:
    """Policies on FSDP2 worker groups, engines on their own actors (see the module doc)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.args = from_dict(RayArgs, dict(cfg.distributed.args), "distributed.args")
        for name in self.args.policies:
            if name not in cfg.policies:
                hint = nearest(name, list(cfg.policies))
                raise ConfigError(f"distributed.args.policies.{name}: no policy {name!r} in the "
                                  "recipe" + (f"; did you mean {hint!r}?" if hint else ""))
        for name, policy_cfg in cfg.policies.items():  # before Ray starts
            _check_lora_kind(name, policy_cfg)
        ray = _ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=self.args.address, num_cpus=self.args.num_cpus,
                     include_dashboard=False)
        self.groups: dict[str, _Group] = {}
        self.reward_actors: list = []

    def make_policy(self, name, cfg, *, total_steps, need_reference, shared):
        _check_lora_kind(name, cfg)
        args = self.args.for_policy(name)
        if args.workers_per_policy < 1:
            raise ConfigError(f"distributed.args: policy {name!r} needs workers_per_policy >= 1")
        group = _Group(name, args, cfg, total_steps=total_steps, need_reference=need_reference)
        self.groups[name] = group
        return RayPolicy(name, cfg, group)

    def make_engine(self, name, policy, cfg, *, seed):
        policy.group.make_engine(cfg, seed)
        engine_cls = ENGINES.get(cfg.engine.name)
        handle = RayVLEngine if hasattr(engine_cls, "generate_vl") else RayEngine
        return handle(policy, engine_cls)

    def reward_runners(self, reward_cfg: Any) -> dict:
        """Remote runners for the reward terms that ask for their own actor."""
        runners = {}
        for term in reward_cfg.terms:
            if term.actor:
                actor, runners[term.key] = reward_actor(term, reward_cfg.concurrency)
                self.reward_actors.append(actor)
        return runners

    def update(self, policy, batch, algo, *, temperature, generator):
        ref = _ray().put(batch)
        results = policy.group.call("update", ref, algo, temperature, generator.get_state())
        generator.set_state(results[0][1])  # the same stream as local mode
        return _reduce([r[0] for r in results], policy.group.world)

    def sft_update(self, policy, batch):
        return _reduce(policy.group.call("sft_update", _ray().put(batch)), policy.group.world)

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        self.groups.clear()
        for actor in self.reward_actors:
            with contextlib.suppress(Exception):
                _ray().kill(actor)
        self.reward_actors.clear()
        if self._owns_ray:
            _ray().shutdown()
            self._owns_ray = False


BACKENDS.register("ray", RayBackend)
