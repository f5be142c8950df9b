"""`polyrl plot`: one PNG per panel that has data, from a run's metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from polyrl.core.observe.plot import plot_run, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + "\n")  # a trailing blank line is skipped


def test_each_panel_with_data_becomes_a_png(tmp_path):
    run = tmp_path / "run"
    write_metrics(
        run,
        [
            {"step": 0, "time": 1.0, "reward/mean": 0.1, "eval_init/accuracy": 0.2},
            {"step": 1, "time": 2.0, "reward/mean": 0.3, "main/kl": 0.01, "main/entropy": None},
            {"step": 2, "time": 3.0, "reward/mean": 0.5, "main/kl": 0.02, "eval/accuracy": 0.4},
        ],
    )
    written = plot_run(run)
    # entropy has only a null value, and no length or loss key is present
    assert [p.name for p in written] == ["reward.png", "accuracy.png", "kl.png"]
    for path in written:
        assert path.parent == run / "plots"
        assert path.read_bytes()[:8] == PNG_SIGNATURE

    import matplotlib.image

    image = matplotlib.image.imread(run / "plots" / "reward.png")
    assert image.shape[:2] == (350, 600)  # figsize (6, 3.5) at 100 dpi


def test_plotting_again_overwrites_the_plots(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.2}])
    first = plot_run(run)[0].read_bytes()
    write_metrics(run, [{"step": s, "reward/mean": s / 10, "sft/loss": 1.0} for s in range(20)])
    written = plot_run(run)
    assert [p.name for p in written] == ["reward.png", "loss.png"]
    assert written[0].read_bytes() != first


def test_a_directory_without_metrics_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="is .* a PolyRL run directory"):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_read_metrics_returns_one_dict_per_line(tmp_path):
    write_metrics(tmp_path, [{"step": 0, "a": 1}, {"step": 1, "a": 2}])
    assert read_metrics(tmp_path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]
