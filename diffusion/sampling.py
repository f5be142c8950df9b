"""The ``diffusion`` engine's sampling options, typed and checked.

Both sides read them: the engine samples with them, and the policy recomputes log-probs in
the engine's convention (``engine.args.logprob``), so they sit below both modules.
"""

from __future__ import annotations

from typing import Any

from polyrl.core.config import ConfigError
from polyrl.core.registry import ENGINES, POLICIES
from polyrl.core.train.policy import PolicyConfig
from polyrl.diffusion.samplers import LOGPROB_FORMS, SAMPLERS, get_sampler

ENGINE_NAME = "diffusion"


def check_sampling(o: Any, where: str, forward_process: bool = False) -> None:
    """Fail naming the key when the engine options ``o`` (bound options, or the engine)
    cannot sample: an unknown or deterministic sampler, too few steps, bad sizes. A policy
    trained on the forward process (``forward_process``: DiffusionNFT) may sample with the ODE."""
    if o.sampler not in SAMPLERS:
        try:
            get_sampler(o.sampler)  # an import path may still resolve
        except (KeyError, ImportError, ValueError, TypeError) as e:
            raise ConfigError(f"{where}.sampler: {e}") from None
    if o.sampler == "ode" and not forward_process:
        raise ConfigError(
            f"{where}.sampler=ode samples without noise, so no step has a "
            "log-probability to train; use flow_sde, dance_sde or cps (the "
            "ODE is what evaluation uses at eval.temperature=0)"
        )
    if o.steps < 2 or (o.eval_steps is not None and o.eval_steps < 1):
        raise ConfigError(f"{where}.steps must be >= 2 (and eval_steps >= 1)")
    if o.noise_level < 0:
        raise ConfigError(f"{where}.noise_level must be >= 0, got {o.noise_level}")
    if o.sampler == "cps" and o.noise_level > 1:
        raise ConfigError(f"{where}.noise_level must be in [0, 1] for cps")
    if o.logprob not in LOGPROB_FORMS:
        raise ConfigError(
            f"{where}.logprob={o.logprob!r} is not a log-prob convention; use one of "
            f"{', '.join(LOGPROB_FORMS)}"
        )
    if o.height <= 0 or o.width <= 0 or o.batch_size < 1 or o.decode_batch < 1:
        raise ConfigError(f"{where}: height, width, batch_size and decode_batch must be > 0")
    if o.frames < 0:
        raise ConfigError(f"{where}.frames must be >= 0 (0: an image model), got {o.frames}")
    o.train_steps.validate(o.steps, f"{where}.train_steps")


def sampling_options(cfg: PolicyConfig, name: str | None = None) -> Any:
    """A diffusion policy's engine options, typed and checked (fails naming the bad key)."""
    prefix = f"policies.{name}." if name else "a diffusion policy's "
    where = f"policies.{name}.engine.args" if name else "engine.args"
    if cfg.engine.name != ENGINE_NAME:
        raise ConfigError(
            f"{prefix}engine.name={cfg.engine.name!r}: a diffusion policy "
            f"samples with the {ENGINE_NAME!r} engine; set engine.name: "
            f"{ENGINE_NAME}"
        )
    options = ENGINES.bind(ENGINE_NAME, cfg.engine.args, where, "the recipe")
    kind = POLICIES.get(cfg.kind) if cfg.kind in POLICIES else None
    check_sampling(options, where, bool(getattr(kind, "forward_process", False)))
    return options
