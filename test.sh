#!/usr/bin/env bash
# README command (2): set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
export TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # strict types of the core and the gateway ([tool.mypy] in pyproject.toml)
# Two pytest-xdist workers of one thread each, a test file per worker at a time
# (POLYRL_TEST_WORKERS=0: one process). Ray tests then run in one process, so the session
# keeps one Ray cluster (tests/conftest.py marks every test that starts Ray).
WORKERS=${POLYRL_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
  OMP_NUM_THREADS=1 .venv/bin/pytest -q --durations=12 -m "not gpu and not vllm and not ray and not seeds and not kit and not alone" \
    -n "$WORKERS" --dist loadfile "$@"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} .venv/bin/pytest -q --durations=6 \
    -m "ray and not gpu and not vllm and not seeds and not kit and not alone" "$@"
else
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} .venv/bin/pytest -q --durations=12 \
    -m "not gpu and not vllm and not seeds and not kit and not alone" "$@"
fi
# vLLM runs in-process and changes global state (torch threads, gc, torch.distributed),
# so its tests get their own pytest process.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} exec .venv/bin/pytest -q -m "vllm and not gpu and not seeds and not kit and not alone" "$@"
