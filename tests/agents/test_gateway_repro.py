"""Gateway runs with ``rollout.args.reproducible``: equal run to run, and resumed exactly.

A command agent's requests reach the server in whatever order the processes happen to
send them, and which requests share an engine flush depends on timing. Measured on the
tiny grid-world model (issue #41): a prompt's prefill logits move by up to 4e-7 with its
batchmates (padding, GEMM blocking), and the engine's one generator gives each row the
numbers of its place in the batch, so two runs at one seed differed from step 1 (sampled
tokens, then the advantages and the loss). With ``reproducible`` each request is sampled
in an engine call of its own from a stream of (run seed, episode, request number).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.gateway import first, gateway_recipe, small_grid, spied_models
from tests.helpers.runs import (
    assert_same_policy_part,
    assert_same_tensors,
    finish_train,
    load_part,
    metrics,
    metrics_by_step,
    spawn_train,
)

STEPS = 4

# Two turns over HTTP with the standard library only (a Python start that imports openai
# costs about a second of CPU per episode); the reward is the share of replies that start
# with a lowercase letter, dense enough that an untrained model's group has a gradient.
AGENT = """\
import json, os, urllib.request
row = json.loads(os.environ["POLYRL_TASK"])
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
msgs = [{"role": "user", "content": row["prompt"]}]
named = 0
for _ in range(2):
    body = json.dumps({"model": os.environ["POLYRL_MODEL"], "messages": msgs}).encode()
    req = urllib.request.Request(url, body, headers)
    reply = json.load(urllib.request.urlopen(req, timeout=60))
    text = reply["choices"][0]["message"]["content"]
    named += text[:1].islower()
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
print(json.dumps(named / 2))
"""


def recipe(tmp_path: Path, model_dir: str) -> Path:
    """The grid-world gateway recipe with the command agent, reproducible, and the quick
    grid's overrides written in (so ``--resume`` needs no overrides)."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    path = Path(gateway_recipe(tmp_path, "unused:agent"))
    r = yaml.safe_load(path.read_text())
    r["rollout"]["args"] = {
        "command": [sys.executable, str(agent)],
        "episode_timeout": 60.0,
        "reproducible": True,
    }
    r["rollout"] |= {"n": 4, "prompts_per_step": 2}
    r["train"]["steps"] = STEPS
    r["eval"]["every"] = 0
    r["run"] |= {"save_every": 2, "progress": False, "tensorboard": False}
    r["run"]["samples_per_step"] = 1000
    r["sft"]["steps"] = 0
    r["task"]["dir"] = str(tmp_path / "data")
    r["task"]["args"] = {"n_train": 8, "n_eval": 4, "size": 3, "holes": 1, "min_dist": 2}
    r["policies"]["main"] |= {"model": model_dir, "build": None, "build_args": None}
    assert len(small_grid(tmp_path, model_dir)) == 6  # the same overrides, as the helper's
    path.write_text(yaml.safe_dump(r))
    return path


@pytest.fixture(scope="module")
def uninterrupted(grid_model_dir, tmp_path_factory):
    """Two uninterrupted runs side by side (each other's load: other timings): (their
    recipe, their directories)."""
    tmp = tmp_path_factory.mktemp("gateway_repro")
    path = recipe(tmp, grid_model_dir)
    runs = [spawn_train(path, tmp, f"run.dir={tmp / name}") for name in "ac"]
    try:
        for run in runs:
            finish_train(run)
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    return path, tmp / "a", tmp / "c"


def final_state(run_dir: Path) -> tuple[dict, dict]:
    """The last checkpoint's policy part and trainer part."""
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    return load_part(ckpt, "policy_main"), load_part(ckpt, "trainer")


def assert_same_runs(a: Path, b: Path) -> None:
    """Bitwise equal: the final weights, optimizer state, engine state, export and every
    metric of every step."""
    from safetensors.torch import load_file

    (pa, ta), (pb, tb) = final_state(a), final_state(b)
    assert_same_policy_part(pa, pb)
    assert ta["sampler"] == tb["sampler"]
    assert torch.equal(ta["gen"], tb["gen"])
    export = "export/main/model.safetensors"
    assert_same_tensors(load_file(a / export), load_file(b / export), "export")
    ma, mb = metrics_by_step(a), metrics_by_step(b)
    assert sorted(ma) == sorted(mb) == list(range(STEPS + 1))
    for step in ma:
        assert ma[step] == mb[step], f"step {step}: " + str(
            {k: (v, mb[step].get(k)) for k, v in ma[step].items() if mb[step].get(k) != v}
        )


