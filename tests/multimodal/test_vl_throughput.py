"""tokens/s and MFU of the VL demo (``examples/vl_shapes_grpo.yaml``): one step against
the hand count, the vision tower's FLOPs over each row's image included."""

from __future__ import annotations

from pathlib import Path

from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.recipe import Config
from tests.helpers.throughput import ONE_PASS, Cost, check_by_hand, linear_weights

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "vl_shapes_grpo.yaml"


def test_a_vl_runs_step_against_the_hand_count(tiny_vl_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    cfg = load(
        Config,
        str(RECIPE),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            f"task.dir={tmp_path}/data",
            "task.args={n_train: 16, n_eval: 4, question: colour, size: 112, distractors: 0}",
            f"policies.main.model={tiny_vl_dir}",
            "policies.main.build=null",
            "policies.main.build_args=null",
            "sft.steps=0",
            "eval.every=0",
            "train.steps=1",
            "rollout.n=2",
            "rollout.prompts_per_step=4",
            *ONE_PASS,
        ],
    )
    run = train(cfg)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    text, v = model.config.text_config, model.config.vision_config
    visual = model.model.visual
    # the language model: every Linear but the tower's (LM head included)
    weights = linear_weights(model) - linear_weights(visual)
    width = text.num_attention_heads * (
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    )
    # the tower by hand: a 112-pixel square image (the demo's max_pixels) is an 8 x 8 grid of
    # 14-pixel patches, 16 groups of 2 x 2 for the merger; one 112-pixel window holds it all
    patches, h = (112 // v.patch_size) ** 2, v.hidden_size
    embed = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h
    block = 3 * h * h + h * h + 3 * h * v.intermediate_size  # qkv, proj, gated MLP
    merged = h * v.spatial_merge_size**2
    merger = merged * merged + merged * v.out_hidden_size
    tower = (
        2 * (embed + v.depth * block) * patches
        + 2 * merger * patches // v.spatial_merge_size**2
        + v.depth * 4 * patches * patches * h
    )
    # the tower trains (no freeze_vision, no LoRA): three passes of it, like the LM's
    check_by_hand(run.path, {"main": Cost(weights, text.num_hidden_layers, width, tower)})
