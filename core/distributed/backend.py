"""Execution backends: where each policy trains and where its engine runs.

The session asks a backend for policies and engines and hands it every update, so the
loop reads the same in local mode (one process, the default) and in Ray mode (each
policy on its own FSDP2 worker group, engines on their own actors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from tensordict import TensorDict

from polyrl.core.interfaces import Engine, Policy
from polyrl.core.registry import BACKENDS, ENGINES, POLICIES
from polyrl.core.rollout.rollouts import LocalVersions, Versions
from polyrl.core.train import trainer
from polyrl.core.train.policy import resolve_device

if TYPE_CHECKING:
    from polyrl.core.recipe import Config
    from polyrl.core.rollout.rewards import RewardConfig, Runner
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.policy import PolicyConfig


class Backend(Protocol):
    """Built as ``backend(cfg)`` (``BACKENDS``), ``cfg`` the whole run's config."""

    def make_policy(
        self, name: str, cfg: PolicyConfig, *, total_steps: int, need_reference: bool, shared: dict
    ) -> Policy: ...

    def make_engine(self, name: str, policy: Policy, cfg: PolicyConfig, *, seed: int) -> Engine: ...

    def update(
        self,
        policy: Policy,
        batch: TensorDict,
        algo: AlgorithmConfig,
        *,
        temperature: float,
        generator: torch.Generator,
        correction: str | None = None,
    ) -> dict[str, float]: ...

    def sft_update(self, policy: Policy, batch: TensorDict) -> dict[str, float]: ...

    def reward_runners(self, reward_cfg: RewardConfig) -> dict[str, Runner]: ...

    def versioned(self, policy: Policy) -> Versions: ...  # async rollouts: the engine's copy

    def fault_metrics(self) -> dict[str, float]: ...  # faults survived so far (faults/*)

    def shutdown(self) -> None: ...


class LocalBackend:
    """Everything in this process; the HF engine shares the trainer's module."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def make_policy(
        self, name: str, cfg: PolicyConfig, *, total_steps: int, need_reference: bool, shared: dict
    ) -> Policy:
        return POLICIES.get(cfg.kind)(
            name,
            cfg,
            total_steps=total_steps,
            need_reference=need_reference,
            shared=shared,
            device=resolve_device(cfg.device),
        )

    def make_engine(self, name: str, policy: Policy, cfg: PolicyConfig, *, seed: int) -> Engine:
        return ENGINES.get(cfg.engine.name)(policy, seed=seed, **cfg.engine.args)

    def update(
        self,
        policy: Policy,
        batch: TensorDict,
        algo: AlgorithmConfig,
        *,
        temperature: float,
        generator: torch.Generator,
        correction: str | None = None,
    ) -> dict[str, float]:
        return trainer.update(
            policy, batch, algo, temperature=temperature, generator=generator, correction=correction
        )

    def update_together(
        self,
        policies: Sequence[Policy],
        batches: list[TensorDict],
        algo: AlgorithmConfig,
        *,
        temperature: float,
        generator: torch.Generator,
        correction: str | None = None,
    ) -> list[dict[str, float]]:
        """Policies that update together (interfaces.UpdatesTogether): one pass per
        micro-batch over all their rows (only this backend offers it; the session asks)."""
        return trainer.update_together(
            policies,
            batches,
            algo,
            temperature=temperature,
            generator=generator,
            correction=correction,
        )

    def sft_update(self, policy: Policy, batch: TensorDict) -> dict[str, float]:
        return trainer.sft_update(policy, batch)

    def reward_runners(self, reward_cfg: RewardConfig) -> dict[str, Runner]:
        return {}  # every reward term runs in this process

    def versioned(self, policy: Policy) -> LocalVersions:
        return LocalVersions(policy)

    def fault_metrics(self) -> dict[str, float]:
        return {}  # one process: nothing dies that the run survives

    def shutdown(self) -> None:
        return None


BACKENDS.register("local", LocalBackend)
