"""The mixed paint team (issue 40): its step time by member, against the three members'
own trainings run one after another on the same work.

Contender **team**: RL steps of ``examples/paint_team.yaml`` (workflow ``paint_team``: a tiny
Qwen2 writer, a tiny SD3 painter with LoRA, a tiny Qwen2.5-VL judge), small:
``--prompts`` goals x ``--n`` writer prompts x ``--images`` pictures x ``--judge-n`` answers.
Contenders **writer alone**, **painter alone**, **judge alone**: the same work through
each plugin's own workflow, same models (the same built directories), same sizes and
options as the team's members:

- writer alone: ``single_turn`` text GRPO on the writer's prompts (the team's goals with
  its role as the system message, chat-templated as the team renders them), ``--prompts``
  x ``--n`` rows of one new token (the writer agent's ``max_new_tokens``), reward
  ``exact_match`` against the goal;
- painter alone: ``text_to_image`` (diffusion plugin) on ``--prompts`` x ``--n`` one-word
  colour prompts (the team's prompts are the writer's one-token words) x ``--images``
  pictures each, the recipe's sampler (flow_sde, 10 steps, SDE window of 3, 16x16), LoRA
  and clip range, per-prompt groups, reward ``colour`` + ``colour_accuracy``;
- judge alone: ``vl_single_turn`` (multimodal plugin) on as many pictures as the team's
  painter makes in a step, painted once at start-up by the same painter model (16x16
  PNGs), each with the team's question and role, ``--judge-n`` answers of up to 2 tokens,
  reward ``exact_match``.

Every contender is a :class:`~polyrl.core.runner.session.Session` opened from its recipe
(written under the benchmark's folder), and a step is what ``core/loop.py`` runs:
``rollouts.next`` -> ``score`` -> ``credit.assign`` -> ``learn`` -> per policy
``update_group`` + ``publish`` -> ``rollout_stats`` + ``Throughput.step`` (no logging,
evaluation or checkpoints). Both sides run with ``algorithm.skip_zero_advantage: false`` so
that every sampled row is trained whatever its reward (the team's rewards and the
standalone ones differ, and a skipped row would make the work differ); no SFT warm start
(untrained models: the timing does not depend on the weights), no evaluation.

What is timed, in the worker: the step (``time/step_s``'s span); each member's sampling
(its engine's ``generate``, or the painter's ``sample`` + ``decode``, timed around the
engine's own methods: the ``paint`` call of the team goes through them too); each member's
update (``Session.update_group`` + ``publish``: the loop does not log a policy's update
seconds). The team's own ``marl/generate_s`` and ``marl/rollout_s`` are reported beside
them. Each contender runs in its own fresh process with the same torch threads; every
round runs the team step and the three standalone steps (writer, painter, judge, one after
another), the team first in even rounds and last in odd ones; warm-up rounds are dropped and
medians of the timed rounds are printed, with the ratio team step / (writer + painter +
judge standalone steps) of each round.

    .venv/bin/python benchmarks/paint_team.py [--quick] [--steps N] [--warmup N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
from _runner import Remote  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "paint_team.yaml"
MEMBERS = ("writer", "painter", "judge")
TEAM = "team"
MODELS = c.CACHE / "paint_team"  # the three models, built once by the recipe's builders
ALONE = {m: f"{m} alone" for m in MEMBERS}


# ------------------------------------------------------------------------------ recipes


def slug(name: str) -> str:
    return name.replace(" ", "_")


def _plain_policy(doc: dict, name: str) -> dict:
    """The example's policy ``name``, its model built under ``MODELS`` (an untrained painter:
    ``pretrain_steps: 0``; the weights do not change the work)."""
    p = json.loads(json.dumps(doc["policies"][name]))
    p["model"] = str(MODELS / name)
    if name == "painter":
        p["build_args"]["pretrain_steps"] = 0
    return p


def recipes(root: Path, plan: dict) -> dict[str, Path]:
    """The four recipes (team and each member alone), written under ``root``."""
    from polyrl.marl import paint_team as pt

    doc = yaml.safe_load(EXAMPLE.read_text())
    P, n, images, judge_n = plan["prompts"], plan["n"], plan["images"], plan["judge_n"]
    run = {
        "progress": False,
        "tensorboard": False,
        "export": False,
        "save_every": 0,
        "samples_per_step": 0,
    }
    common = {
        "seed": 0,
        "eval": {"every": 0},
        "sft": {"steps": 0},
        "train": {"steps": 1000},
    }
    goals = [json.loads(x) for x in (root / "data" / "train.jsonl").read_text().splitlines()]
    team = json.loads(json.dumps(doc))
    team.update(common)
    team["run"] = dict(run, dir=str(root / "runs" / "team"))
    team.pop("task", None)  # the goals written once (prepare), read by every contender
    team["policies"] = {m: _plain_policy(doc, m) for m in MEMBERS}
    team["data"] = dict(team["data"], path=str(root / "data" / "train.jsonl"), shuffle=False)
    team["eval"] = {"every": 0, "data": {"path": str(root / "data" / "eval.jsonl")}}
    team["rollout"].update(prompts_per_step=P, n=n)
    team["rollout"]["args"].update(images=images, judge_n=judge_n)
    team["algorithm"] = dict(team["algorithm"], skip_zero_advantage=False)
    agents = {a["name"]: a for a in doc["rollout"]["args"]["agents"]}
    temp = doc["rollout"]["temperature"]

    def alone(member: str, rows: list[dict], extra: dict) -> dict:
        path = root / "data" / f"{member}_alone.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = dict(
            common,
            run=dict(run, dir=str(root / "runs" / f"{member}_alone")),
            policies={member: _plain_policy(doc, member)},
            data={"path": str(path), "shuffle": False, "max_prompt_tokens": 64},
            eval={"every": 0, "data": {"path": str(path)}},
        )
        return {**out, **extra}

    writer_rows = [
        {
            "prompt": [
                {"role": "system", "content": pt.WRITER_ROLE},
                {"role": "user", "content": g["prompt"]},
            ],
            "answer": g["answer"],
        }
        for g in goals
    ]
    # the painter alone: one prompt per writer prompt of the team (P x n a step), a colour
    painter_rows = [{"prompt": g["answer"], "answer": g["answer"]} for g in goals for _ in range(n)]
    painter_loss = agents["painter"].get("loss", {})
    judge_rows = [
        {
            "prompt": [
                {"role": "system", "content": pt.JUDGE_ROLE},
                {"role": "user", "content": "<image>" + pt.QUESTION},
            ],
            "images": [pic],
            "answer": colour,
        }
        for pic, colour in pictures(root, goals, plan)
    ]
    docs = {
        TEAM: team,
        ALONE["writer"]: alone(
            "writer",
            writer_rows,
            {
                "rollout": {
                    "workflow": "single_turn",
                    "n": n,
                    "prompts_per_step": P,
                    "max_new_tokens": agents["writer"]["max_new_tokens"],
                    "temperature": temp,
                },
                "reward": {"terms": [{"name": "exact_match"}]},
                "algorithm": {
                    "advantage": "grpo",
                    "policy_loss": "ppo_clip",
                    "skip_zero_advantage": False,
                },
            },
        ),
        ALONE["painter"]: alone(
            "painter",
            painter_rows,
            {
                "rollout": {
                    "workflow": "text_to_image",
                    "n": images,
                    "prompts_per_step": P * n,
                    "temperature": temp,
                },
                "reward": {
                    "terms": [
                        {"name": "colour_accuracy", "weight": 1.0},
                        {"name": "colour", "weight": 0.5},
                    ]
                },
                "algorithm": {
                    "credit": "per_prompt",
                    "policy_loss": "ppo_clip",
                    "skip_zero_advantage": False,
                    **painter_loss,
                },
            },
        ),
        ALONE["judge"]: alone(
            "judge",
            judge_rows,
            {
                "rollout": {
                    "workflow": "vl_single_turn",
                    "n": judge_n,
                    "prompts_per_step": P * n * images,
                    "max_new_tokens": agents["judge"]["max_new_tokens"],
                    "temperature": temp,
                },
                "reward": {"terms": [{"name": "exact_match"}]},
                "algorithm": {
                    "advantage": "grpo",
                    "policy_loss": "ppo_clip",
                    "skip_zero_advantage": False,
                },
            },
        ),
    }
    docs[ALONE["judge"]]["data"]["kind"] = "vl"
    docs[ALONE["judge"]]["eval"]["data"]["kind"] = "vl"
    out = {}
    for name, d in docs.items():
        path = root / f"{slug(name)}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        out[name] = path
    return out


def pictures(root: Path, goals: list[dict], plan: dict) -> list[tuple[str, str]]:
    """The judge's pictures: the painter model's own (its recipe's sampler and size), of
    each goal's colour, ``P x n x images`` a step for as many steps as the goals last;
    written once as PNGs. Returns (path, colour) pairs."""
    out_dir = root / "pictures"
    count = len(goals) * plan["n"] * plan["images"]
    index = out_dir / "index.json"
    if index.is_file():
        got = json.loads(index.read_text())
        if len(got) == count:
            return [tuple(x) for x in got]
    import torch

    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.rollout.paint import ImageRequest
    from polyrl.core.runner.builds import ensure_model
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.diffusion.engine import DiffusionEngine, sampling_options
    from polyrl.diffusion.policy import DiffusionPolicy
    from polyrl.marl.api import Message  # the team shows the judge Message.to_pil()

    doc = yaml.safe_load(EXAMPLE.read_text())
    raw = _plain_policy(doc, "painter")
    raw.pop("build"), raw.pop("build_args")
    p = doc["policies"]["painter"]
    build_args = dict(p["build_args"], pretrain_steps=0)
    raw["model"] = ensure_model(raw["model"], p["build"], build_args)
    cfg = from_dict(PolicyConfig, raw)
    torch.manual_seed(0)
    policy = DiffusionPolicy("painter", cfg, total_steps=1, need_reference=False, device="cpu")
    engine = DiffusionEngine(policy, seed=0, **sampling_options(cfg))
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = [g["answer"] for g in goals for _ in range(plan["n"])]
    got = []
    for k in range(0, len(colours), 16):
        batch = colours[k : k + 16]
        painted = engine.paint([ImageRequest(col, n=plan["images"]) for col in batch])
        for col, pics in zip(batch, painted, strict=True):
            for pic in pics:
                path = out_dir / f"{len(got):05d}.png"
                Message.to_pil(SimpleNamespace(painting=pic, agent="painter")).save(path)
                got.append((str(path), col))
    index.write_text(json.dumps(got))
    return got


# ------------------------------------------------------------------------------ a contender


class Stepper:
    """A session opened from a recipe, stepped as core/loop.py steps it, with each
    member's sampling timed around its engine's methods and its update around
    ``update_group`` + ``publish``."""

    def __init__(self, recipe: str) -> None:
        import polyrl.diffusion  # noqa: F401
        import polyrl.marl  # noqa: F401
        import polyrl.multimodal  # noqa: F401
        from polyrl.core.config import load
        from polyrl.core.observe.throughput import Throughput
        from polyrl.core.recipe import Config
        from polyrl.core.rollout.paint import paints_images
        from polyrl.core.runner.session import Session

        t0 = time.perf_counter()
        self.cfg = load(Config, recipe, [])
        self.s = Session.open(self.cfg)
        self.perf = Throughput(self.s.policies, self.cfg.algorithm)
        self.sample_s: dict[str, float] = {}
        for name, engine in self.s.engines.items():
            # a painter: sample + decode (what paint() and text_to_image call); a text or VL
            # engine: generate (its own decode loop runs inside it)
            for method in ("sample", "decode") if paints_images(engine) else ("generate",):
                self._time(engine, method, name)
        self.step_no = 0
        self.info = {"setup_s": time.perf_counter() - t0, "workflow": self.cfg.rollout.workflow}

    def _time(self, engine, method: str, name: str) -> None:
        inner = getattr(engine, method)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sample_s[name] = self.sample_s.get(name, 0.0) + time.perf_counter() - t0

        setattr(engine, method, timed)

    def step(self) -> dict:
        from polyrl.core.record import strings, valid_rows
        from polyrl.core.train.credit import assign

        s, cfg = self.s, self.cfg
        self.step_no += 1
        step = self.step_no
        self.sample_s = {}
        update_s: dict[str, float] = {}
        t0 = time.perf_counter()
        record, own = s.rollouts.next(step)
        t_roll = time.perf_counter() - t0
        t1 = time.perf_counter()
        metrics = s.score(record)
        metrics |= assign(record, cfg.algorithm)
        metrics |= s.learn(record)
        t_credit = time.perf_counter() - t1
        valid = valid_rows(record)
        for names in s.update_groups():
            t1 = time.perf_counter()
            s.update_group(names, valid)
            for name in names:
                s.rollouts.publish(name, step)
            update_s |= dict.fromkeys(names, (time.perf_counter() - t1) / len(names))
        step_s = time.perf_counter() - t0
        metrics |= s.rollout_stats(record, own) | {"time/step_s": step_s}
        metrics |= self.perf.step(record, step_s, update_s)
        policy = strings(record, "policy")
        resp = record["response_mask"].sum(-1)
        prompt = record["prompt_mask"].sum(-1) if "prompt_mask" in record.keys() else None  # noqa: SIM118
        rows, tokens = {}, {}
        for name in s.policies:
            mine = [i for i, p in enumerate(policy) if p == name]
            rows[name] = len(mine)
            tokens[name] = {
                "response": int(resp[mine].sum()),
                "prompt": int(prompt[mine].sum()) if prompt is not None else 0,
            }
        keep = ("marl/generate_s", "marl/rollout_s", "marl/paintings", "rollout/valid_frac")
        return {
            "step_s": step_s,
            "rollout_s": t_roll,
            "reward_credit_s": t_credit,
            "sample_s": dict(self.sample_s),
            "update_s": update_s,
            "rows": rows,
            "tokens": tokens,
            **{k: metrics[k] for k in keep if k in metrics},
        }

    def close(self) -> None:
        self.s.backend.shutdown()
        self.s.run.close()


# ------------------------------------------------------------------------------ runner


def prepare(root: Path, plan: dict, rounds: int) -> dict[str, Path]:
    """Models (built once, the recipe's builders), the goals and the four recipes."""
    import polyrl.diffusion  # noqa: F401
    import polyrl.marl  # noqa: F401
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.runner.builds import ensure_model
    from polyrl.marl import paint_team as pt

    doc = yaml.safe_load(EXAMPLE.read_text())
    for m in MEMBERS:
        p = _plain_policy(doc, m)
        ensure_model(p["model"], p["build"], p["build_args"])
    # enough goals for every round (the samplers do not wrap around mid-run)
    pt.write_dataset(root / "data", seed=0, n_train=64, per_colour_eval=1)
    goals = (root / "data" / "train.jsonl").read_text().splitlines()
    need = plan["prompts"] * rounds
    if need > len(goals):
        raise SystemExit(f"{rounds} rounds need {need} goals; the task wrote {len(goals)}")
    (root / "data" / "train.jsonl").write_text("\n".join(goals[:need]) + "\n")
    return recipes(root, plan)


def run_rounds(paths: dict[str, Path], threads: int, total: int, warmup: int) -> dict:
    env = {"MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    workers = {
        name: Remote(name, "paint_team", {"recipe": str(path)}, threads=threads, env=env)
        for name, path in paths.items()
    }
    try:
        for w in workers.values():
            w.wait_ready()
            if w.error:
                raise RuntimeError(f"{w.name} failed to start: {w.error}")
        out: dict[str, list[dict]] = {n: [] for n in workers}
        alone = [ALONE[m] for m in MEMBERS]
        for rnd in range(total):
            order = [TEAM, *alone] if rnd % 2 == 0 else [*alone, TEAM]
            for n in order:
                res = workers[n].step()
                if res is None:
                    raise RuntimeError(f"{n} failed at round {rnd + 1}: {workers[n].error}")
                out[n].append(res)
            team = out[TEAM][-1]["step_s"]
            each = [out[a][-1]["step_s"] for a in alone]
            solo = sum(each)
            print(
                f"  round {rnd + 1}/{total} {'(warm-up)' if rnd < warmup else ''} "
                f"team {team:.2f}s, alone {solo:.2f}s "
                "(" + " + ".join(f"{x:.2f}" for x in each) + ")",
                file=sys.stderr,
                flush=True,
            )
        return {"info": {n: w.info for n, w in workers.items()}, "steps": out}
    finally:
        for w in workers.values():
            w.close()


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(steps: dict[str, list[dict]], warmup: int) -> dict:
    timed = {n: s[warmup:] for n, s in steps.items()}
    team = timed[TEAM]
    rows, out = [], {"members": {}}
    for m in MEMBERS:
        solo = timed[ALONE[m]]
        fig = {
            "team_sample_s": _med([r["sample_s"].get(m, 0.0) for r in team]),
            "alone_sample_s": _med([r["sample_s"].get(m, 0.0) for r in solo]),
            "team_update_s": _med([r["update_s"].get(m, 0.0) for r in team]),
            "alone_update_s": _med([r["update_s"].get(m, 0.0) for r in solo]),
            "alone_step_s": _med([r["step_s"] for r in solo]),
            "team_rows": team[-1]["rows"][m],
            "alone_rows": solo[-1]["rows"][m],
            "team_tokens": team[-1]["tokens"][m],
            "alone_tokens": solo[-1]["tokens"][m],
        }
        fig["team_s"] = fig["team_sample_s"] + fig["team_update_s"]
        fig["alone_s"] = fig["alone_sample_s"] + fig["alone_update_s"]
        out["members"][m] = fig
        rows.append(
            [
                m,
                f"{fig['team_rows']} / {fig['alone_rows']}",
                fig["team_sample_s"],
                fig["alone_sample_s"],
                fig["team_update_s"],
                fig["alone_update_s"],
                fig["team_s"],
                fig["alone_s"],
                f"{fig['team_s'] / fig['alone_s']:.2f}" if fig["alone_s"] else "n/a",
            ]
        )

    def beyond(r: dict) -> float:  # the rollout's own work beyond the engines' calls
        return r["rollout_s"] - sum(r["sample_s"].values())

    def rest(r: dict) -> float:  # the step beyond sampling and updates
        return r["step_s"] - sum(r["sample_s"].values()) - sum(r["update_s"].values())

    rounds = range(len(team))
    solo_sums = [sum(timed[ALONE[m]][k]["step_s"] for m in MEMBERS) for k in rounds]
    parts = {}
    for label, fn in (
        ("rollout beyond sampling", beyond),
        ("rewards + credit", lambda r: r["reward_credit_s"]),
        ("rest of the step", rest),
    ):
        mine = _med([fn(r) for r in team])
        solo = _med([sum(fn(timed[ALONE[m]][k]) for m in MEMBERS) for k in rounds])
        parts[label] = {"team_s": mine, "alone_s": solo}
        rows.append([label, "", "", "", "", "", mine, solo, f"{mine / solo:.2f}" if solo else ""])
    rest_team, rest_solo = parts["rest of the step"]["team_s"], parts["rest of the step"]["alone_s"]
    team_step = _med([r["step_s"] for r in team])
    solo_step = _med(solo_sums)
    per_round = [r["step_s"] / s for r, s in zip(team, solo_sums, strict=True)]
    rows.append(
        [
            "step",
            "",
            "",
            "",
            "",
            "",
            team_step,
            solo_step,
            f"{_med(per_round):.2f}",
        ]
    )
    print(
        c.table(
            [
                "member",
                "rows team / alone",
                "team sample s",
                "alone sample s",
                "team update s",
                "alone update s",
                "team s",
                "alone s",
                "team / alone",
            ],
            rows,
        )
    )
    gen = _med([r.get("marl/generate_s", float("nan")) for r in team])
    roll = _med([r.get("marl/rollout_s", float("nan")) for r in team])
    print(
        f"\nteam's own metrics: marl/generate_s {gen:.3f} (the engines' calls), "
        f"marl/rollout_s {roll:.3f} (the whole rollout); standalone steps per member: "
        + ", ".join(f"{m} {out['members'][m]['alone_step_s']:.3f}" for m in MEMBERS)
    )
    for m in MEMBERS:
        f = out["members"][m]
        print(f"  {m}: tokens team {f['team_tokens']} / alone {f['alone_tokens']}")
    print(
        f"\nRatio (this run): team step / (writer + painter + judge alone) = "
        f"{team_step:.3f} / {solo_step:.3f} = {team_step / solo_step:.2f} "
        f"(median of the per-round ratios {_med(per_round):.2f})"
    )
    out |= {
        "team_step_s": team_step,
        "alone_sum_s": solo_step,
        "ratio": team_step / solo_step,
        "ratio_per_round_median": _med(per_round),
        "rest_team_s": rest_team,
        "rest_alone_s": rest_solo,
        "parts": parts,
        "marl_generate_s": gen,
        "marl_rollout_s": roll,
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.common_args(p)
    p.add_argument("--prompts", type=int, default=4, help="goals per step (prompts_per_step)")
    p.add_argument("--n", type=int, default=4, help="writer prompts per goal (rollout.n)")
    p.add_argument("--images", type=int, default=4, help="pictures per writer prompt")
    p.add_argument("--judge-n", type=int, default=2, help="judge answers per picture")
    p.add_argument("--dir", default=None, help="data, pictures, runs (default: a temp dir)")
    args = p.parse_args()
    if args.device != "cpu" or args.in_process:
        p.error("paint_team.py runs on CPU, one process per contender")
    threads, why = c.resolve_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps or (2 if args.quick else 8)
    plan = {"prompts": args.prompts, "n": args.n, "images": args.images, "judge_n": args.judge_n}
    pics = args.prompts * args.n * args.images
    print(
        f"paint_team: a step of {args.prompts} goals x {args.n} writer prompts x "
        f"{args.images} pictures ({pics}) x {args.judge_n} judge answers ({pics * args.judge_n}); "
        f"{warmup} warm-up + {steps} timed rounds, each: the team step and the three "
        "standalone steps, interleaved\n"
    )
    info = c.print_machine(threads, why)
    keep = args.dir is not None
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-paint-team-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths = prepare(root, plan, warmup + steps)
    print(
        f"  models in {MODELS}; data, pictures and recipes in {root} ({time.perf_counter() - t0:.1f} s)"
    )
    got = run_rounds(paths, threads, warmup + steps, warmup)
    print()
    summary = report(got["steps"], warmup)
    if hasattr(os, "getloadavg"):
        print(f"1-min load at the end: {os.getloadavg()[0]:.2f}")
    c.write_json(
        args.json,
        {"machine": info, "plan": plan, "warmup": warmup, "steps": steps, **got, **summary},
    )
    if not keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
