#!/usr/bin/env bash
# Build the offline GPU kit on a networked machine (see the README's "GPU checks").
#   gpu/make_kit.sh [--image gpu/images/h200.txt] [--python-version 3.12]
# Downloads pinned wheels (gpu/kit.txt) of what the target image lacks into gpu/kit/
# (ignored by git), keeps whole parts while tree + kit < 64 MiB, prints the kit and sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" gpu/kit.py build "$@"
