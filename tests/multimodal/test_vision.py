"""The VL forward pass: prompt ids, M-RoPE positions, shared vision passes, text-only safety."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import set_strings, strings, text_record
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.rollout.workflow import Context
from polyrl.multimodal import forward, vision
from polyrl.multimodal.engine import VLEngine
from polyrl.multimodal.tiny import mrope_section
from polyrl.multimodal.workflow import VLSingleTurn


def _workflow(policy, n_seed: int = 0) -> VLSingleTurn:
    engine = VLEngine(policy, seed=n_seed)
    return VLSingleTurn(Context(cfg=None, policies={"main": policy}, engines={"main": engine}))


def test_tiny_model_keeps_the_qwen2_5_vl_rules(tiny_vl_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_vl_dir)
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    assert all(i < cfg.vision_config.depth for i in cfg.vision_config.fullatt_block_indexes)
    assert mrope_section(128) == [16, 24, 24]


def test_prompt_ids_equal_the_processors_own(vl_dataset):
    """Ids built lazily from header sizes = the HF processor run on the resized images, so
    each image takes t*h*w/merge^2 placeholder tokens."""
    policy, ds = vl_dataset
    proc = policy.processor
    image_id = proc.image_token_id
    for item in ds:
        n_tokens = sum(t == image_id for t in item.prompt_ids)
        if item.vision is None:
            assert n_tokens == 0
            continue
        v, images = vision.process(item.vision, proc.image_processor)
        per_image = (v.image_grid_thw.prod(-1) // 4).tolist()
        assert n_tokens == sum(per_image) == sum(item.vision.token_counts())
        text = item.prompt_text
        for ref in item.vision.refs:
            text = text.replace(f"<image: {ref.name}>", proc.image_token, 1)
        ref_ids = proc(text=[text], images=images, do_resize=False)["input_ids"][0]
        assert list(ref_ids) == item.prompt_ids
        # and per image, in prompt order: the runs of image tokens have the grid's sizes
        runs, run = [], 0
        for t in item.prompt_ids + [-1]:
            if t == image_id:
                run += 1
            elif run:
                runs.append(run)
                run = 0
        assert runs == per_image


def test_positions_match_get_rope_index(vl_dataset, grouped_sequences):
    """Prompt + response positions (representative per group, response continued) equal
    transformers' get_rope_index over the whole left-padded sequences."""
    policy, ds = vl_dataset
    items = list(ds)
    visions = [
        vision.process(it.vision, policy.processor.image_processor)[0] if it.vision else None
        for it in items
    ]
    # groups of 2 sharing one VisionInputs; responses of different lengths, one holds a
    # sampled image-token id (which is text, not an image)
    image_id = policy.processor.image_token_id
    prompt_ids, prompt_mask, response_ids, response_mask, row_visions = grouped_sequences(
        items, visions, [7, image_id, 9]
    )
    p = forward.parts(policy.model)
    got = forward.sequence_positions(p, prompt_ids, prompt_mask, response_ids.shape[1], row_visions)
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    mm = torch.cat([prompt_ids == image_id, torch.zeros_like(response_ids, dtype=torch.bool)], 1)
    grids = torch.cat([v.image_grid_thw for v in row_visions if v is not None])
    want, _ = p.inner.get_rope_index(
        input_ids=ids, mm_token_type_ids=mm.int(), image_grid_thw=grids, attention_mask=mask
    )
    keep = mask.bool()
    for axis in range(3):
        assert torch.equal(got[axis][keep], want[axis][keep]), axis
    # the image rows really are 3-D (not plain counting)
    assert not torch.equal(got[1][keep], got[2][keep])


def test_engine_logprobs_match_the_trainers(vl_dataset, one_thread):
    """Decoding with the repeated KV cache and continued positions gives the same log-probs
    as the trainer's full forward over prompt + response."""
    policy, ds = vl_dataset
    record = _workflow(policy).rollout(list(ds), SamplingParams(n=3, max_new_tokens=5))
    with torch.no_grad():
        logp, _ = policy.logprobs(record)
    m = record["response_mask"].bool()
    assert torch.allclose(logp[m], record["rollout_logprobs"][m], atol=1e-4)


def test_a_group_processes_its_images_once(vl_dataset, one_thread):
    policy, ds = vl_dataset
    items = [it for it in ds if it.vision is not None]
    n_images = sum(len(it.vision.refs) for it in items)
    before = dict(vision.COUNTERS)
    record = _workflow(policy).rollout(items, SamplingParams(n=4, max_new_tokens=3))
    after_rollout = dict(vision.COUNTERS)
    assert record.batch_size[0] == 4 * len(items)
    assert after_rollout["images_processed"] - before.get("images_processed", 0) == n_images
    assert after_rollout["vision_images"] - before.get("vision_images", 0) == n_images
    # the group's rows share one object, and the update runs the tower once per prompt
    shared = strings(record, "vision")
    assert all(shared[4 * k] is shared[4 * k + j] for k in range(len(items)) for j in range(4))
    policy.logprobs(record)[0].sum().backward()
    after_update = dict(vision.COUNTERS)
    assert after_update["vision_passes"] - after_rollout["vision_passes"] == 1
    assert after_update["vision_images"] - after_rollout["vision_images"] == n_images
    assert after_update["images_processed"] == after_rollout["images_processed"]


