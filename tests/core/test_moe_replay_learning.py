"""Routing replay under an engine that routes differently from the trainer (issue 32).

The engine is :mod:`tests/helpers/perturbed_engine.py` with ``route_noise``: the HF engine on
the tiny Qwen3-MoE, whose routers pick their top-k experts from noisy logits while sampling
(greedy evaluation is unperturbed). Some tokens then go to other experts than the trainer's
router would choose, so the trainer's log-probs drift from the engine's: the MoE failure
mode. The engine's capture records the experts it really used; ``moe.replay: rollout`` has
the trainer route every token to them.

First the engine (fast): the experts it records are the ones it used, checked by a
hand-built forward that routes each token as recorded and reproduces the engine's
log-probs, and they differ from the clean router's choice on a share of tokens. Then
learning (slow): one SFT warm start, then GRPO with replay off and on (rollout correction
off in both, so replay alone acts): routing mismatch, engine-trainer log-prob gap and
held-out accuracy. One seed in CI; three under -m seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polyrl.core.config import load
from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.loop import train
from polyrl.core.recipe import Config
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig
from tests.helpers.moe import replayed
from tests.helpers.trainer import chat_ids

RECIPE = Path(__file__).parents[2] / "core" / "recipes" / "arithmetic_grpo.yaml"
ENGINE = f"{Path(__file__).parents[1] / 'helpers' / 'perturbed_engine.py'}:PerturbedEngine"
ROUTE_NOISE = 0.5
K = 2  # the model's top-k
# the demo's model: the dense demo's width (hidden 128, 2 heads) as 4 experts, top-2
MOE = dict(hidden_size=128, num_heads=2, moe_intermediate_size=128, num_experts=4)
QUIET = ["run.progress=false", "run.tensorboard=false", "run.save_every=0"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-moe-arith"
    return str(tiny_qwen3_moe(path, experts_per_token=K, **MOE))


@pytest.mark.parametrize("noise", [0.0, ROUTE_NOISE])
def test_engine_records_the_experts_it_routed_to(moe_dir, noise):
    policy = CausalLMPolicy(
        "main", PolicyConfig(model=moe_dir), total_steps=1, need_reference=False
    )
    ids = chat_ids(policy.tokenizer, ("12+7=", "3+4=", "25+30=", "8+19="))
    engine = ENGINES.get(ENGINE)(policy, seed=3, route_noise=noise)
    outs = engine.generate(ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=6))
    worst, differs, tokens = 0.0, 0, 0
    for o in outs:
        experts = (o.prompt + o.tokens).experts  # prompt then response
        prompt, fed = ids[o.prompt_index], o.token_ids[:-1]  # the last token is never fed
        seq = prompt + fed
        assert experts is not None and experts.shape == (len(prompt) + len(o.token_ids), 2, K)
        assert bool((experts[len(seq) :] == -1).all())
        logp, own = replayed(policy.model, seq + o.token_ids[-1:], experts)
        steps = torch.arange(len(prompt) - 1, len(seq))
        want = logp[steps, torch.tensor(o.token_ids)]
        worst = max(
            worst, float((torch.tensor(o.logprobs, dtype=torch.float64) - want).abs().max())
        )
        recorded = experts[: len(seq)].long().sort(-1).values
        d = (own[: len(seq)].sort(-1).values != recorded).any(-1).any(-1)
        differs, tokens = differs + int(d.sum()), tokens + len(seq)
    # the engine sampled from the routing it recorded: a forward routed so gives its log-probs
    assert worst < 1e-4, f"max |engine - replayed by hand| = {worst:.2e}"
    if noise == 0:
        assert differs == 0  # unperturbed, the engine routes as the trainer's router
    else:  # tokens went elsewhere (not every one: the untrained router's logits are tiny)
        assert 0 < differs < tokens, (differs, tokens)


# --- learning ---------------------------------------------------------------------------

PERTURBED = [
    f"policies.main.engine.name={ENGINE}",
    f"policies.main.engine.args={{route_noise: {ROUTE_NOISE}}}",
    "algorithm.rollout_correction.level='off'",  # quoted: YAML reads a bare off as false
]
MODES = {"replay off": [], "replay on": ["policies.main.moe.replay=rollout"]}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _warm_start(model: str, root: Path, seed: int) -> str:
    """The demo's SFT warm start alone, exported: both modes of a seed start from it."""
    run_dir = root / f"sft-seed{seed}"
    cfg = load(
        Config,
        RECIPE,
        [f"seed={seed}", f"run.dir={run_dir}", "train.steps=0", "eval.every=0", *QUIET]
        + [f"policies.main.model={model}", "policies.main.build=null"]
        + ["policies.main.build_args=null"],
    )
    train(cfg)
    return str(run_dir / "export" / "main")


