"""Multi-turn rollouts per second, lock-step rounds against per-episode scheduling
(``rollout.args.schedule: round | episode`` of the ``multi_turn`` workflow).

Episodes of 1 to 8 turns (drawn per episode) against an async environment whose every step
waits a random time (an exponential draw, as a tool call, a sandbox run or a web request
would; the wait holds no core), with the real HF engine on a tiny Qwen2. The mean wait is
calibrated to the engine's time for one call over every episode, so generating and
stepping cost about the same. ``round``: every turn round waits for its slowest step, then
one engine call serves all active episodes. ``episode``: an episode goes back to the engine
as soon as its own step is done; the engine, on its own thread, serves whatever waits.

    .venv/bin/python benchmarks/multi_turn_overlap.py [--episodes 32] [--rollouts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


class Latency:
    mean_s = 0.0


def _register() -> None:
    from polyrl.agents.env import Environment, StepResult, register_env

    @register_env("bench_tool_latency")
    class ToolLatencyEnv(Environment):
        def reset(self, task):
            self.turns, self.t = task["turns"], 0
            self.rng = random.Random(task["seed"])
            return task["prompt"]

        async def step(self, action):
            await asyncio.sleep(self.rng.expovariate(1.0 / Latency.mean_s) if Latency.mean_s else 0)
            self.t += 1
            done = self.t >= self.turns
            return StepResult(f"result {self.t}", float(done), done, {"success": done})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32, help="episodes per rollout")
    ap.add_argument("--rollouts", type=int, default=5, help="timed rollouts per schedule")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    import polyrl.agents  # noqa: F401  (registers the gridworld corpus)
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.demo.tiny import tiny_qwen2
    from polyrl.core.rollout.data import PromptItem
    from polyrl.core.rollout.engine import HFEngine, SamplingParams
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    _register()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tiny-grid"
        tiny_qwen2(path, corpus="gridworld", vocab_size=128, hidden_size=64, num_layers=2,
                   num_heads=1, head_dim=64, intermediate_size=256, seed=0)  # fmt: skip
        policy = CausalLMPolicy(
            "main", PolicyConfig(model=str(path)), total_steps=1, need_reference=False
        )
        engine = HFEngine(policy, seed=0)
        params = SamplingParams(n=1, max_new_tokens=args.max_new_tokens)

        def items(r: int) -> list[PromptItem]:
            rng = random.Random(r)
            return [
                PromptItem(
                    uid=i,
                    prompt_ids=[1],
                    prompt_text="go",
                    answer=None,
                    row={"prompt": "go", "turns": rng.randint(1, 8), "seed": 1000 * r + i},
                )
                for i in range(args.episodes)
            ]

        def workflow(schedule: str) -> MultiTurn:
            return MultiTurn(
                Context(None, {"main": policy}, {"main": engine}),
                env="bench_tool_latency",
                max_turns=8,
                schedule=schedule,
            )

        # calibration: the engine's time for one call over every episode
        prompts = [[1] * 24 for _ in range(args.episodes)]
        engine.generate(prompts, params)
        t0 = time.perf_counter()
        for _ in range(3):
            engine.generate(prompts, params)
        Latency.mean_s = (time.perf_counter() - t0) / 3
        print(
            f"torch threads 1; {args.episodes} episodes of 1-8 turns per rollout; "
            f"mean step wait {Latency.mean_s:.3f} s (= one engine call over all episodes)"
        )
        times: dict[str, list[float]] = {"round": [], "episode": []}
        calls: dict[str, list[int]] = {"round": [], "episode": []}
        workflow("round").rollout(items(99), params)  # warm-up
        for r in range(args.rollouts):
            order = ("round", "episode") if r % 2 == 0 else ("episode", "round")
            for schedule in order:  # alternated: machine load hits both alike
                wf = workflow(schedule)
                t0 = time.perf_counter()
                rec = wf.rollout(items(r), params)
                times[schedule].append(time.perf_counter() - t0)
                calls[schedule].append(wf.generate_calls)
                assert rec.batch_size[0] == args.episodes
        for schedule in ("round", "episode"):
            print(
                f"    {schedule:7s}: {statistics.median(times[schedule]):.3f} s per rollout, "
                f"{statistics.median(calls[schedule]):.0f} engine calls"
            )
        ratio = statistics.median(times["round"]) / statistics.median(times["episode"])
        print(f"    per-episode / lock-step speed: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
