"""Contact sheets of a team that paints: one line per joint action with a painting, showing
what each member saw and did (the row's task, the texts before the painting, the image,
the texts after it), written at every evaluation of a workflow with
painters (``samples/contact_<k>.png``; the first also ``contact_before.png``, the latest
``contact_after.png`` in the run directory). Rewards come later (the reward terms score
the record), so a sheet shows what the members did, not what it earned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

TILE = 64  # pixels of each painting on the sheet
LINE = 12  # pixels per text line


def sheet_lines(episodes: list, limit: int = 32) -> list[dict]:
    """(task, before, image, after) of at most ``limit`` joint actions holding a painting,
    as many from each episode (the first ones), so every goal shows."""
    out = []
    each = max(1, limit // max(1, len(episodes)))
    for ep in episodes:
        mine = [j for j in ep.joints if any(m.painting is not None for m in j.messages)]
        for j in mine[:each]:
            pics = [m for m in j.messages if m.painting is not None]
            at = j.messages.index(pics[0])
            out.append(
                {
                    "task": str(ep.task),
                    "before": [f"{m.agent}: {m.text.strip()}" for m in j.messages[:at]],
                    "image": pics[0].to_pil(),
                    "after": [f"{m.agent}: {m.text.strip()}" for m in j.messages[at + 1 :]],
                }
            )
            if len(out) >= limit:
                return out
    return out


def draw_sheet(lines: list[dict], width: int = 420) -> Image.Image:
    """One PNG: a line per joint action, its image on the left, the texts beside it."""
    height = max(1, len(lines)) * (TILE + 4) + 4
    sheet = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(sheet)
    for k, line in enumerate(lines):
        y = 4 + k * (TILE + 4)
        sheet.paste(line["image"].resize((TILE, TILE), Image.NEAREST), (4, y))
        texts = [f"goal: {line['task']}", *line["before"], *line["after"]]
        for i, t in enumerate(texts[: TILE // LINE]):
            pen.text((TILE + 12, y + i * LINE), t[:60], fill="black")
    return sheet


def write_sheet(run_dir: Any, episodes: list, serial: int) -> Path:
    """``samples/contact_<serial>.png``, and ``contact_before.png`` (first) /
    ``contact_after.png`` (latest) in the run directory."""
    run = Path(run_dir)
    out = run / "samples" / f"contact_{serial:06d}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet = draw_sheet(sheet_lines(episodes))
    sheet.save(out)
    if not (run / "contact_before.png").exists():
        sheet.save(run / "contact_before.png")
    sheet.save(run / "contact_after.png")
    return out