def test_text_only_batch_trains_and_touches_the_vision_tower(make_policy, one_thread):
    """No images in the batch: a zero-weighted dummy pass still gives every vision weight a
    gradient (so FSDP ranks agree), and the update runs."""
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.credit import assign
    from polyrl.core.train.trainer import update

    policy = make_policy()
    tok = policy.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "How many circles?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    record = text_record(
        prompt_ids=[prompt] * 4,
        response_ids=[[5, 6], [7], [5], [8, 9]],
        rollout_logprobs=[[0.0, 0.0], [0.0], [0.0], [0.0, 0.0]],
        policy=["main"] * 4,
        uid=[0, 0, 0, 0],
        pad_id=tok.pad_token_id,
    )
    set_strings(record, "vision", [None] * 4)
    before = vision.COUNTERS["dummy_vision_passes"]
    policy.logprobs(record)[0].sum().backward()
    assert vision.COUNTERS["dummy_vision_passes"] == before + 1
    visual = forward.parts(policy.model).visual
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0.0 for p in visual.parameters())
    policy.model.zero_grad(set_to_none=True)
    record["reward"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    algo = AlgorithmConfig()
    assign(record, algo)
    out = update(policy, record, algo)
    assert out["skipped_nonfinite"] == 0.0 and out["grad_norm"] > 0


def test_freeze_vision_and_lora_targets(make_policy):
    frozen = make_policy(args={"freeze_vision": True})
    visual = forward.parts(frozen.model).visual
    assert not any(p.requires_grad for p in visual.parameters())
    assert any(p.requires_grad for p in forward.parts(frozen.model).language_model.parameters())
    in_optimizer = {id(p) for g in frozen.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_optimizer for p in visual.parameters())
    lora = make_policy(lora={"r": 4})
    names = [n for n, _ in lora.model.named_modules() if n.endswith("lora_A")]
    assert names and not any("visual" in n for n in names)
    lora_v = make_policy(lora={"r": 4}, args={"lora_vision": True})
    names_v = [n for n, _ in lora_v.model.named_modules() if n.endswith("lora_A")]
    assert any("visual" in n for n in names_v) and any("language_model" in n for n in names_v)


def test_unknown_policy_option_names_the_closest(make_policy):
    with pytest.raises(ValueError, match="freeze_vision"):
        make_policy(args={"freeze_visoin": True})


def test_sft_batch_without_vision_column_uses_row_references(vl_dataset, one_thread):
    """The core's SFT warm start builds records without the vision column; the policy
    processes the dataset row's references (once per prompt) instead."""
    policy, ds = vl_dataset
    items = [it for it in ds if it.vision is not None]
    tok = policy.tokenizer
    targets = [
        tok.encode(str(it.answer), add_special_tokens=False) + [tok.eos_token_id] for it in items
    ]
    record = text_record(
        prompt_ids=[it.prompt_ids for it in items],
        response_ids=targets,
        rollout_logprobs=[[0.0] * len(t) for t in targets],
        policy=["main"] * len(items),
        uid=[it.uid for it in items],
        pad_id=tok.pad_token_id,
        meta=[{"answer": it.answer, "row": it.row} for it in items],
    )
    logp, _ = policy.logprobs(record)
    assert torch.isfinite(logp).all()
    with_column = record.clone(recurse=False)
    set_strings(with_column, "vision", policy.vision_rows(record))
    assert torch.allclose(policy.logprobs(with_column)[0], logp)


def test_export_reloads_as_a_hugging_face_vl_model(make_policy, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = make_policy().export(tmp_path / "export")
    model = AutoModelForImageTextToText.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out)
    assert forward.parts(model).image_token_id == processor.image_token_id
    lora_out = make_policy(lora={"r": 4}).export(tmp_path / "lora")
    assert (lora_out / "adapter_config.json").is_file()
    assert (lora_out / "processor_config.json").is_file()


def test_evaluation_rollouts_draw_answers_under_their_images(vl_dataset, tmp_path, one_thread):
    """Training rollouts draw nothing; each evaluation (``phase="eval"``) writes a
    sheet of the held-out images with the first answer and the ground truth."""
    from pathlib import Path

    from PIL import Image

    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    policy, ds = vl_dataset
    recipe = Path(__file__).resolve().parents[2] / "examples" / "vl_shapes_grpo.yaml"
    cfg = load(Config, recipe, [])
    ctx = Context(
        cfg=cfg,
        policies={"main": policy},
        engines={"main": VLEngine(policy)},
        run_dir=tmp_path,
    )
    wf = VLSingleTurn(ctx)
    items = list(ds)
    wf.rollout(items, ctx.sampling())
    assert not (tmp_path / "samples").exists()
    evaluation = ctx.sampling(n=1, temperature=0.0, max_new_tokens=2)
    wf.rollout(items, evaluation, phase="eval")
    wf.rollout(items, evaluation, phase="eval")
    sheets = sorted((tmp_path / "samples").glob("eval_answers_*.png"))
    assert [p.name for p in sheets] == ["eval_answers_000000.png", "eval_answers_000001.png"]
    with Image.open(tmp_path / "answers_after.png") as sheet:
        assert sheet.size == (8 * 112, 112 + 30)  # one row of tiles: 4 prompts
        # the first tile shows the first prompt's (red) image, resized into the cell
        assert sheet.getpixel((56, 56))[0] > 150 and sheet.getpixel((56, 56))[2] < 80
    assert (tmp_path / "answers_before.png").is_file()
