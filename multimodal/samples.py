"""Contact sheets: a run's sample images next to the model's answers, as one PNG.

The core writes transcripts to ``RUN_DIR/samples/<tag>_step_N.jsonl``; a VL prompt's text
names each image as ``<image: PATH>``. This module draws, for the newest (or a given)
step, each sample's first image with its response and ground truth underneath (green
when the reward is positive, red otherwise) and saves ``<tag>_step_N.png`` beside it::

    python -m polyrl.multimodal.samples RUN_DIR [--tag eval] [--step N]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from PIL import Image, ImageDraw

_IMAGE = re.compile(r"<image: ([^>]+)>")
_STEP = re.compile(r"_step_(\d+)\.jsonl$")


def _latest(samples: Path, tag: str) -> Path:
    found = sorted(
        samples.glob(f"{tag}_step_*.jsonl"), key=lambda p: int(_STEP.search(p.name).group(1))
    )
    if not found:
        raise FileNotFoundError(f"{samples} has no {tag}_step_*.jsonl transcripts")
    return found[-1]


def _resolve(ref: str, run_dir: Path) -> Path | None:
    for candidate in (Path(ref), run_dir / ref, Path.cwd() / ref):
        if candidate.is_file():
            return candidate
    return None


MATCH, MISS, GOLD = (0, 130, 0), (190, 0, 0), (60, 60, 60)


def draw_sheet(
    cells: list[tuple[Image.Image | None, str, str, tuple[int, int, int]]],
    columns: int = 8,
    cell: int = 112,
) -> Image.Image:
    """One tile per ``(image, response, answer, response colour)``: the image (or a grey
    frame when there is none) with the response (``>``) and the ground truth (``=``) under it."""
    text_h = 30
    n_rows = max(1, (len(cells) + columns - 1) // columns)
    sheet = Image.new("RGB", (columns * cell, n_rows * (cell + text_h)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for k, (img, response, answer, colour) in enumerate(cells):
        x, y = (k % columns) * cell, (k // columns) * (cell + text_h)
        if img is not None:
            img = img.convert("RGB")
            img.thumbnail((cell, cell))
            sheet.paste(img, (x + (cell - img.width) // 2, y + (cell - img.height) // 2))
        else:
            draw.rectangle((x + 2, y + 2, x + cell - 3, y + cell - 3), outline=(160, 160, 160))
            draw.text((x + 6, y + cell // 2), "no image", fill=(0, 0, 0))
        draw.text((x + 3, y + cell + 2), f"> {response[:18]}", fill=colour)
        draw.text((x + 3, y + cell + 15), f"= {answer[:18]}", fill=GOLD)
    return sheet


def write_contact_sheet(
    run_dir: str | Path,
    tag: str = "eval",
    step: int | None = None,
    limit: int = 32,
    columns: int = 8,
    cell: int = 112,
) -> Path:
    """Draw up to ``limit`` samples of one transcript file (response green when its reward
    is positive, red otherwise); returns the PNG's path."""
    run_dir = Path(run_dir)
    samples = run_dir / "samples"
    path = samples / f"{tag}_step_{step:06d}.jsonl" if step is not None else _latest(samples, tag)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    if not rows:
        raise ValueError(f"{path} holds no samples")
    cells = []
    for row in rows:
        refs = _IMAGE.findall(row.get("prompt", ""))
        found = _resolve(refs[0], run_dir) if refs else None
        img = None
        if found is not None:
            with Image.open(found) as opened:
                img = opened.convert("RGB")
        colour = MATCH if (row.get("reward") or 0) > 0 else MISS
        cells.append((img, str(row.get("response", "")), str(row.get("answer", "")), colour))
    out = path.with_suffix(".png")
    draw_sheet(cells, columns, cell).save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m polyrl.multimodal.samples", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir")
    parser.add_argument("--tag", default="eval")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--limit", type=int, default=32)
    args = parser.parse_args(argv)
    print(write_contact_sheet(args.run_dir, args.tag, args.step, args.limit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
