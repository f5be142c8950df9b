"""The Ray backend (``distributed.backend: ray``): each policy trains on its own FSDP2 group.

What runs where:

- **Trainer.** Each policy gets a worker group of N Ray actors (``workers_per_policy``, or
  per policy in ``policies``). Every actor loads the policy kind as in local mode, shards
  it with FSDP2 (``fully_shard`` on each decoder layer, then on the root; gloo on CPU,
  NCCL on GPU; a policy whose pass calls its model's parts one by one, as a VLM's does,
  names the root module through ``fsdp_root``) and runs
  :func:`polyrl.core.train.trainer.update` with ``dp=(rank, world)``: each
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
- **LoRA** (``lora.r > 0``; causal-LM kinds, and kinds whose ``caps`` say ``ray_lora``:
  one PEFT adapter of plain linear layers on the policy's own model, as the diffusion
  kind's). Every rank wraps the base in PEFT as in
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
  folder for LoRA, or what the policy's ``export_weights(out_dir, weights)`` writes from
  the gathered weights when its kind has one; so in a multi-node run the run directory must
  be on storage rank 0's node sees). ``make_engine`` returns a :class:`RayEngine` proxy with
  the engine interface plus the methods the engine class declares in
  ``caps.remote_methods`` (core/interfaces.py EngineCaps), so a workflow runs unchanged against the actor.

A dead worker or engine actor stops the run with :class:`ActorError`, naming the
role (``policy 'main' worker 1 died: ...``); the group is torn down, and the run resumes
from its last checkpoint (``run.resume=true`` / ``polyrl train --resume``) with fresh
actors. Whatever a run raises, it has shut this backend down before the error reaches the
caller (``Session.freed_on_error``): every actor killed, every placement group removed. An engine actor is restarted in the run instead, up to ``max_restarts`` times,
from the weights and RNG state it had, and the interrupted call sent again
(:mod:`polyrl.core.distributed.ray_engine_actor`; counted as ``faults/engine_restarts``). A policy's checkpoint is sharded by default (``checkpoint: sharded``; see
:mod:`polyrl.core.runner.checkpoint`): each rank writes its own shards, with no full gather, and
the directory loads into any world size and into local mode. ``checkpoint: full`` has
rank 0 gather the local layout instead (the full weights, or the adapter weights alone
under LoRA; the optimizer state keyed by parameter position; the schedule). Not supported
yet: LoRA on other policy kinds (without ``ray_lora``), and base models shared between
policies (one LoRA adapter per policy on one base: each group would need an adapter-aware
gather per policy).

Actors start in the background (all policies and engines load at once); the first call
to a group or engine waits for it. Every Ray node needs the same Python environment with
polyrl installed. Ray is imported only when this backend is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from polyrl.core.config import NONNEGATIVE, ConfigError, doc, from_dict
from polyrl.core.distributed.ray_engine_actor import EngineActor
from polyrl.core.distributed.ray_workers import (  # noqa: F401  (ActorError: part of this module's API)
    ActorError,
    PolicyWorker,
    require_ray,
    resources_of,
    reward_actor,
    uses_lora,
    wait,
)
from polyrl.core.interfaces import EngineCaps, HostImageTurns, engine_caps, policy_caps
from polyrl.core.options import Options
from polyrl.core.registry import BACKENDS, ENGINES, POLICIES, nearest
from polyrl.core.rollout.engine import Completion, Prompt, SamplingParams, as_requests
from polyrl.core.runner.builds import ensure_model

if TYPE_CHECKING:
    from tensordict import TensorDict

    from polyrl.core.rollout.rewards import RewardConfig, Runner
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.policy import PolicyConfig

_GROUP_FIELDS = (
    "workers_per_policy",
    "placement",
    "strategy",
    "num_cpus_per_worker",
    "num_gpus_per_worker",
    "num_cpus_per_engine",
    "num_gpus_per_engine",
    "threads_per_worker",
)


@dataclass
class RayArgs(Options):
    """``distributed.args`` for ``distributed.backend: ray``."""

    address: str | None = doc(
        None,
        "Ray cluster to join ('auto', 'ray://host:port'); default: "
        "the one this process already joined, else a new local one",
    )
    num_cpus: int | None = doc(None, "CPUs of a local Ray instance this backend starts (None: all)")
    workers_per_policy: int = doc(1, "FSDP ranks (one Ray actor each) that train each policy")
    placement: Literal["colocate", "split"] = doc(
        "colocate", "colocate: the engine shares worker 0's bundle; split: its own bundle"
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = doc(
        "PACK", "Ray placement-group strategy for a policy's bundles"
    )
    num_cpus_per_worker: float = doc(1.0, "CPUs reserved for each trainer worker")
    num_gpus_per_worker: float = doc(0.0, "GPUs for each trainer worker (>0: NCCL, CUDA)")
    num_cpus_per_engine: float = doc(1.0, "CPUs reserved for the engine actor (split placement)")
    num_gpus_per_engine: float = doc(0.0, "GPUs for the engine actor (split placement)")
    threads_per_worker: int = doc(1, "torch threads in each worker and engine actor")
    cpu_offload: bool = doc(
        False,
        "GPU workers: FSDP2 keeps parameter, gradient and optimizer-state shards in host "
        "memory (CPUOffloadPolicy; the optimizer step runs on the CPU)",
    )
    checkpoint: Literal["sharded", "full"] = doc(
        "sharded",
        "sharded: each rank writes its own shards of a policy (torch.distributed.checkpoint; "
        "loads into any world size and into local mode); full: rank 0 gathers the local layout",
    )
    collective_timeout_s: float = doc(1800.0, "timeout of the group's torch.distributed calls")
    max_restarts: int = doc(
        0,
        "times each policy's engine actor is restarted in the run when it dies (its "
        "weights and RNG state restored, the interrupted call sent again; see "
        "core/distributed/ray_engine_actor.py); 0: a dead engine ends the run (resume it)",
        bound=NONNEGATIVE,
    )
    placement_timeout_s: float = doc(120.0, "how long to wait for Ray to place a policy's group")
    policies: dict[str, dict[str, Any]] = doc(
        {}, "per-policy overrides of the group fields, e.g. {critic: {workers_per_policy: 1}}"
    )

    def for_policy(self, name: str) -> RayArgs:
        override = self.policies.get(name, {})
        where = f"distributed.args.policies.{name}"
        bad = [k for k in override if k not in _GROUP_FIELDS]
        if bad:
            raise ConfigError(
                f"{where}.{bad[0]} cannot be set per policy; per-policy keys: "
                f"{', '.join(_GROUP_FIELDS)}"
            )
        checked = from_dict(RayArgs, override, where)
        return dataclasses.replace(self, **{k: getattr(checked, k) for k in override})


class _Group:
    """A policy's placement group, its FSDP workers and (later) its engine actor."""

    def __init__(
        self, name: str, args: RayArgs, cfg: Any, *, total_steps: int, need_reference: bool
    ) -> None:
        ray = require_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.args, self.world = name, args, args.workers_per_policy
        self.gpu = args.num_gpus_per_worker > 0
        self.broken = False
        self.engine_actor: EngineActor | None = None
        worker = resources_of(args.num_cpus_per_worker, args.num_gpus_per_worker)
        bundles = [dict(worker) for _ in range(self.world)]
        if args.placement == "split":
            bundles.append(resources_of(args.num_cpus_per_engine, args.num_gpus_per_engine))
        self.pg = placement_group(bundles, strategy=args.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=args.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"policy {name!r}: Ray could not place {len(bundles)} bundles {bundles} "
                f"(placement={args.placement}, strategy={args.strategy}) within "
                f"{args.placement_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}. "
                "Lower distributed.args.workers_per_policy or num_cpus_per_worker, or add nodes."
            )
        half = 0.5 if args.placement == "colocate" else 1.0  # worker 0 shares with the engine
        remote = ray.remote(PolicyWorker)
        self.workers = [
            remote.options(
                num_cpus=args.num_cpus_per_worker * (half if k == 0 else 1.0),
                num_gpus=args.num_gpus_per_worker * (half if k == 0 else 1.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=k
                ),
            ).remote(k, self.world, args.threads_per_worker)
            for k in range(self.world)
        ]
        self.labels = [f"policy {name!r} worker {k}" for k in range(self.world)]
        # Start-up runs in the background (so the engine and other policies load meanwhile);
        # the first call waits for it. Rank 0's node hosts the rendezvous.
        where = self.workers[0].rendezvous.remote()
        rng = torch.get_rng_state()
        self._starting = [
            w.setup.remote(
                name,
                cfg,
                where,
                total_steps=total_steps,
                need_reference=need_reference,
                gpu=self.gpu,
                timeout_s=args.collective_timeout_s,
                rng=rng,
                cpu_offload=args.cpu_offload,
            )
            for w in self.workers
        ]

    @property
    def engine(self) -> Any:
        """The engine actor's Ray handle now (a restart replaces it)."""
        return self.engine_actor.handle if self.engine_actor is not None else None

    @property
    def nodes(self) -> list[str]:
        """The Ray node id of each rank."""
        return self.call("node_id")

    def _check(self) -> None:
        if self.broken:
            raise ActorError(
                f"policy {self.name!r}: its worker group was stopped after an "
                "earlier failure; resume the run from its last checkpoint"
            )
        if self._starting:
            starting, self._starting = self._starting, []
            wait(starting, self.labels, on_failure=self.kill_workers)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """``method`` on every rank (collectives need them all); the results in rank order."""
        self._check()
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return wait(refs, self.labels, on_failure=self.kill_workers)

    def make_engine(self, cfg: Any, seed: int) -> EngineActor:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a = self.args
        if a.placement == "colocate":
            cpus, gpus, bundle = a.num_cpus_per_worker * 0.5, a.num_gpus_per_worker * 0.5, 0
        else:
            cpus, gpus, bundle = a.num_cpus_per_engine, a.num_gpus_per_engine, self.world
        placed = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        self.engine_actor = EngineActor(
            self.name,
            cfg,
            seed=seed,
            gpu=gpus > 0,
            threads=a.threads_per_worker,
            options={"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": placed},
            max_restarts=a.max_restarts,
            gather=self.gather,
        )
        return self.engine_actor

    def gather(self) -> Any:
        """The trainer's weights for the engine (the LoRA factors under LoRA), gathered
        on rank 0 into the object store: a reference."""
        return next(r for r in self.call("full_weights") if r is not None)[0]

    def kill_workers(self) -> None:
        ray = require_ray()
        self.broken = True
        for w in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(w)

    def shutdown(self) -> None:
        ray = require_ray()
        if not self.broken:
            with contextlib.suppress(Exception):
                ray.get([w.close.remote() for w in self.workers], timeout=30)
        self.kill_workers()
        if self.engine_actor is not None:
            self.engine_actor.kill()
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.pg)


