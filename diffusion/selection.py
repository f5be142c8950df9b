"""Which denoising steps of a trajectory are trained.

Training every step costs one transformer forward/backward per step, so recipes train a
subset (Flow-GRPO, arXiv 2505.05470, trains a random fraction of the steps; the modes are
listed in diffusion/README.md, "Recipe keys"):

- ``all``: every step but the last.
- ``fraction`` (Flow-GRPO ``timestep_fraction``): ``round(fraction·(N-1))`` steps drawn at
  random per trajectory.
- ``window`` (Flow-GRPO-Fast): a fixed window of ``window_size`` steps from ``window_start``.
- ``sliding`` (MixGRPO): a window of ``window_size`` steps that starts at ``window_start`` and
  moves ``stride`` steps every ``shift_every`` training rollouts, wrapping back to the start
  once it would pass the last trainable step.

The last step (σ → 0) is never trained. Steps outside the selection may still be sampled
with noise (``noise_outside: true``, Flow-GRPO) or with the deterministic ODE
(``noise_outside: false``, MixGRPO / Flow-GRPO-Fast): with ODE outside, the trained steps
carry all of the trajectory's randomness and so all of its credit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.core.config import ConfigError, doc
from polyrl.core.registry import nearest

MODES = ("all", "fraction", "window", "sliding")


@dataclass(frozen=True)
class StepSelection:
    """Which denoising steps are trained (the last step never is); frozen, so one default
    instance can be shared."""

    mode: str = doc("all", f"one of {', '.join(MODES)}")
    fraction: float = doc(0.6, "fraction: share of the trainable steps drawn per trajectory")
    window_start: int = doc(0, "window/sliding: first trained step (0 = the σ=1 step)")
    window_size: int = doc(2, "window/sliding: number of consecutive trained steps")
    stride: int = doc(1, "sliding: steps the window moves each time it moves")
    shift_every: int = doc(25, "sliding: training rollouts between two moves of the window")
    noise_outside: bool = doc(
        True,
        "sample untrained steps with noise (false: deterministic "
        "ODE outside the trained steps, as MixGRPO)",
    )

    def validate(self, steps: int, where: str = "train_steps") -> None:
        if self.mode not in MODES:
            hint = nearest(self.mode, MODES)
            raise ConfigError(
                f"{where}.mode={self.mode!r} is not a step-selection mode"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" Valid: {', '.join(MODES)}."
            )
        if steps < 2:
            raise ConfigError(
                f"{where}: {steps} sampling steps leave none to train (the last "
                "step is never trained); use at least 2"
            )
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"{where}.fraction must be in (0, 1], got {self.fraction}")
        if self.window_size < 1 or self.stride < 1 or self.shift_every < 1:
            raise ConfigError(f"{where}: window_size, stride and shift_every must be >= 1")
        if self.mode in ("window", "sliding") and not 0 <= self.window_start < steps - 1:
            raise ConfigError(
                f"{where}.window_start={self.window_start} must be in "
                f"[0, {steps - 2}] for {steps} sampling steps"
            )


def window_start(sel: StepSelection, steps: int, rollout: int) -> int:
    """First trained step of the window for training rollout number ``rollout`` (0-based)."""
    trainable = steps - 1
    if sel.mode == "window":
        return sel.window_start
    size = min(sel.window_size, trainable)
    positions = max(1, (trainable - size - sel.window_start) // sel.stride + 1)
    return sel.window_start + (rollout // sel.shift_every % positions) * sel.stride


def select_steps(
    sel: StepSelection,
    rows: int,
    steps: int,
    *,
    rollout: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[rows, steps] bool: the steps each trajectory trains (never the last one)."""
    trainable = steps - 1
    mask = torch.zeros((rows, steps), dtype=torch.bool)
    if sel.mode == "all":
        mask[:, :trainable] = True
    elif sel.mode == "fraction":
        k = max(1, min(trainable, round(sel.fraction * trainable)))
        order = torch.rand((rows, trainable), generator=generator).argsort(dim=1)
        mask[:, :trainable].scatter_(1, order[:, :k], True)
    else:
        start = window_start(sel, steps, rollout)
        mask[:, start : min(start + sel.window_size, trainable)] = True
    return mask


def noise_mask(sel: StepSelection, trained: torch.Tensor) -> torch.Tensor:
    """[rows, steps] bool: the steps sampled with noise."""
    return torch.ones_like(trained) if sel.noise_outside else trained.clone()