@pytest.mark.slow
def test_two_gateway_runs_with_a_command_agent_are_bitwise_equal(uninterrupted, grid_model_dir):
    from safetensors.torch import load_file

    _, dir_a, dir_c = uninterrupted
    assert_same_runs(dir_a, dir_c)
    for f in sorted((dir_a / "samples").glob("*.jsonl")):  # every row, text and meta
        assert f.read_text() == (dir_c / "samples" / f.name).read_text(), f.name
    # ... and the run trained: some group had a gradient and the weights moved
    steps = [r for r in metrics(dir_a) if "main/loss" in r]
    assert len(steps) == STEPS and any(r["advantage/zero_frac"] < 1 for r in steps)
    start = load_file(Path(grid_model_dir) / "model.safetensors")
    end = load_file(dir_a / "export" / "main" / "model.safetensors")
    common = start.keys() & end.keys()
    assert common and any(not torch.equal(start[k], end[k]) for k in common)


@pytest.mark.slow
def test_a_killed_gateway_run_resumes_bitwise_equal(uninterrupted, tmp_path, spawned):
    path, dir_a, _ = uninterrupted
    dir_b = tmp_path / "b"
    spawned.append(run_b := spawn_train(path, tmp_path, f"run.dir={dir_b}"))
    first = dir_b / "checkpoints" / f"step_{2:06d}" / "COMPLETE"
    deadline = time.monotonic() + 240
    while not first.is_file() and run_b.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if first.is_file():
        os.kill(run_b.pid, signal.SIGKILL)
    rc = run_b.wait(timeout=60)
    run_b.log.close()
    assert rc == -signal.SIGKILL, Path(run_b.log.name).read_text()[-3000:]
    assert not (dir_b / "checkpoints" / f"step_{STEPS:06d}").exists(), "B finished first"
    spawned.append(resume := spawn_train(path, tmp_path, "--resume", str(dir_b)))
    finish_train(resume)
    assert_same_runs(dir_a, dir_b)


def serve(server, episodes, prompts, delay: float) -> list[str]:
    """Each episode's one chat request (``prompts[i]`` for ``episodes[i]``), sent from
    threads in reverse episode order, ``delay`` seconds apart; the replies' texts."""
    import threading

    import httpx

    urls = [server.open_episode(ep) for ep in episodes]
    texts: list[str] = [""] * len(episodes)

    def send(i: int) -> None:
        body = {"model": "main", "messages": [{"role": "user", "content": prompts[i]}]}
        auth = {"Authorization": f"Bearer {episodes[i].key}"}
        r = httpx.post(urls[i] + "/chat/completions", json=body, headers=auth, timeout=60)
        texts[i] = r.json()["choices"][0]["message"]["content"]

    threads = []
    for i in reversed(range(len(episodes))):
        threads.append(t := threading.Thread(target=send, args=(i,)))
        t.start()
        time.sleep(delay)
    for t in threads:
        t.join()
    for ep in episodes:
        server.close_episode(ep)
    return texts


def test_a_flush_is_in_episode_order_and_a_reproducible_request_ignores_its_batchmates(
    grid_model_dir,
):
    from polyrl.agents.gateway.episodes import EpisodeState
    from polyrl.agents.gateway.options import GatewayOptions
    from polyrl.agents.gateway.server import GatewayServer
    from polyrl.core.rollout.data import PromptItem
    from polyrl.core.rollout.engine import SamplingParams

    policies, engines = spied_models(grid_model_dir, names=("main",))
    tok = policies["main"].tokenizer
    prompts = ["grid S.G", "grid G.H.S and more", "grid H"]

    def episodes(ids):
        item = PromptItem(uid=0, prompt_ids=[1], prompt_text="", answer=None, row={})
        return [EpisodeState(i, f"t{i}", item, 0) for i in ids]

    for reproducible in (False, True):
        # a long batch_wait: the flush waits until every open episode has its request in
        options = GatewayOptions(agent="unused:agent", batch_wait=5.0, reproducible=reproducible)
        server = GatewayServer(engines, {"main": tok}, options, seed=3)
        server.defaults = SamplingParams(max_new_tokens=6)
        server.start()
        try:
            engines["main"].log.clear()
            together = serve(server, episodes([0, 1, 2]), prompts, 0.2)
            (flush,) = server.batcher.sizes[-1:]
            served = [p for p, _ in engines["main"].log]
            if not reproducible:  # one call, in episode order though sent in reverse
                assert flush == 3 and server.batcher.flushes == 1
                assert served == [first([{"role": "user", "content": p}], tok) for p in prompts]
                continue
            # one call per request, each the same alone as beside the others
            assert server.batcher.sizes == [1, 1, 1]
            alone = [serve(server, episodes([i]), prompts[i : i + 1], 0)[0] for i in range(3)]
            assert together == alone
        finally:
            server.close()
