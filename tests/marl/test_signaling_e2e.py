"""End-to-end: the signaling demo learns (3 seeds), the convention lives in the pair (swap),
one shared model with role prompts learns too, so do LoRA adapters on one frozen base, and
a frozen agent stays bitwise unchanged. CI runs the demo's seed 0 and the variants'
mechanics (a few steps each); the variants' learning runs are ``seeds`` evidence.
Each run trains a recipe in ``examples/`` on tiny models built offline in a temp dir; the
held-out success curves are printed (``pytest -s``) and kept in each run's metrics.jsonl."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from polyrl.core.config import load
from polyrl.core.recipe import Config

EXAMPLES = Path(__file__).parents[2] / "examples"
PACKAGED = Path(__file__).parents[2] / "marl" / "recipes"  # the README's main demo
K = 4  # candidates per episode in the recipes


def curve(run_dir: Path) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]


def recipe(name: str, tmp_path: Path, models: Path, *overrides: str) -> Config:
    from polyrl.core.registry import load_plugins

    load_plugins()
    where = PACKAGED if (PACKAGED / name).is_file() else EXAMPLES
    return load(
        Config,
        where / name,
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            f"task.dir={tmp_path}/data",
            *overrides,
        ],
    )


def train_keep_session(cfg: Config, monkeypatch):
    """``polyrl.core.loop.train`` that also hands back the session (to inspect weights)."""
    from polyrl.core import loop
    from polyrl.core.runner.session import Session

    held = {}
    original = Session.open.__func__

    def open_and_keep(cls, cfg, **kw):
        held["s"] = original(cls, cfg, **kw)
        return held["s"]

    monkeypatch.setattr(Session, "open", classmethod(open_and_keep))
    t0, c0 = time.perf_counter(), time.process_time()
    run = loop.train(cfg)
    held["wall_s"], held["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    return run, held


def train_through_the_cli(tmp_path: Path, models: Path, seed: int, capsys):
    """``polyrl train signaling`` with the progress bar and TensorBoard on, then check that
    the run directory holds everything the README lists for command (1)."""
    from transformers import AutoModelForCausalLM

    from polyrl.core.runner.cli import main

    run_dir = tmp_path / "run"
    t0, c0 = time.perf_counter(), time.process_time()
    assert (
        main(
            [
                "train",
                "signaling",
                f"run.dir={run_dir}",
                f"task.dir={tmp_path}/data",
                f"seed={seed}",
                *pair(models),
            ]
        )
        == 0
    )
    held = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    out = capsys.readouterr().out
    assert f"run directory: {run_dir}" in out
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir())
    for panel in ("reward", "accuracy", "kl", "entropy", "length", "loss"):
        png = run_dir / "plots" / f"{panel}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no {panel} curve"
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert last.name == "step_000150" and (last / "COMPLETE").is_file()
    for agent in ("speaker", "listener"):
        AutoModelForCausalLM.from_pretrained(run_dir / "export" / agent)
    return run_dir, held


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Where the recipes build their tiny models (once per module)."""
    return tmp_path_factory.mktemp("signaling-models")


def pair(models: Path) -> list[str]:
    return [
        f"policies.speaker.model={models}/speaker",
        f"policies.listener.model={models}/listener",
    ]


@pytest.mark.slow
@pytest.mark.timeout(1200)
# CI runs seed 0 (README command (1) itself, then the swap); seeds 1 and 2 complete the
# 3-seed evidence under -m seeds
@pytest.mark.learning
@pytest.mark.parametrize(
    "seed", [0, pytest.param(1, marks=pytest.mark.seeds), pytest.param(2, marks=pytest.mark.seeds)]
)
def test_signaling_game_learns(seed, models, tmp_path, capsys):
    run_path, held = train_through_the_cli(tmp_path, models, seed, capsys)
    points = curve(run_path)
    print(
        f"\nseed {seed}: held-out success {points} "
        f"({held['wall_s']:.0f} s wall, {held['cpu_s']:.0f} s CPU)"
    )
    start, end = points[0][1], points[-1][1]
    assert start <= 0.4, f"success after the format warm start should be near 1/{K}: {start}"
    assert end >= 0.9, points
    assert any((run_path / "samples").iterdir())
    if seed != 0:
        return
    # Swap: the trained speaker with a fresh listener (format warm start only) is back near
    # chance -- the convention lives in the pair, not in either agent alone.
    from polyrl.core.runner.session import Session

    swap = recipe(
        "signaling_magrpo.yaml",
        tmp_path / "swap",
        models,
        f"seed={seed}",
        f"policies.speaker.model={run_path}/export/speaker",
        "policies.speaker.train=false",
        f"policies.listener.model={models}/listener",
        "train.steps=0",
    )
    s = Session.open(swap)  # SFT warms up the untrained listener only (the speaker is frozen)
    swapped = s.evaluate("swap")["swap/accuracy"]
    print(f"swap: trained speaker + untrained listener: {swapped:.3f} (1/K = {1 / K:.3f})")
    assert swapped <= 0.45


SHORT = ("train.steps=4", "sft.steps=4", "eval.every=0")  # the mechanics, in seconds
# Seeds for the variants' learning runs (minutes each): evidence under -m seeds. Seed 0 on
# the CI machine (avx512): shared 0.2 -> 1.0 by step 120 of 200; LoRA 0.3 -> 0.98 by 80 of 120.
VARIANT_SEEDS = [pytest.param(s, marks=pytest.mark.seeds) for s in (0, 1, 2)]


def _shared(tmp_path: Path, models: Path, *overrides: str) -> Config:
    return recipe(
        "signaling_shared.yaml",
        tmp_path,
        models,
        f"policies.main.model={models}/speaker",
        *overrides,
    )


