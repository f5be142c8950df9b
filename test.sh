#!/usr/bin/env bash
# README command (2): set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
# vLLM runs in-process and changes global state (torch threads, gc, torch.distributed),
# so its tests get their own pytest process.
.venv/bin/pytest -q --durations=12 -m "not gpu and not vllm" "$@"
exec .venv/bin/pytest -q -m "vllm and not gpu" "$@"
