#!/usr/bin/env bash
# README command (2): set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
exec .venv/bin/pytest -q -m "not gpu" "$@"
