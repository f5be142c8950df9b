"""Episode isolation (issue 38): one agent program attacks another episode of the same
rollout and fails. Each episode has two secrets only its own agent is given, its URL
token and its key; a command agent runs in a user and PID namespace of its own, so it
cannot read another agent's environment (where that agent's key is) or the trainer's
memory. The attacker here learns the victim's URL and a stored response id (a leak), scans
every process it can see for keys, then tries to post ``reward: 1000`` into the victim's
episode and to continue its stored conversation, with every key it has."""

from __future__ import annotations

import sys

import pytest

from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams

HERE = "tests.agents.test_gateway_isolation"
RESULTS: dict = {}

AGENT = r"""
import json, os, pathlib, re, time
import httpx

task = json.loads(os.environ["POLYRL_TASK"])
shared = pathlib.Path(task["dir"])
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]


def call(url, k, path, body):
    r = httpx.post(url + path, json={"model": "main", **body}, timeout=60,
                   headers={"Authorization": f"Bearer {k}"})
    return r.status_code, r.json()


def wait(name):
    for _ in range(1200):
        if (shared / name).exists():
            return
        time.sleep(0.05)
    raise SystemExit(f"{name} never came")


if task["role"] == "victim":
    code, r = call(base, key, "/responses", {"input": "grid S.G", "max_output_tokens": 2})
    assert code == 200, r
    # the leak: another program learns this episode's URL and a response id, not its key
    (shared / "leak.json").write_text(json.dumps({"url": base, "response": r["id"]}))
    wait("done")
    print(1.0)
else:
    wait("leak.json")
    leak = json.loads((shared / "leak.json").read_text())
    keys, urls, pids = set(), set(), 0
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        pids += 1
        for part in ("environ", "cmdline"):
            try:
                data = (proc / part).read_bytes()
            except OSError:
                continue
            keys |= {m.decode() for m in re.findall(rb"pk-[A-Za-z0-9_-]{20,}", data)}
            urls |= {m.decode() for m in re.findall(rb"http://[0-9.:]+/ep/[A-Za-z0-9_-]+/v1", data)}
    keys.discard(key)
    urls.discard(base)
    attacks = {}
    for name, k in [("own key", key)] + [(f"found key {i}", k) for i, k in enumerate(sorted(keys))]:
        attacks[name] = {
            "reward": call(leak["url"], k, "/rewards", {"reward": 1000})[0],
            "continue": call(leak["url"], k, "/responses", {
                "previous_response_id": leak["response"], "input": "go on",
                "max_output_tokens": 2})[0],
        }
    own = call(base, key, "/responses", {"previous_response_id": leak["response"],
                                         "input": "go on", "max_output_tokens": 2})
    code, _ = call(base, key, "/chat/completions", {
        "messages": [{"role": "user", "content": "grid G.S"}], "max_tokens": 2})
    report = {"keys": sorted(keys), "urls": sorted(urls), "pids": pids, "attacks": attacks,
              "own_url_continue": own[0], "own_call": code, "victim_url": leak["url"]}
    (shared / "report.json").write_text(json.dumps(report))
    (shared / "done").touch()
    print(0.0)
"""


@pytest.fixture(scope="module")
def models(grid_model_dir):
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policy = CausalLMPolicy(
        "main", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    return {"main": policy}, {"main": HFEngine(policy, seed=0)}


def run(models, items, tmp_path, **args):
    import json

    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    wf = Gateway(Context(None, *models), command=[sys.executable, str(script)], **args)
    try:
        data = [{"prompt": "grid", "role": r, "dir": str(tmp_path)} for r in ("victim", "attacker")]
        rec = wf.rollout(items(data), SamplingParams(n=1, max_new_tokens=4))
    finally:
        wf.close()
    by_role: dict = {}
    for m in strings(rec, "meta"):
        by_role.setdefault(m["row"]["role"], []).append(m)
    report = json.loads((tmp_path / "report.json").read_text())
    return rec, by_role, report, wf.rollout_metrics()


def test_an_agent_cannot_reach_another_episode(models, items, tmp_path):
    """Old code: the attacker finds the victim's URL in its environment (/proc) and, with the
    run's one key, posts 1000 into it (the victim's return becomes 1001) and continues its
    stored conversation. Now the attacker sees no other process, and the leaked URL with
    any key it holds is a 401; a foreign response id on its own URL is a 400."""
    from polyrl.agents.gateway import isolation

    if not isolation():
        pytest.skip(
            "this machine allows no user namespace (unshare): command agents run unisolated"
        )
    rec, by_role, report, metrics = run(models, items, tmp_path)
    assert metrics["gateway/isolated"] == 1.0
    assert report["keys"] == [] and report["urls"] == []  # nothing of the others is visible
    assert report["pids"] <= 2, report  # its own processes only (its PID namespace)
    assert report["attacks"] == {"own key": {"reward": 401, "continue": 401}}, report
    assert report["own_url_continue"] == 400 and report["own_call"] == 200
    (victim,) = by_role["victim"]  # one row: its own completion, nothing the attacker sent
    assert victim["return"] == 1.0 and victim["turn_rewards"] == [1.0]
    assert [m["return"] for m in by_role["attacker"]] == [0.0]
    assert rec["valid"].all()


def test_without_namespaces_the_keys_are_in_reach_but_not_the_url_alone(models, items, tmp_path):
    """With ``isolate_commands: false`` the attacker can read the victim's environment (same
    user): the scan finds its URL and key, which is why isolation is the default. The leaked
    URL with the attacker's own key is still refused (401): the token alone is not enough."""
    rec, by_role, report, metrics = run(models, items, tmp_path, isolate_commands=False)
    assert metrics["gateway/isolated"] == 0.0
    assert report["victim_url"] in report["urls"] and len(report["keys"]) == 1, report
    assert report["attacks"]["own key"] == {"reward": 401, "continue": 401}
    assert report["attacks"]["found key 0"]["reward"] == 200  # the stolen key works
    (victim,) = by_role["victim"][:1]
    assert victim["return"] == 1001.0  # what an unisolated run lets an agent do


def reward_agent(row, ep):
    client = ep.openai()
    client.chat.completions.create(
        model="main", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=2
    )
    try:
        ep.reward(5.0)
        RESULTS["posted"] = "accepted"
    except RuntimeError as e:
        RESULTS["posted"] = str(e)
    return 1.0


def test_reward_posts_can_be_turned_off(models, items):
    """``reward_posts: false``: rewards come only from the agent's return value; a post is
    a 403 saying so, and the episode's return is its return value alone."""
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    wf = Gateway(Context(None, *models), agent=f"{HERE}:reward_agent", reward_posts=False)
    try:
        rec = wf.rollout(items([{"prompt": "grid S.G"}]), SamplingParams(n=1, max_new_tokens=4))
    finally:
        wf.close()
    assert "reward_posts=false" in RESULTS["posted"]
    (meta,) = strings(rec, "meta")
    assert meta["return"] == 1.0 and meta["turn_rewards"] == [1.0]
