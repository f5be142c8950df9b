"""Build the offline GPU kit: the wheels an air-gapped GPU image lacks for PolyRL's checks.

``gpu/make_kit.sh`` runs ``python3 gpu/kit.py build``. On a networked machine it reads
what the target image already holds (``gpu/images/*.txt``, one distribution a line),
downloads from the package index the lines of ``gpu/kit.txt`` that the image lacks (pinned
wheels for CPython 3.12, manylinux x86_64, no dependencies), keeps whole parts in the
file's order while the working tree plus the kit stays under the upload limit (64 MiB),
and prints the kit's files and sizes. Standard library only: it runs before any venv.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # what reaches the GPU machine: the tree plus the kit
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def normalize(name: str) -> str:
    """A distribution name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    part: str
    requirement: str  # name==version

    @property
    def name(self) -> str:
        return normalize(self.requirement.split("==")[0])


def read_spec(path: Path) -> list[Wheel]:
    """``gpu/kit.txt``: "part name==version" a line; '#' starts a comment."""
    wheels = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or "==" not in fields[1]:
            raise SystemExit(f"{path}:{n}: expected 'part name==version', got {line!r}")
        wheels.append(Wheel(fields[0], fields[1]))
    return wheels


def read_image(path: Path) -> set[str]:
    """The distributions an image holds: one a line, bare or ``name==version``."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize(re.split(r"[=<>~! ]", line, maxsplit=1)[0]))
    return names


def plan(spec: list[Wheel], image: set[str]) -> dict[str, list[Wheel]]:
    """Per part, in the spec's order, the wheels the image lacks (a part may be empty)."""
    parts: dict[str, list[Wheel]] = {}
    for w in spec:
        parts.setdefault(w.part, [])
        if w.name not in image:
            parts[w.part].append(w)
    return parts


def fit(sizes: dict[str, int], tree: int, limit: int = LIMIT) -> tuple[list[str], list[str]]:
    """Parts kept and dropped: whole parts in order while tree + kit stays under ``limit``.
    The first part (PolyRL's own needs) is required: without it nothing runs."""
    kept, dropped, total = [], [], tree
    for i, (part, size) in enumerate(sizes.items()):
        if total + size < limit:
            kept.append(part)
            total += size
        elif i == 0:
            raise SystemExit(
                f"part {part!r} alone ({size / 2**20:.1f} MiB) with the tree "
                f"({tree / 2**20:.1f} MiB) is over {limit / 2**20:.0f} MiB: nothing fits"
            )
        else:
            dropped.append(part)
    return kept, dropped


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels with the kit: tracked files and untracked ones git does not
    ignore (the kit itself is ignored, so it is not counted twice)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for rel in out.decode().split("\0"):
        p = root / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def download(wheels: list[Wheel], dest: Path, python_version: str) -> dict[str, Path]:
    """One pip download for the wheels, no dependencies; their files by distribution."""
    dest.mkdir(parents=True, exist_ok=True)
    if wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", python_version, "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        cmd += ["-d", str(dest), "--progress-bar", "off", "-q"]
        subprocess.run(cmd + [w.requirement for w in wheels], check=True)
    files = {}
    for f in dest.glob("*.whl"):
        files[normalize(f.name.split("-")[0])] = f
    missing = [w.requirement for w in wheels if w.name not in files]
    if missing:
        raise SystemExit(f"pip download left no wheel for {missing} in {dest}")
    return {w.name: files[w.name] for w in wheels}


def need_file(flag: str, given: str) -> Path:
    """``given`` as a list file, or exit saying what is wrong and what exists."""
    path = Path(given)
    if path.is_file():
        return path
    what = "is a directory" if path.is_dir() else "does not exist"
    lists = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gpu/images").glob("*.txt"))
    raise SystemExit(
        f"make_kit: {flag} {given} {what}; give a list file (one distribution a line), "
        f"e.g. {', '.join(lists) or 'gpu/images/<image>.txt'}"
    )


def build(args) -> int:
    spec = read_spec(need_file("--spec", args.spec))
    image = read_image(need_file("--image", args.image))
    kit = Path(args.kit)
    parts = plan(spec, image)
    skipped = [w.requirement for w in spec if w.name in image]
    print(f"image list: {args.image} ({len(image)} distributions)")
    print("the image has, so the kit leaves out: " + (", ".join(skipped) or "(none)"))
    cache = kit.parent / f".{kit.name}-cache" / f"cp{args.python_version.replace('.', '')}"
    got = {part: download(ws, cache, args.python_version) for part, ws in parts.items()}
    sizes = {part: sum(f.stat().st_size for f in files.values()) for part, files in got.items()}
    tree = tree_bytes()
    kept, dropped = fit(sizes, tree, args.limit_mib * 2**20)
    if kit.exists():
        shutil.rmtree(kit)
    (kit / "wheels").mkdir(parents=True)
    manifest = {
        "python_version": args.python_version,
        "image": Path(args.image).name,
        "parts": {},
        "dropped": {},
    }
    for part in kept:
        for f in got[part].values():
            shutil.copy2(f, kit / "wheels" / f.name)
        manifest["parts"][part] = sorted(f.name for f in got[part].values())
    for part in dropped:
        manifest["dropped"][part] = (
            f"{sizes[part] / 2**20:.1f} MiB would take tree + kit past {args.limit_mib} MiB"
        )
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"\n{kit}/")
    for part in kept:
        print(f"  {part}: {sizes[part] / 2**20:.2f} MiB")
        for f in sorted(got[part].values(), key=lambda f: f.name):
            print(f"    wheels/{f.name}  {f.stat().st_size / 2**20:.2f} MiB")
    for part, why in manifest["dropped"].items():
        print(f"  {part}: LEFT OUT ({why}); its checks are skipped on the GPU")
    kit_bytes = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    total = tree + kit_bytes
    print(
        f"\ntree {tree / 2**20:.2f} MiB + kit {kit_bytes / 2**20:.2f} MiB = "
        f"{total / 2**20:.2f} MiB (limit {args.limit_mib} MiB)"
    )
    return 0 if total < args.limit_mib * 2**20 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the wheels and assemble the kit")
    b.add_argument("--image", default=str(ROOT / "gpu/images/minimal.txt"))
    b.add_argument("--spec", default=str(ROOT / "gpu/kit.txt"))
    b.add_argument("--kit", default=str(ROOT / "gpu/kit"))
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--limit-mib", type=int, default=LIMIT // 2**20)
    args = p.parse_args(argv)
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
