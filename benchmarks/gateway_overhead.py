"""The agent gateway's cost against the in-process multi-turn workflow, same task.

Each episode is a 3-turn chat ("go on" after every reply) on a Qwen2 built offline (random
weights, ``--model``: ``tiny`` is the 0.1M test shape, ``20M`` the shape grpo_vs_trl.py
uses, where an engine call costs what a small real model's does) with the real HF engine. ``multi_turn``: an inline environment, ``schedule: episode`` (one engine call per
flush of waiting episodes). ``gateway``: the same conversation written as an ``openai``
client agent (async), over HTTP on 127.0.0.1, through Chat Completions (``gateway``), the
Responses API (``responses``: the output items sent back as input, as the Agents SDK does)
and the Anthropic Messages API (``messages``, the ``anthropic`` client). Also the
per-request overhead of each API: one episode making sequential single requests, against
calling the engine directly on the same prompts.
The two workflows alternate within a run (the machine may be shared); the engine's own
time is measured too, so the gap reads as a fixed cost per request against engine time.
Issue #39 (20M, 32 tokens, one rollout, loaded machine): 1.02 / 1.33 / 1.30x (Chat /
Responses / Messages; 4.5 to 5 engine calls per rollout) before the batcher's patience
window, 0.98 / 0.93 / 0.86x after (3 calls each, as in process); benchmarks/README.md.

    .venv/bin/python benchmarks/gateway_overhead.py [--model tiny|20M] [--tokens 8]
        [--episodes 64] [--rollouts 3]
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

TURNS = 3
MODELS = {  # tiny_qwen2 shapes; 20M is benchmarks/_common.py's
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=1, head_dim=64, intermediate_size=256),
    "20M": dict(
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=1536,
    ),
}


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


async def responses_agent(row, ep):
    client = ep.async_openai()
    items: list = [{"role": "user", "content": row["prompt"]}]
    for _ in range(TURNS):
        r = await client.responses.create(model="main", input=items)
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"role": "user", "content": "go on"}]
    await client.close()
    return 1.0


def anthropic_client(ep, kind="AsyncAnthropic"):
    """An ``anthropic`` client for the episode (no retries, no TLS setup, as
    ``Endpoint.openai`` makes its clients)."""
    import anthropic

    http = (
        anthropic.DefaultAsyncHttpxClient
        if kind == "AsyncAnthropic"
        else anthropic.DefaultHttpxClient
    )(verify=False)
    return getattr(anthropic, kind)(
        base_url=ep.base_url, api_key=ep.api_key, max_retries=0, http_client=http
    )


async def messages_agent(row, ep):
    client = anthropic_client(ep)
    msgs: list = [{"role": "user", "content": row["prompt"]}]
    for _ in range(TURNS):
        r = await client.messages.create(model="main", max_tokens=row["tokens"], messages=msgs)
        msgs += [
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {"role": "user", "content": "go on"},
        ]
    await client.close()
    return 1.0


SEQUENTIAL: dict[str, list[float]] = {}
DIRECT: dict[str, list[float]] = {}
ENGINE_CALL: list = []  # calls the engine directly on the request's prompt (set by main)


def sequential_agent(row, ep):
    """Single greedy requests through ``row["api"]``, each followed by the same engine
    call made directly."""
    api = row["api"]
    msgs = [{"role": "user", "content": row["prompt"]}]
    if api == "messages":
        client = anthropic_client(ep, "Anthropic")

        def ask():
            client.messages.create(
                model="main",
                max_tokens=row["tokens"],
                messages=msgs,
                extra_body={"temperature": 0},  # not a keyword of this anthropic version
            )
    elif api == "responses":
        client = ep.openai()

        def ask():
            client.responses.create(model="main", input=msgs, temperature=0)
    else:
        client = ep.openai()

        def ask():
            client.chat.completions.create(model="main", messages=msgs, temperature=0)

    for _ in range(row["requests"]):
        t = time.perf_counter()
        ask()
        SEQUENTIAL.setdefault(api, []).append(time.perf_counter() - t)
        t = time.perf_counter()
        ENGINE_CALL[0]()
        DIRECT.setdefault(api, []).append(time.perf_counter() - t)
    return 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--tokens", type=int, default=8, help="max new tokens per request")
    args = ap.parse_args(argv)
    tokens = args.tokens
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import polyrl.agents  # noqa: F401
    from polyrl.agents.env import Environment, StepResult, register_env
    from polyrl.agents.gateway import Gateway
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.demo.tiny import tiny_qwen2
    from polyrl.core.rollout.data import PromptItem
    from polyrl.core.rollout.engine import HFEngine, SamplingParams
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    @register_env("bench_go_on")
    class GoOn(Environment):
        def reset(self, task):
            self.t = 0
            return task["prompt"]

        def step(self, action):
            self.t += 1
            return StepResult("go on", 0.0, self.t >= TURNS, {})

    path = Path(tempfile.mkdtemp()) / args.model
    tiny_qwen2(path, corpus="gridworld", vocab_size=128, seed=0, **MODELS[args.model])
    policy = CausalLMPolicy(
        "main", PolicyConfig(model=str(path)), total_steps=1, need_reference=False
    )
    engine = HFEngine(policy, seed=0)
    engine_time = [0.0]  # seconds inside engine.generate, summed
    generate = engine.generate

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            engine_time[0] += time.perf_counter() - t

    engine.generate = timed_generate
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
        "gateway": Gateway(ctx, agent=chat_agent, concurrency=args.episodes, request_timeout=600),
        "responses": Gateway(
            ctx, agent=responses_agent, concurrency=args.episodes, request_timeout=600
        ),
        "messages": Gateway(
            ctx, agent=messages_agent, concurrency=args.episodes, request_timeout=600
        ),
    }
    items = [
        PromptItem(
            uid=i,
            prompt_ids=[1],
            prompt_text="",
            answer=None,
            row={"prompt": f"g {i}", "tokens": tokens},
        )
        for i in range(args.episodes)
    ]
    params = SamplingParams(n=1, max_new_tokens=tokens, temperature=1.0)
    times: dict[str, list[float]] = {k: [] for k in workflows}
    engine_times: dict[str, list[float]] = {k: [] for k in workflows}
    for _ in range(args.rollouts + 1):  # the first round warms up
        for name, wf in workflows.items():
            engine_time[0] = 0.0
            t = time.perf_counter()
            rec = wf.rollout(items, params)
            times[name].append(time.perf_counter() - t)
            engine_times[name].append(engine_time[0])
            from polyrl.core.record import strings

            ok = rec.batch_size[0] == args.episodes * TURNS and bool(rec["valid"].all())
            assert ok, (name, strings(rec, "error")[:2])
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    eng = {k: statistics.median(v[1:]) for k, v in engine_times.items()}
    mt, gw = med["multi_turn"], med["gateway"]
    requests = args.episodes * TURNS
    print(f"{args.model} model, {args.episodes} episodes x {TURNS} turns x {tokens} tokens, "
          f"median of {args.rollouts}: multi_turn {mt:.3f} s (engine {eng['multi_turn']:.3f}), "
          f"gateway {gw:.3f} s (engine {eng['gateway']:.3f}); gateway/in-process "
          f"{gw / mt:.2f} ({100 * (gw / mt - 1):+.1f}%), "
          f"{1e3 * (gw - mt) / requests:.2f} ms more per request")  # fmt: skip
    for api in ("responses", "messages"):
        print(f"{api}: {med[api]:.3f} s (engine {eng[api]:.3f}); {api}/in-process "
              f"{med[api] / mt:.2f}, {api}/chat {med[api] / gw:.2f}, "
              f"{1e3 * (med[api] - mt) / requests:.2f} ms more per request")  # fmt: skip
    calls = {
        k: len(workflows[k].server.batcher.sizes) / (args.rollouts + 1)
        for k in ("gateway", "responses", "messages")
    }
    in_process = workflows["multi_turn"].generate_calls / (args.rollouts + 1)
    print(f"engine calls per rollout: chat {calls['gateway']:.1f}, responses "
          f"{calls['responses']:.1f}, messages {calls['messages']:.1f}, in process "
          f"{in_process:.1f}")  # fmt: skip

    # per request: sequential single requests against direct engine calls, greedy, alternating
    seq = Gateway(ctx, agent=sequential_agent, request_timeout=600)
    prompt = seq.server.chats["main"].first_prompt([{"role": "user", "content": "g 0"}])
    greedy = SamplingParams(n=1, max_new_tokens=tokens, temperature=0)
    ENGINE_CALL.append(lambda: generate([prompt], greedy))
    for api in ("chat", "responses", "messages"):
        row = {"prompt": "g 0", "requests": args.requests + 1, "api": api, "tokens": tokens}
        out = seq.rollout([PromptItem(0, [1], "", None, row)], params)
        assert bool(out["valid"].all()), strings(out, "error")
        gw1 = statistics.median(SEQUENTIAL[api][1:])
        direct = statistics.median(DIRECT[api][1:])
        print(f"one {api} request: gateway {1e3 * gw1:.1f} ms, engine {1e3 * direct:.1f} ms, "
              f"overhead {1e3 * (gw1 - direct):.1f} ms ({gw1 / direct:.2f}x)")  # fmt: skip
    for wf in (*(workflows[k] for k in ("gateway", "responses", "messages")), seq):
        wf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
