"""The ``qwen_vl`` kind's passes do not route experts, so ``moe`` options on it are refused
before any weights load (they were accepted without a word)."""

from __future__ import annotations

import pytest

from polyrl.core.config import ConfigError
from polyrl.core.train.moe import MoeConfig
from polyrl.core.train.policy import PolicyConfig


@pytest.mark.parametrize("moe", [MoeConfig(replay="rollout"), MoeConfig(aux_loss_coef=0.01)])
def test_moe_options_on_qwen_vl_are_refused_before_loading(tmp_path, moe):
    from polyrl.multimodal.policy import QwenVLPolicy

    cfg = PolicyConfig(model=str(tmp_path / "absent"), kind="qwen_vl", moe=moe)
    with pytest.raises(ConfigError, match=r"policies\.actor\.moe .*qwen_vl .*remove the moe"):
        QwenVLPolicy("actor", cfg, total_steps=1, need_reference=False)
