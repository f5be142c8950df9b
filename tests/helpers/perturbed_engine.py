"""A test engine whose sampling distribution is deliberately not the trainer's.

``PerturbedEngine`` is the HF engine sampling from perturbed logits: divided by ``scale``
(a temperature gap), plus Gaussian ``noise``, with ``demote`` taken off the policy's top
token at each step (steering samples away from its greedy answer). The record keeps the
log-probs of the distribution the engine really sampled from, so the trainer sees a true
engine/trainer gap, as with vLLM in bf16 or a quantized rollout, only larger. It does
not declare ``caps.exact_logprobs``: ``rollout_correction.level: auto`` corrects it.

For a mixture-of-experts policy, ``route_noise`` perturbs the ROUTING as well: each router
picks its top-k experts from its logits plus Gaussian noise of that std, while the chosen
experts' weights stay the router's own softmax at them. A token near a tie between experts
then goes to other experts than the trainer's router would send it to, the failure mode
routing replay fixes (an engine's other kernels flip near ties the same way, only less
often); the HF engine's capture records the experts really used, so replay can repeat them.

Greedy decoding (temperature 0, the evaluation) is left unperturbed, so held-out accuracy
measures the trained policy, not the engine. Name it in a recipe by import path:
``engine: {name: "tests.helpers.perturbed_engine:PerturbedEngine", args: {scale: 2.0}}``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Annotated, Any

import torch

from polyrl.core.rollout.engine import Completion, HFEngine, SamplingParams
from polyrl.core.train import moe


class _PerturbedModel:
    """The policy's model with its logits perturbed; every other attribute is the model's."""

    def __init__(self, model: Any, perturb) -> None:
        self._model, self._perturb = model, perturb

    def __call__(self, **kwargs):
        out = self._model(**kwargs)
        out.logits = self._perturb(out.logits)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _View:
    """What the HF engine reads of a policy: its tokenizer, and its model perturbed while
    ``on`` (the engine's own weights stay the policy's, so sync still costs nothing)."""

    def __init__(self, policy: Any, perturb) -> None:
        self.policy, self.perturb, self.on = policy, perturb, False
        self.name, self.tokenizer = policy.name, policy.tokenizer

    @property
    def model(self) -> Any:
        model = self.policy.model
        return _PerturbedModel(model, self.perturb) if self.on else model


class PerturbedEngine(HFEngine):
    """The HF engine sampling from perturbed logits, recording their true log-probs."""

    # its log-probs are not the trainer's: correction applies
    caps = dataclasses.replace(HFEngine.caps, exact_logprobs=False)

    def __init__(
        self,
        policy,
        *,
        seed: int = 0,
        scale: Annotated[
            float, "logits are divided by this before the sampling temperature (> 1: hotter)"
        ] = 1.0,
        noise: Annotated[float, "std of Gaussian noise added to each step's logits"] = 0.0,
        demote: Annotated[float, "subtracted from the top logit at each sampled step"] = 0.0,
        route_noise: Annotated[
            float, "MoE: std of Gaussian noise on router logits when choosing experts"
        ] = 0.0,
        batch_size: Annotated[int, "rows decoded together"] = 256,
    ) -> None:
        if not scale > 0 or noise < 0 or demote < 0 or route_noise < 0:
            raise ValueError(
                f"PerturbedEngine: scale={scale} must be > 0, noise={noise}, "
                f"demote={demote} and route_noise={route_noise} >= 0"
            )
        self.scale, self.noise, self.demote = scale, noise, demote
        self.route_noise = route_noise
        self.noise_gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.view = _View(policy, self._perturb)
        super().__init__(self.view, batch_size=batch_size, seed=seed)

    def _perturb(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / self.scale
        if self.demote:
            top = logits.argmax(-1, keepdim=True)
            logits = logits.scatter_add(
                -1, top, torch.full_like(top, -self.demote, dtype=logits.dtype)
            )
        if self.noise:
            eps = torch.randn(logits.shape, generator=self.noise_gen, dtype=logits.dtype)
            logits = logits + self.noise * eps.to(logits.device)
        return logits

    def _route_hook(self, thread: int):
        """A router forward hook: its top-k drawn from noisy logits, weighted by its own
        softmax at them (moe.replay_scores); only in the generating thread."""

        def hook(router: torch.nn.Module, args: Any, output: Any) -> Any:
            if threading.get_ident() != thread:
                return None
            logits, _scores, own = output
            eps = torch.randn(logits.shape, generator=self.noise_gen, dtype=torch.float32)
            noisy = logits.float() + self.route_noise * eps.to(logits.device)
            idx = noisy.topk(own.shape[-1], -1).indices.to(own.dtype)
            return logits, moe.replay_scores(router, logits, idx), idx

        return hook

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        self.view.on = params.temperature > 0
        handles = []
        if self.view.on and self.route_noise:  # first: the engine's capture records these
            hook = self._route_hook(threading.get_ident())
            for router in moe.routers(self.view.policy.model):
                handles.append(router.register_forward_hook(hook, prepend=True))
        try:
            return super().generate(prompts, params)
        finally:
            self.view.on = False
            for h in handles:
                h.remove()

    def state_dict(self) -> dict:
        return super().state_dict() | {"noise_rng": self.noise_gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.noise_gen.set_state(state["noise_rng"])