def _lora(tmp_path: Path, models: Path, base: Path, *overrides: str) -> Config:
    return recipe(
        "signaling_lora.yaml",
        tmp_path,
        models,
        f"policies.speaker.model={base}",
        f"policies.listener.model={base}",
        *overrides,
    )


@pytest.mark.slow
def test_shared_policy_with_role_prompts_trains_one_model(models, tmp_path, monkeypatch):
    """Both roles' rows train the one model (4 steps); its learning run is the seeds test."""
    from safetensors.torch import load_file

    run, held = train_keep_session(_shared(tmp_path, models, *SHORT), monkeypatch)
    s = held["s"]
    assert list(s.policies) == ["main"] and s.trained == ["main"]
    before = load_file(str(models / "speaker" / "model.safetensors"))
    now = s.policies["main"].model.state_dict()
    assert any(not torch.equal(now[k], v) for k, v in before.items())


@pytest.mark.learning
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", VARIANT_SEEDS)
def test_shared_policy_with_role_prompts_learns(seed, models, tmp_path, monkeypatch):
    cfg = _shared(tmp_path, models, f"seed={seed}")
    run, held = train_keep_session(cfg, monkeypatch)
    points = curve(run.path)
    print(f"\nshared policy, seed {seed}: {points} ({held['cpu_s']:.0f} s CPU)")
    assert list(held["s"].policies) == ["main"]
    assert points[0][1] <= 0.4 and points[-1][1] >= 0.9, points


def _check_lora_pair(s, run_path: Path, base: Path) -> None:
    """One base in memory, two disjoint adapters; the base equals its file bitwise and the
    export holds the adapter only."""
    from safetensors.torch import load_file

    speaker, listener = s.policies["speaker"], s.policies["listener"]
    assert speaker.model is listener.model  # one base in memory, two adapters
    assert speaker.trainable_state().keys().isdisjoint(listener.trainable_state())
    on_disk = load_file(str(base / "model.safetensors"))
    compared = 0
    for name, value in speaker.base_state().items():
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if key in on_disk:
            assert torch.equal(value, on_disk[key]), f"base weight {name} changed"
            compared += 1
    assert compared == len(on_disk), (compared, len(on_disk))
    exported = sorted(p.name for p in (run_path / "export" / "speaker").iterdir())
    assert "adapter_config.json" in exported and "model.safetensors" not in exported


@pytest.mark.slow
def test_lora_adapters_on_a_shared_base_train_and_leave_the_base_alone(
    models, tmp_path, monkeypatch
):
    """4 steps: the adapters move, the base does not; the learning run is the seeds test.
    Its own base, pre-trained 4 steps instead of 400: the mechanics need no good base."""
    base = tmp_path / "short-base"
    short = [f"policies.{n}.build_args.pretrain_steps=4" for n in ("speaker", "listener")]
    cfg = _lora(tmp_path, models, base, *SHORT, *short)
    run, held = train_keep_session(cfg, monkeypatch)
    s = held["s"]
    _check_lora_pair(s, run.path, base)
    for name in ("speaker", "listener"):
        adapter = s.policies[name].trainable_state()
        assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k), name


@pytest.mark.learning
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", VARIANT_SEEDS)
def test_lora_adapters_on_a_shared_base_learn_and_leave_the_base_alone(
    seed, models, tmp_path, monkeypatch
):
    base = models / "lora-base"
    run, held = train_keep_session(_lora(tmp_path, models, base, f"seed={seed}"), monkeypatch)
    points = curve(run.path)
    print(
        f"\nLoRA per agent, seed {seed}: {points} ({held['wall_s']:.0f} s wall, "
        f"{held['cpu_s']:.0f} s CPU)"
    )
    _check_lora_pair(held["s"], run.path, base)
    assert points[0][1] <= 0.4 and points[-1][1] >= 0.9, points


@pytest.mark.slow
def test_frozen_speaker_stays_bitwise_unchanged(models, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    cfg = recipe(
        "signaling_magrpo.yaml",
        tmp_path,
        models,
        *pair(models),
        "policies.speaker.train=false",
        "train.steps=4",
        "sft.steps=4",
        "eval.every=0",
    )
    run, held = train_keep_session(cfg, monkeypatch)
    s = held["s"]
    assert s.trained == ["listener"]
    speaker = {k: v for k, v in s.policies["speaker"].model.state_dict().items()}
    on_disk = load_file(str(models / "speaker" / "model.safetensors"))
    for k, v in on_disk.items():
        assert torch.equal(speaker[k], v), f"frozen speaker weight {k} changed"
    listener_now = s.policies["listener"].model.state_dict()
    listener_disk = load_file(str(models / "listener" / "model.safetensors"))
    assert any(not torch.equal(listener_now[k], v) for k, v in listener_disk.items())


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.timeout(3600)
def test_signaling_game_learns_with_one_step_stale_rollouts(models, tmp_path, monkeypatch):
    """The async issue's bar: with max_staleness 1 the pair still reaches 0.9 (3 seeds)."""
    ends = []
    for seed in (0, 1, 2):
        cfg = recipe(
            "signaling_magrpo.yaml",
            tmp_path / f"seed{seed}",
            models,
            f"seed={seed}",
            "rollout.max_staleness=1",
            *pair(models),
        )
        run, held = train_keep_session(cfg, monkeypatch)
        points = curve(run.path)
        print(f"\nk=1 seed {seed}: held-out success {points} ({held['wall_s']:.0f} s wall)")
        ends.append(points[-1][1])
    assert min(ends) >= 0.9, ends