def _grpo(model: str, root: Path, seed: int, name: str, steps: int) -> dict:
    """GRPO from ``model`` under the routing-perturbed engine: held-out accuracy before,
    at the end and over the last three evaluations, and the mean per step of the routing
    mismatch share and the engine-trainer log-prob gap."""
    run_dir = root / f"{name.replace(' ', '-')}-seed{seed}"
    every = steps // 4
    cfg = load(
        Config,
        RECIPE,
        [f"seed={seed}", f"run.dir={run_dir}", "run.export=false", "sft.steps=0"]
        + [f"train.steps={steps}", f"eval.every={every}", *QUIET]
        + [f"policies.main.model={model}", "policies.main.build=null"]
        + ["policies.main.build_args=null", *PERTURBED, *MODES[name]],
    )
    train(cfg)
    rows = _metrics(run_dir)
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    steps_ = [r for r in rows if "reward/mean" in r]

    def mean(key: str) -> float:
        return sum(r[key] for r in steps_) / len(steps_)

    out = {
        "before": evals[0],
        "after": evals[-1],
        "late": sum(evals[-3:]) / 3,
        "route_mismatch": mean("main/moe/route_mismatch"),
        "gap": mean("main/mismatch/logp_abs_mean"),
        "kl": mean("main/mismatch/kl_engine_trainer"),
        "steps": steps_,
    }
    print(
        f"seed {seed} {name:>10}: route mismatch {out['route_mismatch']:.3f}, |log-prob gap| "
        f"{out['gap']:.4f} (KL {out['kl']:.2e}); held-out accuracy {out['before']:.3f} -> "
        f"{out['after']:.3f} (last 3 evals {out['late']:.3f})"
    )
    return out


def _check(runs: dict) -> None:
    """Both modes see the same engine: the same share of tokens routed differently by
    engine and trainer (the trainer's own choice is measured before replay); replay cuts
    the log-prob gap to a fraction of replay off's."""
    off, on = runs["replay off"], runs["replay on"]
    for run in (off, on):
        assert 0.1 < run["route_mismatch"] < 0.9, run["route_mismatch"]
    assert on["gap"] < 0.25 * off["gap"], (on["gap"], off["gap"])


# The tiny MoE's plateau under the perturbed engine: runs that start near it end at
# 0.60-0.70 held-out accuracy, and 60 GRPO steps do not lift a start of 0.70 further.
PLATEAU = 0.6


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_replay_closes_the_gap_and_learns(moe_dir, tmp_path):
    """Seed 0, held-out accuracy before -> mean of the last 3 evaluations, replay off / on.
    Where the SFT warm start lands depends on the machine's kernels (ATEN_CPU_CAPABILITY
    and CPU): AMD EPYC avx2 0.520 -> 0.690 / 0.700, default 0.595 -> 0.682 / 0.688, avx512
    0.535 -> 0.602 (one mode); the CI machine (avx512) 0.700 -> 0.657 / 0.658; an Intel
    Xeon: avx512 0.260 -> 0.357 / 0.388, avx2 0.430 -> 0.568 / 0.567, default 0.560 ->
    0.612 / 0.625. GRPO lifts every start below the plateau (gains 0.052-0.17) and holds a
    start already on it. So the bar: a gain of 0.03, or, from a
    start at or above the plateau (0.6), staying on it. Replay on and off end within 0.031
    of each other everywhere (bar 0.06); the gap check is exact."""
    model = _warm_start(moe_dir, tmp_path, seed=0)
    runs = {name: _grpo(model, tmp_path, 0, name, steps=60) for name in MODES}
    _check(runs)
    for run in runs.values():  # the MoE demo learns (or holds its plateau) under either mode
        assert run["late"] >= min(run["before"] + 0.03, PLATEAU), run
    assert runs["replay on"]["late"] >= runs["replay off"]["late"] - 0.06


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.timeout(7200)
def test_replay_three_seeds(moe_dir, tmp_path):
    every: list[dict] = []
    for seed in (0, 1, 2):
        model = _warm_start(moe_dir, tmp_path, seed)
        every.append({name: _grpo(model, tmp_path, seed, name, steps=100) for name in MODES})
    mean = {n: sum(r[n]["late"] for r in every) / len(every) for n in MODES}
    print("held-out accuracy (last 3 evaluations) per seed, and mean:")
    for n in MODES:
        print(
            f"  {n:>10}: "
            + " ".join(f"{r[n]['late']:.3f}" for r in every)
            + f"  mean {mean[n]:.3f}"
        )
    for runs in every:
        _check(runs)
    assert mean["replay on"] >= mean["replay off"]