# --------------------------------------------------------------------------- driver proxies


class RayPolicy:
    """The driver's handle on a policy that trains on a Ray worker group."""

    def __init__(self, name: str, cfg: Any, group: _Group) -> None:
        self.name, self.cfg, self.group = name, cfg, group
        cls = POLICIES.get(cfg.kind)
        self.tokenizer = cls.load_tokenizer(cfg)
        if isinstance(cls, HostImageTurns):  # the handle takes image turns (TakesImageTurns)
            turns = cls.image_turns(self.tokenizer)
            self.image_token_id = turns.image_token_id
            self.encode_images, self.join_images = turns.encode_images, turns.join_images

    def model_config(self) -> Any | None:
        """The model's transformers config, read from its folder here on the driver
        (``ConfigOnDriver``: tokens/s and MFU for a policy trained on workers)."""
        from transformers import AutoConfig

        path = Path(ensure_model(self.cfg.model, self.cfg.build, self.cfg.build_args))
        if path.is_dir() and not (path / "config.json").is_file():
            return None  # a diffusers folder (model_index.json): no transformers config
        return AutoConfig.from_pretrained(str(path))

    @property
    def world_size(self) -> int:
        return self.group.world

    def state_dict(self) -> dict[str, Any]:
        """Full weights, optimizer and schedule, gathered on rank 0."""
        return self.group.call("state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = require_ray().put(state)  # one copy in the object store, read by every rank
        self.group.call("load_state_dict", ref)

    @property
    def sharded_checkpoint(self) -> bool:
        return self.group.args.checkpoint == "sharded"

    def save_sharded(self, path: Path) -> None:
        """Each rank writes its own shards into ``path`` (see :mod:`polyrl.core.runner.checkpoint`);
        the directory must be on storage every rank's node sees."""
        self.group.call("save_sharded", str(path))

    def load_sharded(self, path: Path) -> None:
        self.group.call("load_sharded", str(path))

    @contextlib.contextmanager
    def sft_optimizer(self, lr: float | None) -> Iterator[None]:
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
    """The driver's handle on a policy's engine actor: the :class:`Engine` interface, plus
    each method the engine class declares in ``caps.remote_methods`` (an image-aware generate,
    whole-trajectory sampling), forwarded to the actor by name, so a workflow calls the
    handle as it would the engine. Arguments and results are pickled into the call: for a
    VLM's pixel values that is about 24 MB per 1-megapixel image per rollout.

    The actor's handle (:class:`~polyrl.core.distributed.ray_engine_actor.EngineActor`) keeps the
    engine's state (its RNG) as each call returns it, so :meth:`state_dict`, which async
    rollouts take before every batch, makes no call; and restarts a dead actor from it
    (``distributed.args.max_restarts``)."""

    def __init__(self, policy: RayPolicy, actor: EngineActor, engine_cls: Any = None) -> None:
        self.policy, self.group, self.actor = policy, policy.group, actor
        self.tokenizer = policy.tokenizer
        # a workflow reads what the engine takes (images; vllm_vl: the resized images too);
        # a painter's engine (its paint and prompt_limit are in remote_methods): the session
        # and the workflows ask the handle, as they would the engine, whether it paints.
        # The handle itself never streams tokens nor is exact (the actor is another copy).
        cls_caps = engine_caps(engine_cls)
        self.caps = EngineCaps(
            takes_images=cls_caps.takes_images,
            needs_images=cls_caps.needs_images,
            paints_images=cls_caps.paints_images,
            remote_methods=cls_caps.remote_methods,
        )
        for method in cls_caps.remote_methods:
            setattr(self, method, functools.partial(self.actor.call_keeping, "call", method))

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self.actor.call_keeping("generate", as_requests(prompts), params)

    def sync(self) -> None:
        """Gather the trainer's full weights (rank 0) and load them into the engine actor."""
        self.actor.call("sync", self.group.gather())

    def state_dict(self) -> dict:
        return self.actor.state()

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state(state)


class RayVersions:
    """Async rollouts under Ray: a version is the gathered weights (or LoRA factors) in
    the object store, put there by rank 0; the engine actor loads one by reference, so
    versions never pass through the driver except into a checkpoint. The load is sent
    without waiting (the batch's first engine call waits for it), and the version a
    batch needs is sent ahead while the batch before it generates (:meth:`prefetch`)."""

    def __init__(self, policy: RayPolicy) -> None:
        self.policy = self.engine_policy = policy

    def capture(self) -> Any:
        return self.policy.group.gather()

    def load(self, engine: RayEngine, version: Any) -> None:
        engine.actor.submit("load_version", [version])

    def prefetch(self, engine: RayEngine, version: Any) -> None:
        engine.actor.submit("stage", version.hex(), version)

    engine_in_process = False  # the actor refreshes itself: after a partial call, ask again

    def begin_partial(self, engine: RayEngine, start: int, refresh: Any) -> None:
        engine.actor.submit("partial", start)  # the actor's own refresh takes offers

    def offer(self, engine: RayEngine, number: int, version: Any) -> None:
        engine.actor.offer(number, version)

    def end_partial(self, engine: RayEngine) -> None:
        engine.actor.submit("partial", None)

    def saved(self, version: Any) -> Any:
        return require_ray().get(version)

    def restored(self, saved: Any) -> Any:
        return require_ray().put(saved)


# --------------------------------------------------------------------------------- backend


def _reduce(outs: list[dict[str, float]], world: int) -> dict[str, float]:
    """Per-rank metrics -> the single-process ones: losses (scaled by ``dp_size`` on each rank)
    are summed and divided by ``world``; global values (lr, grad norm, skips) come from rank
    0; maxima (``*_max``) are the largest rank's; the rest are averaged over the ranks that
    report them (for the mismatch means and quantiles, an average of per-rank values)."""
    keys = list(dict.fromkeys(k for o in outs for k in o))
    out: dict[str, float] = {}
    for k in keys:
        vals = [o[k] for o in outs if k in o]
        if k in ("loss", "sft_loss"):
            out[k] = sum(vals) / world
        elif k in ("lr", "grad_norm", "skipped_nonfinite") and k in outs[0]:
            out[k] = outs[0][k]
        elif k.endswith("_max"):
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


def _check_lora_kind(name: str, cfg: Any) -> None:
    """LoRA runs here for causal-LM kinds and kinds that declare ``ray_lora`` (one PEFT
    adapter of plain linear layers on the policy's own model, so the gather and the
    engine's merge apply); kinds that share a base model between policies
    would need their own gather and merge."""
    from polyrl.core.train.policy import CausalLMPolicy

    if not uses_lora(cfg):
        return
    kind = POLICIES.get(cfg.kind)
    if not (
        isinstance(kind, type) and (issubclass(kind, CausalLMPolicy) or policy_caps(kind).ray_lora)
    ):
        raise ConfigError(
            f"policies.{name}: kind {cfg.kind!r} with lora.r={cfg.lora.r} is not supported by "
            "distributed.backend=ray yet (LoRA runs there for causal_lm-type kinds and kinds "
            "that set ray_lora; a base model shared between policies "
            "needs a per-adapter gather); use distributed.backend=local"
        )


class RayBackend:
    """Policies on FSDP2 worker groups, engines on their own actors (see the module doc)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.args = cast(RayArgs, BACKENDS.bind("ray", cfg.distributed.args, "distributed.args"))
        for name in self.args.policies:
            if name not in cfg.policies:
                hint = nearest(name, list(cfg.policies))
                raise ConfigError(
                    f"distributed.args.policies.{name}: no policy {name!r} in the "
                    "recipe" + (f"; did you mean {hint!r}?" if hint else "")
                )
        for name, policy_cfg in cfg.policies.items():  # before Ray starts
            _check_lora_kind(name, policy_cfg)
        ray = require_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(
                address=self.args.address, num_cpus=self.args.num_cpus, include_dashboard=False
            )
        self.groups: dict[str, _Group] = {}
        self.reward_actors: list = []

    def make_policy(
        self, name: str, cfg: PolicyConfig, *, total_steps: int, need_reference: bool, shared: dict
    ) -> RayPolicy:
        _check_lora_kind(name, cfg)
        args = self.args.for_policy(name)
        if args.workers_per_policy < 1:
            raise ConfigError(f"distributed.args: policy {name!r} needs workers_per_policy >= 1")
        if args.cpu_offload and not args.num_gpus_per_worker:
            raise ConfigError(
                f"distributed.args.cpu_offload: policy {name!r} trains on CPU workers, whose "
                "state is in host memory already; set num_gpus_per_worker > 0 or drop it"
            )
        group = _Group(name, args, cfg, total_steps=total_steps, need_reference=need_reference)
        self.groups[name] = group
        return RayPolicy(name, cfg, group)

    def make_engine(
        self, name: str, policy: RayPolicy, cfg: PolicyConfig, *, seed: int
    ) -> RayEngine:
        actor = policy.group.make_engine(cfg, seed)
        return RayEngine(policy, actor, ENGINES.get(cfg.engine.name))

    def fault_metrics(self) -> dict[str, float]:
        """The engine restarts so far (``max_restarts`` > 0: the runs that survive them)."""
        if not self.args.max_restarts:
            return {}
        actors = [g.engine_actor for g in self.groups.values() if g.engine_actor is not None]
        return {"faults/engine_restarts": float(sum(a.restarts for a in actors))}

    def versioned(self, policy: RayPolicy) -> RayVersions:
        return RayVersions(policy)

    def reward_runners(self, reward_cfg: RewardConfig) -> dict[str, Runner]:
        """Remote runners for the reward terms that ask for their own actor."""
        runners: dict[str, Runner] = {}
        for term in reward_cfg.terms:
            if term.actor:
                actor, runners[term.key] = reward_actor(term, reward_cfg.concurrency)
                self.reward_actors.append(actor)
        return runners

    def update(
        self,
        policy: RayPolicy,
        batch: TensorDict,
        algo: AlgorithmConfig,
        *,
        temperature: float,
        generator: torch.Generator,
        correction: str | None = None,
    ) -> dict[str, float]:
        ref = require_ray().put(batch)
        results = policy.group.call(
            "update", ref, algo, temperature, generator.get_state(), correction
        )
        generator.set_state(results[0][1])  # the same stream as local mode
        return _reduce([r[0] for r in results], policy.group.world)

    def sft_update(self, policy: RayPolicy, batch: TensorDict) -> dict[str, float]:
        return _reduce(
            policy.group.call("sft_update", require_ray().put(batch)), policy.group.world
        )

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        self.groups.clear()
        for actor in self.reward_actors:
            with contextlib.suppress(Exception):
                require_ray().kill(actor)
        self.reward_actors.clear()
        if self._owns_ray:
            require_ray().shutdown()
            self._owns_ray = False


BACKENDS.register("ray", RayBackend, options=RayArgs)
