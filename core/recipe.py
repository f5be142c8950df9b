"""The recipe: one typed config composed of each part's own config dataclass."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from polyrl.core.config import ConfigError, doc, doc_factory
from polyrl.core.interfaces import ChecksConfig, Workflow, engine_caps
from polyrl.core.observe.loggers import LoggerName, check_loggers
from polyrl.core.observe.prometheus import check_prometheus
from polyrl.core.registry import (
    BACKENDS,
    CREDIT,
    DATASETS,
    ENGINES,
    MODELS,
    POLICIES,
    POLICY_LOSSES,
    REWARDS,
    TASKS,
    WORKFLOWS,
    nearest,
)
from polyrl.core.rollout.data import DataConfig
from polyrl.core.rollout.rewards import RewardConfig
from polyrl.core.runner.builds import check_build_conflicts
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.policy import PolicyConfig, check_moe_options, resolve_device

# rollout.max_staleness above this is refused: a producer k versions ahead keeps up to
# k + 1 copies of each trained policy's weights (and checkpoints k of them), and trains on
# batches k updates old; AReaL-style runs use a few. 1000000 was a typo that made a 2-step
# run spend minutes on per-step staleness metrics.
MAX_STALENESS = 64
# Estimators that compare a row only with its group (credit "group"): a group whose rewards
# are all equal, or of one row, gets advantage 0 (polyrl.core.train.credit.group_advantages).
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline")


@dataclass
class RunConfig:
    dir: str = doc("runs/{name}", "run directory; {name} is replaced by run.name")
    name: str = doc("run", "short name of the run")
    save_every: int = doc(0, "checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = doc(2, "how many complete checkpoints to keep")
    resume: bool = doc(False, "continue from the last complete checkpoint in run.dir")
    samples_per_step: int = doc(8, "transcripts written to samples/ each logged step")
    log_every: int = doc(1, "write metrics every N steps")
    tensorboard: bool = doc(True, "write TensorBoard events")
    loggers: list[LoggerName] = doc(
        ["tensorboard"],
        "where metrics go besides metrics.jsonl, all under run.dir: tensorboard, wandb "
        "(offline run in wandb/; `wandb sync` uploads it), mlflow (file store in mlruns/); "
        "wandb and mlflow need pip install 'polyrl[loggers]'",
    )
    progress: bool = doc(True, "show a progress bar")
    prometheus_port: int | None = doc(
        None,
        "serve the last logged step's metrics (polyrl_<key>, e.g. polyrl_reward_mean) and "
        "live figures (engine busy share, async queue, gateway latency) for Prometheus at "
        "http://HOST:PORT/metrics while the run lasts; 0: a free port, printed at start; "
        "null: off. Needs pip install 'polyrl[loggers]'. See polyrl.core.observe.prometheus",
    )
    trace_every: int = doc(
        0,
        "record every N-th step's timeline (phases, engine calls, micro-batches, syncs) in "
        "run.dir/trace/ for Perfetto or chrome://tracing; `polyrl trace RUN_DIR` sums it "
        "up (0: off). See polyrl.core.observe.timeline",
    )
    export: bool = doc(True, "export final models in Hugging Face format to run.dir/export")


@dataclass
class TaskConfig:
    name: str | None = doc(
        None, "built-in synthetic task that writes its data files (e.g. arithmetic)"
    )
    dir: str = doc("{run_dir}/data", "where the task writes train/eval/sft files")
    args: Any = doc(
        {}, "options of the task (its write_dataset's keywords)", options=TASKS, chooser="task.name"
    )


@dataclass
class RolloutConfig:
    workflow: str = doc(
        "single_turn", "how an episode is produced (plugins add multi-turn, multi-agent, ...)"
    )
    args: Any = doc({}, "options of the workflow", options=WORKFLOWS, chooser="rollout.workflow")
    n: int = doc(8, "samples per prompt (the group size)")
    prompts_per_step: int = doc(16, "prompts per training step")
    max_new_tokens: int = doc(64, "response length limit")
    temperature: float = doc(1.0, "sampling temperature (also used for training log-probs)")
    top_p: float = doc(1.0, "nucleus sampling")
    stop: list[str] = doc([], "extra stop strings")
    warn_truncated: float = doc(
        0.25,
        "print a warning (once per run) when a step's share of responses cut at "
        "max_new_tokens (rollout/truncated_frac) passes this; 1: never. See "
        "polyrl.core.rollout.truncation",
    )
    max_staleness: int = doc(
        0,
        "0: synchronous (each rollout uses the newest weights). k >= 1: the engines "
        "generate the next batches in the background on their own copy of the weights "
        "while the trainer updates; batch b uses the weights after update b-1-k (local "
        f"and Ray); at most {MAX_STALENESS} (each version in flight keeps a copy of the "
        "trained weights). See polyrl.core.rollout.rollouts",
    )
    partial: bool = doc(
        False,
        "with max_staleness >= 1 (local or Ray): a batch starts with the newest weights and "
        "takes newer ones between decoding steps as the trainer publishes them, so a sync "
        "never waits for generations in flight; rows record each token's version "
        "(token_version; a diffusion engine takes them per sampling pass, one version per "
        "trajectory). Timing decides the versions, so runs are not bitwise reproducible",
    )


@dataclass
class EvalConfig:
    data: DataConfig = doc_factory(DataConfig, "held-out prompts (path empty: no evaluation)")
    every: int = doc(0, "evaluate every N steps (0: only before and after training)")
    temperature: float = doc(0.0, "0 = greedy")
    n: int = doc(1, "samples per eval prompt")
    max_new_tokens: int | None = doc(None, "default: rollout.max_new_tokens")
    accuracy_term: str | None = doc(
        None, "reward term whose mean is reported as accuracy (default: the first term)"
    )


@dataclass
class SFTConfig:
    steps: int = doc(0, "supervised warm-start steps before RL (0: none)")
    data: DataConfig = doc_factory(
        DataConfig, "prompt + target rows; answer_field names the target"
    )
    batch_size: int = doc(32, "rows per SFT step")
    lr: float | None = doc(None, "learning rate for SFT (default: the policy's)")


@dataclass
class TrainConfig:
    steps: int = doc(100, "RL steps (rollout + update)")
    policies: list[str] | None = doc(None, "policies that train (default: all with train: true)")
    max_unscored_steps: int = doc(
        1,
        "stop the run (exit 3, no export) once this many steps in a row had no valid row "
        "(every rollout or reward failed): the next step would fail the same way. A step "
        "with any valid row resets the count. See polyrl.core.runner.failures",
    )


@dataclass
class DistributedConfig:
    backend: Literal["local", "ray"] = doc(
        "local", "local: one process, no Ray; ray: worker groups"
    )
    args: Any = doc(
        {},
        "options of the backend (placement, workers per policy, ...)",
        options=BACKENDS,
        chooser="distributed.backend",
    )


def _packs_rows(kind: str) -> bool:
    """Whether policy kind ``kind`` may form micro-batches by tokens (``PacksRows``): its
    own ``token_budget``, or CausalLMPolicy's with CausalLMPolicy's packed log-prob pass
    (the rule of ``CausalLMPolicy.token_budget``: a kind with its own pass stays padded)."""
    from polyrl.core.train.policy import CausalLMPolicy

    cls = POLICIES.get(kind)
    if not isinstance(cls, type):
        return True  # a factory: what it builds is known only then
    budget = getattr(cls, "token_budget", None)
    if budget is None:
        return False
    if budget is not CausalLMPolicy.token_budget:
        return True  # its own rule, applied when it runs
    return getattr(cls, "logprobs", None) is CausalLMPolicy.logprobs


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _positive(x: float) -> bool:
    return _finite(x) and x > 0


def _plain_name(name: str) -> bool:
    """One path component: run.name goes into run.dir, and must not lead out of it."""
    return bool(name) and not set(name) & {"/", "\\", "\0"} and name not in (".", "..")


@dataclass
class Config:
    seed: int = doc(0, "seed for data order, sampling and initialisation")
    run: RunConfig = doc_factory(RunConfig, "run directory, logging and checkpoints")
    task: TaskConfig = doc_factory(TaskConfig, "synthetic task that generates the data")
    data: DataConfig = doc_factory(DataConfig, "training prompts")
    eval: EvalConfig = doc_factory(EvalConfig, "held-out evaluation")
    policies: dict[str, PolicyConfig] = doc({}, "policies by name; one is the single-agent case")
    rollout: RolloutConfig = doc_factory(RolloutConfig, "sampling and workflow")
    reward: RewardConfig = doc_factory(RewardConfig, "reward terms")
    algorithm: AlgorithmConfig = doc_factory(AlgorithmConfig, "advantages, loss, KL")
    sft: SFTConfig = doc_factory(SFTConfig, "optional supervised warm start")
    train: TrainConfig = doc_factory(TrainConfig, "length of training")
    distributed: DistributedConfig = doc_factory(DistributedConfig, "local or Ray")

    def validate(self, source: str = "<config>") -> None:
        """Fail at config time, before any model loads."""
        if not self.policies:
            raise ConfigError("the recipe declares no policies; add policies: {main: {model: ...}}")
        self.check_ranges(source)
        self.algorithm.rollout_correction.check(source=source)
        self.bind_options(source)
        check_build_conflicts(self.policies, source)
        check_loggers(self.run.loggers, source)
        check_prometheus(self.run.prometheus_port, source)
        for name, p in self.policies.items():
            if not p.model:
                raise ConfigError(f"policies.{name}.model is empty: give a local path or hub id")
            POLICIES.check(p.kind)
            check_moe_options(name, p, source)
            if p.max_tokens_per_micro_batch is not None and not _packs_rows(p.kind):
                raise ConfigError(
                    f"policies.{name}.max_tokens_per_micro_batch="
                    f"{p.max_tokens_per_micro_batch} in {source}: policy kind {p.kind!r} "
                    "keeps its log-prob passes padded (its own pass, e.g. a VLM's), so "
                    "micro-batches are micro_batch_size rows and a token budget would be "
                    "ignored. Remove it and size micro-batches with micro_batch_size"
                )
            ENGINES.check(p.engine.name)
            if self.distributed.backend == "local":
                try:
                    resolve_device(p.device)
                except ValueError as e:
                    raise ConfigError(f"policies.{name}.device: {e}") from None
        for name in self.train.policies or []:
            if name not in self.policies:
                hint = nearest(name, list(self.policies))
                raise ConfigError(
                    f"train.policies names unknown policy {name!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                )
        WORKFLOWS.check(self.rollout.workflow)
        # A workflow may check its own rollout.args (agents, policies it names) before any
        # model loads.
        workflow = WORKFLOWS.get(self.rollout.workflow)
        if isinstance(workflow, ChecksConfig):
            workflow.validate_config(self)
        if self.rollout.partial:
            self.check_partial(workflow, source)
        if self.task.name:
            TASKS.check(self.task.name)
        self.algorithm.validate()
        self.reward.validate()
        lora = [n for n in self.trained_policies() if self.policies[n].lora.r > 0]
        if self.sft.steps and self.algorithm.kl_coef > 0 and lora:
            raise ConfigError(
                f"sft.steps={self.sft.steps} with algorithm.kl_coef={self.algorithm.kl_coef} "
                f"and LoRA on {lora}: a LoRA policy's KL reference is its base with the "
                "adapter disabled, i.e. the weights before the warm start, so KL would pull "
                "RL back past the warm start. Set kl_coef: 0, or warm-start without LoRA "
                "(a full fine-tune's frozen reference takes the warmed-up weights)."
            )

    def check_partial(self, workflow: Callable[..., Workflow], source: str) -> None:
        """``rollout.partial`` needs a producer ahead and engines that take weights mid-call
        (``EngineCaps.partial_rollouts``); every workflow's rows carry the versions the engine
        records (core/segment.py)."""
        where = f"rollout.partial in {source}"
        if self.rollout.max_staleness < 1:
            raise ConfigError(
                f"{where} needs rollout.max_staleness >= 1: weights change during a "
                "rollout only when the engines generate ahead of the trainer"
            )
        for name in self.trained_policies():
            engine = self.policies[name].engine.name
            cls = ENGINES.get(engine)
            if not engine_caps(cls).partial_rollouts:
                raise ConfigError(
                    f"{where}: policies.{name}.engine.name={engine!r} cannot take new "
                    "weights mid-call (EngineCaps.partial_rollouts); use hf or vllm, or "
                    "set rollout.partial: false"
                )

    def check_ranges(self, source: str = "<config>") -> None:
        """Numbers a run cannot mean: each named with its key and the range it must be in."""
        r, e = self.rollout, self.eval
        checks: list[tuple[str, Any, bool, str]] = [
            ("train.steps", self.train.steps, self.train.steps >= 0, ">= 0"),
            ("rollout.n", r.n, r.n >= 1, ">= 1"),
            ("rollout.prompts_per_step", r.prompts_per_step, r.prompts_per_step >= 1, ">= 1"),
            (
                "rollout.max_staleness",
                r.max_staleness,
                0 <= r.max_staleness <= MAX_STALENESS,
                f"in [0, {MAX_STALENESS}]: a producer k versions ahead keeps up to k + 1 "
                "copies of each trained policy's weights and trains on batches k updates "
                "old (core/recipe.py MAX_STALENESS)",
            ),
            ("rollout.max_new_tokens", r.max_new_tokens, r.max_new_tokens >= 1, ">= 1"),
            (
                "rollout.warn_truncated",
                r.warn_truncated,
                _finite(r.warn_truncated) and 0 <= r.warn_truncated <= 1,
                "in [0, 1] (1: never warn)",
            ),
            (
                "train.max_unscored_steps",
                self.train.max_unscored_steps,
                self.train.max_unscored_steps >= 1,
                ">= 1",
            ),
            (
                "rollout.temperature",
                r.temperature,
                _finite(r.temperature) and r.temperature >= 0,
                ">= 0 (0: greedy)",
            ),
            ("rollout.top_p", r.top_p, 0 < r.top_p <= 1, "in (0, 1]"),
            ("eval.n", e.n, e.n >= 1, ">= 1"),
            (
                "eval.temperature",
                e.temperature,
                _finite(e.temperature) and e.temperature >= 0,
                ">= 0 (0: greedy)",
            ),
            (
                "eval.max_new_tokens",
                e.max_new_tokens,
                e.max_new_tokens is None or e.max_new_tokens >= 1,
                ">= 1 or null",
            ),
            ("eval.every", e.every, e.every >= 0, ">= 0"),
            ("sft.steps", self.sft.steps, self.sft.steps >= 0, ">= 0"),
            ("sft.batch_size", self.sft.batch_size, self.sft.batch_size >= 1, ">= 1"),
            (
                "sft.lr",
                self.sft.lr,
                self.sft.lr is None or _positive(self.sft.lr),
                "a finite number > 0 (or null: the policy's)",
            ),
            ("run.save_every", self.run.save_every, self.run.save_every >= 0, ">= 0"),
            (
                "run.keep_checkpoints",
                self.run.keep_checkpoints,
                self.run.keep_checkpoints >= 1,
                ">= 1",
            ),
            ("run.log_every", self.run.log_every, self.run.log_every >= 1, ">= 1"),
            (
                "run.name",
                self.run.name,
                _plain_name(self.run.name),
                "a plain name (no '/', '\\' or '..'; it becomes part of run.dir)",
            ),
            ("run.trace_every", self.run.trace_every, self.run.trace_every >= 0, ">= 0"),
        ]
        for name, p in self.policies.items():
            o, lora = p.optim, p.lora
            w = f"policies.{name}"
            checks += [
                (
                    f"{w}.optim.lr",
                    o.lr,
                    _finite(o.lr) and o.lr >= 0,
                    "a finite number >= 0 (0: frozen after the SFT warm start)",
                ),
                (
                    f"{w}.optim.lr",
                    o.lr,
                    o.lr > 0 or not self.sft.steps or self.sft.lr is not None,
                    "> 0 when the SFT warm start takes the policy's rate (set sft.lr)",
                ),
                (
                    f"{w}.optim.weight_decay",
                    o.weight_decay,
                    _finite(o.weight_decay) and o.weight_decay >= 0,
                    ">= 0",
                ),
                (f"{w}.optim.eps", o.eps, _positive(o.eps), "> 0"),
                (f"{w}.optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
                (
                    f"{w}.optim.max_grad_norm",
                    o.max_grad_norm,
                    _finite(o.max_grad_norm) and o.max_grad_norm >= 0,
                    ">= 0 (0: no clipping)",
                ),
                (
                    f"{w}.optim.betas",
                    o.betas,
                    len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
                    "two numbers in [0, 1)",
                ),
                (f"{w}.micro_batch_size", p.micro_batch_size, p.micro_batch_size >= 1, ">= 1"),
                (
                    f"{w}.max_tokens_per_micro_batch",
                    p.max_tokens_per_micro_batch,
                    p.max_tokens_per_micro_batch is None
                    or (p.pack and p.max_tokens_per_micro_batch >= 1),
                    "null, or >= 1 with pack: true (a token budget needs packed passes)",
                ),
                (f"{w}.lora.r", lora.r, lora.r >= 0, ">= 0 (0: full fine-tune, no adapter)"),
                (f"{w}.lora.alpha", lora.alpha, _positive(lora.alpha), "> 0"),
                (f"{w}.lora.dropout", lora.dropout, 0 <= lora.dropout < 1, "in [0, 1)"),
                (
                    f"{w}.lora.target_modules",
                    lora.target_modules,
                    lora.r == 0 or bool(lora.target_modules),
                    "a non-empty list when lora.r > 0",
                ),
            ]
        for key, value, ok, need in checks:
            if not ok:
                raise ConfigError(f"{key}={value!r} in {source}: must be {need}")
        by_group = self.algorithm.advantage in GROUP_ESTIMATORS and self.algorithm.credit == "group"
        if r.n == 1 and by_group:
            warnings.warn(
                f"rollout.n=1 with algorithm.advantage={self.algorithm.advantage!r} ({source}): "
                "each group has one sample, so every advantage is 0 and nothing trains; "
                "set rollout.n >= 2",
                stacklevel=2,
            )
        elif r.temperature == 0 and by_group and self.train.steps > 0:
            warnings.warn(
                f"rollout.temperature=0 with algorithm.advantage={self.algorithm.advantage!r} "
                f"({source}): greedy decoding gives the {r.n} samples of a prompt the same "
                "response, so each group's rewards are equal and no group can have a "
                "non-zero advantage: nothing trains (unless the reward itself is random); "
                "set rollout.temperature > 0 (1.0 samples the policy as it is)",
                stacklevel=2,
            )

    def bind_options(self, source: str = "<config>") -> None:
        """Each part's options, checked against what the chosen part declares and typed.

        The mappings the recipe wrote become instances of the parts' options dataclasses
        (they unpack as keywords and write back to YAML as the same mappings)."""
        self.rollout.args = WORKFLOWS.bind(
            self.rollout.workflow, self.rollout.args, "rollout.args", source
        )
        if self.task.name:
            self.task.args = TASKS.bind(self.task.name, self.task.args, "task.args", source)
        self.distributed.args = BACKENDS.bind(
            self.distributed.backend, self.distributed.args, "distributed.args", source
        )
        for name, p in self.policies.items():
            where = f"policies.{name}"
            p.args = POLICIES.bind(p.kind, p.args, f"{where}.args", source)
            p.engine.args = ENGINES.bind(
                p.engine.name, p.engine.args, f"{where}.engine.args", source
            )
            if p.build:
                p.build_args = MODELS.bind(p.build, p.build_args, f"{where}.build_args", source)
            elif p.build_args:
                raise ConfigError(
                    f"{where}.build_args in {source} is set but {where}.build is empty"
                )
        for where, data in (
            ("data", self.data),
            ("eval.data", self.eval.data),
            ("sft.data", self.sft.data),
        ):
            data.args = DATASETS.bind(data.kind, data.args, f"{where}.args", source)
        self.algorithm.loss_args = POLICY_LOSSES.bind(
            self.algorithm.policy_loss, self.algorithm.loss_args, "algorithm.loss_args", source
        )
        self.algorithm.credit_args = CREDIT.bind(
            self.algorithm.credit, self.algorithm.credit_args, "algorithm.credit_args", source
        )
        for i, term in enumerate(self.reward.terms):
            if not isinstance(term, str):
                term.args = REWARDS.bind(term.name, term.args, f"reward.terms[{i}].args", source)

    def trained_policies(self) -> list[str]:
        if self.train.policies is not None:
            return list(self.train.policies)
        return [n for n, p in self.policies.items() if p.train]
