#!/usr/bin/env bash
# Run PolyRL's GPU checks on an offline GPU image (see the README's "GPU checks").
#   OUT=/where/results/go gpu/run.sh          # on the GPU machine, in the tree, gpu/kit beside
#   POLYRL_TEST_DEVICE=cpu OUT=... gpu/run.sh  # the same steps at tiny sizes on the CPU
# Makes a venv over the image's python3 (--system-site-packages), installs gpu/kit offline
# and PolyRL without dependencies, then runs each step under its own time limit, all of them
# within POLYRL_GPU_BUDGET_S (400 s on a GPU: with the report and a killed step's grace the
# run stays under 7 minutes; 1800 s on the CPU). A failing step is recorded and the next
# one runs; a step sees its limit as POLYRL_STEP_LIMIT_S. Writes $OUT/gpu_checks.json (a
# field per check: status, seconds, figures) and $OUT/gpu_checks.log, and prints a table.
# Exit code 0 when every check is ok or skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu/out}
PY=${PYTHON:-python3}
KIT=${POLYRL_KIT_DIR:-$ROOT/gpu/kit}
BUDGET=${POLYRL_GPU_BUDGET_S:-}
WORK=${POLYRL_GPU_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/polyrl-gpu.XXXXXX")}
export POLYRL_TEST_DEVICE=${POLYRL_TEST_DEVICE:-cuda} POLYRL_KIT_DIR=$KIT
export POLYRL_BENCH_CACHE=$WORK/bench-cache HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export POLYRL_GPU_STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
mkdir -p "$OUT" "$WORK/steps"
exec > >(tee "$OUT/gpu_checks.log") 2>&1
# A python for the bookkeeping (JSON, the report) even when $PY is not one: the results
# file must say what went wrong, whatever it was.
JPY=
for c in "$PY" python3 python; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import json' >/dev/null 2>&1; then JPY=$c; break; fi
done
VENV=$WORK/venv
VPY=$VENV/bin/python
# step: limit in seconds (the CPU mode's tiny sizes need less device work but slower cores)
if [ "$POLYRL_TEST_DEVICE" = cpu ]; then
  BUDGET=${BUDGET:-1800}
  STEPS="env:240 pytest:420 arithmetic:240 bench_20m:240 multi_lora:240 bench_05b:240 memory:120 diffusion:300"
else
  BUDGET=${BUDGET:-400}
  STEPS="env:60 pytest:120 arithmetic:90 bench_20m:80 multi_lora:70 bench_05b:120 memory:60 diffusion:80"
fi
START=$SECONDS
echo "PolyRL GPU checks: device $POLYRL_TEST_DEVICE, budget ${BUDGET}s, work $WORK, out $OUT"

jstr() {  # a JSON string (null when empty), without python if there is none
  if [ -z "$1" ]; then echo null
  elif [ -n "$JPY" ]; then "$JPY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$1"
  else printf '"%s"\n' "$(printf '%s' "$1" | tr -d '\000-\037' | sed 's/[\\"]/\\&/g')"
  fi
}

status() {  # name rc seconds limit [why]
  printf '{"rc": %s, "seconds": %s, "limit_s": %s, "why": %s}\n' "$2" "$3" "$4" \
    "$(jstr "${5:-}")" > "$WORK/steps/$1.status"
}

run_step() {  # name limit command...
  local name=$1 limit=$2 left t0 rc
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then
    echo "=== $name: skipped (the ${BUDGET}s budget is spent)"
    status "$name" 3 0 0 "not run: the ${BUDGET}s budget was spent"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s)"
  t0=$(date +%s.%N)
  POLYRL_STEP_LIMIT_S=$limit timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/steps/$name.log"
  rc=${PIPESTATUS[0]}
  status "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b - a}')" \
    "$limit" "$(cat "$WORK/steps/$name.why" 2>/dev/null)"
  echo "=== $name: exit $rc"
}

missing() {  # what setup lacks: printed, and the step's "why" in gpu_checks.json
  echo "setup: $1"
  echo "$1" > "$WORK/steps/setup.why"
  exit 1
}

setup() {
  set -e
  command -v "$PY" >/dev/null 2>&1 && "$PY" -c 'import sys' >/dev/null 2>&1 ||
    missing "PYTHON=$PY does not run (no such python); set PYTHON to the image's python3"
  "$PY" -c 'import torch' >/dev/null 2>&1 ||
    missing "$PY has no torch; the checks need the image's (CUDA) torch: set PYTHON to it"
  [ -d "$KIT/wheels" ] || missing "no kit at $KIT: run gpu/make_kit.sh on a networked machine"
  compgen -G "$KIT/wheels/*.whl" >/dev/null ||
    missing "$KIT/wheels holds no wheels (*.whl): run gpu/make_kit.sh on a networked machine"
  "$PY" -m venv --without-pip --system-site-packages "$VENV"
  local site
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # python3 may itself live in a venv (the lent H200 image's does): then the packages it
  # holds are not the venv's "system" site-packages, so point at them with a .pth file
  "$PY" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))' \
    > "$site/_polyrl_image.pth"
  cp gpu/polyrl_kit_noray.py "$site/"
  echo "import polyrl_kit_noray" > "$site/polyrl_kit_noray.pth"
  "$PY" -m pip --python "$VPY" install -q --no-index --no-deps --no-cache-dir "$KIT"/wheels/*.whl
  "$PY" -m pip --python "$VPY" install -q --no-index --no-deps --no-build-isolation \
    --no-cache-dir -e .
  "$PY" -m pip --python "$VPY" list 2>/dev/null | grep -i -E '^(polyrl|verl|tensordict|trl|datasets|diffusers|torch|transformers) '
}

export PY VPY VENV KIT WORK
export -f setup missing
run_step setup 120 bash -c setup
if [ "$(sed -n 's/.*"rc": \([0-9]*\).*/\1/p' "$WORK/steps/setup.status")" = 0 ]; then
  for s in $STEPS; do
    name=${s%%:*}
    run_step "$name" "${s##*:}" "$VPY" gpu/checks.py "$name" --work "$WORK"
  done
  REPORT_PY=$VPY
else
  REPORT_PY=$JPY
fi
ORDER=$(for s in $STEPS; do echo "${s%%:*}"; done)
if [ -n "$REPORT_PY" ]; then
  # shellcheck disable=SC2086  # ORDER: one word a step
  "$REPORT_PY" gpu/checks.py report --work "$WORK" --out "$OUT" --order $ORDER
else  # no python at all: the setup's failure alone, by hand
  printf '{"device": "%s", "checks": {"setup": {"status": "failed", "error": %s}}}\n' \
    "$POLYRL_TEST_DEVICE" "$(jstr "$(cat "$WORK/steps/setup.why" 2>/dev/null)")" \
    > "$OUT/gpu_checks.json"
  echo "setup failed: $(cat "$WORK/steps/setup.why" 2>/dev/null)"
  exit 1
fi
