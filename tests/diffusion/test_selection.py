"""Training-step selection: fraction, fixed window, sliding window; never the last step."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.diffusion.selection import StepSelection, noise_mask, select_steps, window_start


def test_all_trains_every_step_but_the_last():
    m = select_steps(StepSelection(mode="all"), 3, 10)
    assert m[:, :9].all() and not m[:, 9].any()


def test_fraction_draws_steps_per_trajectory():
    gen = torch.Generator().manual_seed(0)
    m = select_steps(StepSelection(mode="fraction", fraction=0.5), 64, 11, generator=gen)
    assert (m.sum(1) == 5).all() and not m[:, 10].any()
    assert len({tuple(r.tolist()) for r in m}) > 10  # different steps per trajectory
    assert m[:, :10].any(0).all()  # every trainable step gets drawn by someone


def test_fixed_window():
    m = select_steps(StepSelection(mode="window", window_start=3, window_size=2), 2, 10, rollout=57)
    assert m[:, 3:5].all() and m.sum() == 4


def test_window_is_cut_before_the_last_step():
    m = select_steps(StepSelection(mode="window", window_start=7, window_size=4), 1, 10)
    assert m[0, 7:9].all() and m.sum() == 2 and not m[0, 9]


def test_sliding_window_moves_with_training_and_wraps():
    sel = StepSelection(mode="sliding", window_start=0, window_size=2, stride=2, shift_every=3)
    starts = [window_start(sel, 10, k) for k in range(18)]
    # windows [0,1], [2,3], [4,5], [6,7] (trainable steps 0..8), each for 3 rollouts, then wrap
    assert starts == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3 + [0] * 3 + [2] * 3
    for k in range(18):
        m = select_steps(sel, 1, 10, rollout=k)
        assert m.sum() == 2 and not m[0, 9]


def test_noise_outside_the_window():
    trained = select_steps(StepSelection(mode="window", window_size=2), 2, 6)
    assert noise_mask(StepSelection(noise_outside=True), trained).all()
    assert torch.equal(noise_mask(StepSelection(noise_outside=False), trained), trained)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"mode": "slidng"}, "did you mean 'sliding'"),
        ({"fraction": 0.0}, "fraction"),
        ({"mode": "window", "window_start": 9}, "window_start"),
        ({"window_size": 0}, "window_size"),
    ],
)
def test_bad_selection_fails(kw, match):
    with pytest.raises(ConfigError, match=match):
        StepSelection(**kw).validate(10)
