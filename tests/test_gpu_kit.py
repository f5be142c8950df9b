"""The offline GPU kit (gpu/): what it carries, how it fits, the runner's report, verl
without Ray, and (marker ``kit``) the whole kit built and run on the CPU in an image-like
venv."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", ROOT / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


kit = _load("kit")


def test_the_plan_leaves_out_what_the_image_has(tmp_path):
    spec = tmp_path / "kit.txt"
    spec.write_text(
        "# comment\ncore verl==0.9.1\ncore Tensor_Dict==0.10.0  # trailing\n"
        "trl python-dateutil==4.0.0\ntrl trl==1.16.0\n"
    )
    image = tmp_path / "image.txt"
    image.write_text("# an image\ntensor.dict==0.9\npython_dateutil\ntorch==2.11.0\n")
    parts = kit.plan(kit.read_spec(spec), kit.read_image(image))
    assert {p: [w.requirement for w in ws] for p, ws in parts.items()} == {
        "core": ["verl==0.9.1"],
        "trl": ["trl==1.16.0"],
    }


def test_a_spec_line_without_a_pin_names_its_file_and_line(tmp_path):
    spec = tmp_path / "kit.txt"
    spec.write_text("core verl==0.9.1\ncore tensordict\n")
    with pytest.raises(SystemExit, match=r"kit.txt:2: expected 'part name==version'"):
        kit.read_spec(spec)


def test_the_kit_spec_pins_every_wheel_and_puts_polyrl_s_own_needs_first():
    spec = kit.read_spec(ROOT / "gpu" / "kit.txt")
    assert spec[0].part == "core" and {"verl", "tensordict"} <= {w.name for w in spec}
    assert all(w.requirement.count("==") == 1 and w.requirement.split("==")[1] for w in spec)
    assert len({w.name for w in spec}) == len(spec)  # one version of each


def test_fit_keeps_whole_parts_in_order_under_the_limit():
    # tree 3 + core 3 + trl 55 = 61 MiB < 64; diffusion's 13 more would be 74
    sizes = {"core": 3 * MIB, "trl": 55 * MIB, "diffusion": 13 * MIB}
    assert kit.fit(sizes, 3 * MIB) == (["core", "trl"], ["diffusion"])
    # a part that does not fit is dropped and a later, smaller one still goes in
    sizes = {"core": 3 * MIB, "trl": 60 * MIB, "diffusion": 5 * MIB}
    assert kit.fit(sizes, 3 * MIB) == (["core", "diffusion"], ["trl"])
    with pytest.raises(SystemExit, match="'core' alone"):
        kit.fit({"core": 62 * MIB}, 3 * MIB)


def test_the_report_has_a_field_per_check_and_says_which_failed(tmp_path):
    checks = _load("checks")
    steps = tmp_path / "steps"
    steps.mkdir()
    for name, rc, secs in [("setup", 0, 12.5), ("pytest", 1, 40.0), ("bench_20m", 124, 80.0)]:
        (steps / f"{name}.status").write_text(
            json.dumps({"rc": rc, "seconds": secs, "limit_s": 80, "why": None})
        )
    (steps / "pytest.log").write_text("collected 5 items\nE   boom\n")
    (steps / "pytest.json").write_text(
        json.dumps({"figures": {"counts": {"passed": 3, "failed": 1, "error": 0, "skipped": 1}}})
    )
    # a CPU has no peak FLOP/s: MFU is NaN, which the report writes as null (strict JSON)
    (steps / "bench_20m.json").write_text(
        json.dumps({"figures": {"polyrl_hf": {"median_s": 4.0, "mfu": float("nan")}}})
    )
    rc = checks.report(tmp_path, tmp_path / "out", ["setup", "pytest", "bench_20m", "memory"])

    def strict(token):
        raise ValueError(f"not strict JSON: {token}")

    got = json.loads((tmp_path / "out" / "gpu_checks.json").read_text(), parse_constant=strict)
    assert rc == 1 and got["ok"] is False and got["total_s"] == 132.5
    c = got["checks"]
    assert list(c) == ["setup", "pytest", "bench_20m", "memory"]
    assert [c[k]["status"] for k in c] == ["ok", "failed", "timeout", "not run"]
    assert c["pytest"]["figures"]["counts"]["failed"] == 1
    assert c["pytest"]["log_tail"][-1] == "E   boom"
    assert "time limit" in c["bench_20m"]["error"]
    assert c["bench_20m"]["figures"]["polyrl_hf"] == {"median_s": 4.0, "mfu": None}
    assert all({"status", "seconds", "figures"} <= set(v) for v in c.values())


def _multi_lora_result(plan: dict, update: dict, rollout: dict) -> dict:
    """A ``benchmarks/multi_lora.py --json`` result: ``update`` maps an agent count to
    (rows, tokens, one-by-one s, batched s), ``rollout`` to (one call per agent s, merged s)."""
    agents = {
        str(a): {
            "rows": rows,
            "tokens": tokens,
            "contenders": {
                "one-by-one": {"wall_s": one, "cpu_s": 2 * one},
                "batched": {"wall_s": both, "cpu_s": 2 * both},
            },
            "ratio": {"wall_s": one / both, "cpu_s": one / both},
        }
        for a, (rows, tokens, one, both) in update.items()
    }
    out = {
        f"hf/{a}": {"apart_s": apart, "merged_s": merged, "ratio": apart / merged}
        for a, (apart, merged) in rollout.items()
    }
    return {"size": "20M", "update": {"plan": plan, "agents": agents}, "rollout": out}


def test_multi_lora_figures_keep_each_plan_and_agent_count_and_print_one_line():
    """The step folds its runs (the big per-agent plan at 8 agents, the small one with the
    HF rollout at 8 and then 2) by plan and agent count; the table line has every ratio."""
    checks = _load("checks")
    figures: dict = {"size": "20M", "dtype": "bfloat16", "update": {}, "runs": {}}
    big = {"prompts": 8, "n": 8, "max_new_tokens": 64}
    small = {"prompts": 4, "n": 4, "max_new_tokens": 16}
    checks._multi_lora_figures(
        _multi_lora_result(big, {8: (512, 39000, 2.4, 0.6)}, {}), figures, "debate_batch"
    )
    checks._multi_lora_figures(
        _multi_lora_result(small, {8: (128, 3748, 0.5, 0.4)}, {8: (2.0, 0.5)}), figures, "default"
    )
    checks._multi_lora_figures(
        _multi_lora_result(small, {2: (32, 952, 0.2, 0.25)}, {2: (0.6, 0.4)}), figures, "default"
    )
    upd = figures["update"]
    assert upd["debate_batch"]["plan"] == {
        **big,
        "micro_batch_size": checks.ML_PLANS["debate_batch"][3],
    }
    assert upd["debate_batch"]["agents"]["8"] == {
        "rows": 512,
        "tokens": 39000,
        "one_by_one_s": 2.4,
        "batched_s": 0.6,
        "ratio": 2.4 / 0.6,
        "one_by_one_cpu_s": 4.8,
        "batched_cpu_s": 1.2,
    }
    assert sorted(upd["default"]["agents"]) == ["2", "8"]
    assert upd["default"]["agents"]["2"]["ratio"] == 0.2 / 0.25
    assert figures["rollout_hf"]["agents"] == {
        "8": {"one_call_per_agent_s": 2.0, "merged_s": 0.5, "ratio": 4.0},
        "2": {"one_call_per_agent_s": 0.6, "merged_s": 0.4, "ratio": 0.6 / 0.4},
    }
    assert checks._summary("multi_lora", figures) == (
        "20M bfloat16, one-by-one/batched; "
        "8 agents: update 4.00x (2.4 -> 0.6 s), small update 1.25x, HF rollout 4.00x; "
        "2 agents: small update 0.80x, HF rollout 1.50x"
    )


def test_the_multi_lora_step_stops_at_its_limit_and_keeps_what_it_has(tmp_path):
    """A limit too short for the benchmark's first run: the step cuts it, records why and
    exits with the runner's timeout code instead of starting the next run."""
    env = dict(os.environ, POLYRL_TEST_DEVICE="cpu", POLYRL_STEP_LIMIT_S="4")
    env["POLYRL_BENCH_CACHE"] = str(tmp_path / "cache")
    ran = subprocess.run(
        [sys.executable, "gpu/checks.py", "multi_lora", "--work", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 124, ran.stdout[-2000:] + ran.stderr[-2000:]
    figures = json.loads((tmp_path / "steps" / "multi_lora.json").read_text())["figures"]
    cut = figures["runs"]
    assert list(cut) == ["debate_batch/3"]  # the next run never started
    assert cut["debate_batch/3"]["rc"] == 124
    assert cut["debate_batch/3"]["error"] == "cut at the step's time limit"
    assert figures["update"] == {}


def test_verl_imports_without_ray_and_nothing_else_sees_a_ray(tmp_path):
    """gpu/polyrl_kit_noray.py, in a bare interpreter (no site-packages, so no Ray), with a
    stand-in package named verl that does what verl does: ``import ray`` at the top of a
    module, ``ray.X`` in a class annotation, Ray called only inside functions."""
    pkg = tmp_path / "verl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .protocol import Proto\n")
    (pkg / "protocol.py").write_text(
        "import ray\n\nclass Proto:\n    futures: list[ray.ObjectRef]\n\n"
        "def start():\n    return ray.init(num_cpus=1)\n"
    )
    (pkg / "late.py").write_text("import ray\nWORKER = ray.remote\n")
    code = textwrap.dedent(
        """
        import sys
        sys.path[:0] = [sys.argv[1], sys.argv[2]]
        import polyrl_kit_noray  # what the kit venv's .pth line does
        import verl
        print("ray after verl:", "ray" in sys.modules)
        try:
            import ray
        except ModuleNotFoundError:
            print("import ray: ModuleNotFoundError")
        import verl.late  # a verl module imported later gets the placeholder again
        try:
            verl.protocol.start()
        except ImportError as e:
            print("start:", e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(tmp_path), str(ROOT / "gpu")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "ray after verl: False"
    assert lines[1] == "import ray: ModuleNotFoundError"
    assert lines[2].startswith("start: Ray is not installed") and "ray.init" in lines[2]


# ------------------------------------------------------------------------------ marker kit

IMAGE_PACKAGES = [
    "torch==2.11.0",
    "transformers==5.17.0",
    "peft",
    "accelerate",
    "safetensors",
    "numpy",
    "pytest",
    "pytest-timeout",
]


@pytest.mark.parametrize("image", ["gpu/images/absent.txt", "gpu/images"])
def test_make_kit_names_an_image_list_it_cannot_read(image):
    ran = subprocess.run(
        ["gpu/make_kit.sh", "--image", image], cwd=ROOT, capture_output=True, text=True
    )
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    what = "is a directory" if image == "gpu/images" else "does not exist"
    assert f"--image {image} {what}" in ran.stderr and "gpu/images/h200.txt" in ran.stderr


def _python_without_torch() -> str:
    """A python with no torch (the machine's python3, or a bare venv over it)."""
    plain = shutil.which("python3")
    found = subprocess.run([plain, "-c", "import torch"], capture_output=True).returncode
    return plain if found != 0 else ""


@pytest.mark.parametrize("case", ["no-python", "no-torch", "no-wheels", "no-kit"])
def test_the_runner_names_what_setup_lacks_and_still_writes_its_json(tmp_path, case):
    """gpu/run.sh with a broken setup: the setup step fails with the missing piece as its
    error in gpu_checks.json (every other step 'not run'), and the run exits 1."""
    python = {
        "no-python": "/nonexistent/python3",
        "no-torch": _python_without_torch(),
        "no-wheels": sys.executable,
        "no-kit": sys.executable,
    }[case]
    if not python:
        pytest.skip("the machine's python3 has torch")
    kit_dir = tmp_path / "kit"
    if case == "no-wheels":
        (kit_dir / "wheels").mkdir(parents=True)
    env = dict(
        os.environ,
        PYTHON=python,
        POLYRL_TEST_DEVICE="cpu",
        OUT=str(tmp_path / "out"),
        POLYRL_KIT_DIR=str(kit_dir),
        POLYRL_GPU_WORK=str(tmp_path / "work"),
    )
    ran = subprocess.run(["gpu/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert ran.returncode == 1, ran.stdout[-2000:]
    checks = json.loads((tmp_path / "out" / "gpu_checks.json").read_text())["checks"]
    want = {
        "no-python": f"PYTHON={python} does not run",
        "no-torch": f"{python} has no torch",
        "no-wheels": f"{kit_dir}/wheels holds no wheels",
        "no-kit": f"no kit at {kit_dir}",
    }[case]
    assert checks["setup"]["status"] == "failed" and want in checks["setup"]["error"]
    assert {c["status"] for k, c in checks.items() if k != "setup"} == {"not run"}
    assert "command not found" not in ran.stdout and "Invalid wheel" not in ran.stdout


def _image_python() -> Path:
    """A Python 3.12 venv holding only what the issue's GPU image holds (made once)."""
    given = os.environ.get("POLYRL_KIT_IMAGE_PYTHON")
    if given:
        return Path(given)
    venv = Path(os.environ.get("POLYRL_KIT_IMAGE_VENV", "/tmp/polyrl-kit-image312"))
    py = venv / "bin" / "python"
    if not py.is_file():
        base = shutil.which("python3.12")
        if base is None:
            pytest.skip("needs python3.12 (or POLYRL_KIT_IMAGE_PYTHON) for the image-like venv")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *IMAGE_PACKAGES], check=True)
    return py


@pytest.mark.kit
@pytest.mark.timeout(3600)
def test_the_kit_builds_and_its_runner_passes_on_the_cpu(tmp_path):
    """gpu/make_kit.sh downloads the kit (network), gpu/run.sh installs it offline in a
    venv over the image-like Python and runs every step at tiny sizes on the CPU."""
    py = _image_python()
    made = subprocess.run(
        ["gpu/make_kit.sh", "--kit", str(tmp_path / "kit")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(made.stdout[-3000:])
    assert made.returncode == 0, made.stderr[-3000:]
    tail = made.stdout.strip().splitlines()[-1]  # "tree X MiB + kit Y MiB = Z MiB (limit 64 MiB)"
    assert float(tail.split("= ")[1].split()[0]) < 64
    env = dict(
        os.environ,
        PYTHON=str(py),
        POLYRL_TEST_DEVICE="cpu",
        OUT=str(tmp_path / "out"),
        POLYRL_KIT_DIR=str(tmp_path / "kit"),
        POLYRL_GPU_WORK=str(tmp_path / "work"),
    )
    ran = subprocess.run(["gpu/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    print(ran.stdout[-4000:])
    got = json.loads((tmp_path / "out" / "gpu_checks.json").read_text())
    bad = {
        k: v.get("error") for k, v in got["checks"].items() if v["status"] not in ("ok", "skipped")
    }
    assert ran.returncode == 0 and not bad, bad
    c = got["checks"]
    assert c["pytest"]["figures"]["counts"]["passed"] >= 4
    assert c["bench_20m"]["figures"]["polyrl_hf"]["median_s"] > 0
    assert c["bench_20m"]["figures"]["trl"]["median_s"] > 0
    assert 0 <= c["arithmetic"]["figures"]["accuracy_after_grpo"] <= 1
    a = c["arithmetic"]["figures"]  # the run's own tokens/s and MFU (perf/* metrics)
    assert a["median_gen_tokens_per_s"] > 0 and 0 < a["median_mfu"] < 1
    m = c["multi_lora"]["figures"]  # CPU mode: 3 agents, then 2 while the limit allows
    assert all(r["rc"] == 0 for r in m["runs"].values() if "rc" in r), m["runs"]
    for plan, rows in (("debate_batch", 3 * 2 * 2), ("default", 3 * 1 * 2)):  # prompts x n
        got = m["update"][plan]["agents"]["3"]
        assert got["rows"] == rows and got["tokens"] > rows * 8  # 8 response tokens a row
        assert got["one_by_one_s"] > 0 and got["batched_s"] > 0
    assert m["rollout_hf"]["agents"]["3"]["merged_s"] > 0
