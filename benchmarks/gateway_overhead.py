"""The agent gateway's cost against the in-process multi-turn workflow, same task.

Each episode is a 3-turn chat ("go on" after every reply) on a tiny Qwen2 with the real HF
engine. ``multi_turn``: an inline environment, ``schedule: episode`` (one engine call per
flush of waiting episodes). ``gateway``: the same conversation written as an ``openai``
client agent (async), over HTTP on 127.0.0.1. Also the per-request overhead: one episode
making sequential single requests, against calling the engine directly on the same prompts.

    .venv/bin/python benchmarks/gateway_overhead.py [--episodes 64] [--rollouts 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TURNS, TOKENS = 3, 8


async def chat_agent(row, ep):
    client = ep.async_openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    for _ in range(TURNS):
        r = await client.chat.completions.create(model="main", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "go on"},
        ]
    await client.close()
    return 1.0


SEQUENTIAL: list[float] = []


def sequential_agent(row, ep):
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    for _ in range(row["requests"]):
        t = time.perf_counter()
        client.chat.completions.create(model="main", messages=msgs, temperature=0)
        SEQUENTIAL.append(time.perf_counter() - t)
    return 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=30)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import polyrl.agents  # noqa: F401
    from polyrl.agents.env import Environment, StepResult, register_env
    from polyrl.agents.gateway import Gateway
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.data import PromptItem
    from polyrl.core.engine import HFEngine, SamplingParams
    from polyrl.core.policy import CausalLMPolicy, PolicyConfig
    from polyrl.core.tiny import tiny_qwen2
    from polyrl.core.workflow import Context

    @register_env("bench_go_on")
    class GoOn(Environment):
        def reset(self, task):
            self.t = 0
            return task["prompt"]

        def step(self, action):
            self.t += 1
            return StepResult("go on", 0.0, self.t >= TURNS, {})

    path = Path(tempfile.mkdtemp()) / "tiny"
    tiny_qwen2(path, corpus="gridworld", vocab_size=128, hidden_size=64, num_layers=2,
               num_heads=1, head_dim=64, intermediate_size=256, seed=0)  # fmt: skip
    policy = CausalLMPolicy(
        "main", PolicyConfig(model=str(path)), total_steps=1, need_reference=False
    )
    engine = HFEngine(policy, seed=0)
    ctx = Context(None, {"main": policy}, {"main": engine})
    workflows = {
        "multi_turn": MultiTurn(
            ctx,
            env="bench_go_on",
            mode="step",
            history=None,
            max_turns=TURNS,
            schedule="episode",
        ),  # fmt: skip
        "gateway": Gateway(ctx, agent=chat_agent, concurrency=args.episodes),
    }
    items = [
        PromptItem(uid=i, prompt_ids=[1], prompt_text="", answer=None, row={"prompt": f"g {i}"})
        for i in range(args.episodes)
    ]
    params = SamplingParams(n=1, max_new_tokens=TOKENS, temperature=1.0)
    times: dict[str, list[float]] = {k: [] for k in workflows}
    for _ in range(args.rollouts + 1):  # the first round warms up
        for name, wf in workflows.items():
            t = time.perf_counter()
            rec = wf.rollout(items, params)
            times[name].append(time.perf_counter() - t)
            assert rec.batch_size[0] == args.episodes * TURNS and bool(rec["valid"].all())
    for name in times:
        times[name] = times[name][1:]
    mt, gw = statistics.median(times["multi_turn"]), statistics.median(times["gateway"])
    print(f"{args.episodes} episodes x {TURNS} turns x {TOKENS} tokens, median of "
          f"{args.rollouts}: multi_turn {mt:.3f} s, gateway {gw:.3f} s "
          f"({100 * (gw / mt - 1):+.1f}%)")  # fmt: skip

    # per request: sequential single requests against direct engine calls, greedy
    seq = Gateway(ctx, agent=sequential_agent)
    row = {"prompt": "g 0", "requests": args.requests}
    seq.rollout([PromptItem(0, [1], "", None, row)], params)
    prompt = seq.server.chats["main"].first_prompt([{"role": "user", "content": "g 0"}])
    greedy = SamplingParams(n=1, max_new_tokens=TOKENS, temperature=0)
    direct = []
    for _ in range(args.requests):
        t = time.perf_counter()
        engine.generate([prompt], greedy)
        direct.append(time.perf_counter() - t)
    over = statistics.median(SEQUENTIAL) - statistics.median(direct)
    print(f"one request: gateway {1e3 * statistics.median(SEQUENTIAL):.1f} ms, engine "
          f"{1e3 * statistics.median(direct):.1f} ms, overhead {1e3 * over:.1f} ms")  # fmt: skip
    for wf in (workflows["gateway"], seq):
        wf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
