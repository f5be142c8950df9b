"""The Qwen-Image family: QwenImagePipeline reproduced (prompt template, true CFG, σ's),
exact log-probs, LoRA export, a run that trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.diffusion_runs import (
    EXAMPLES,
    build_model,
    check_colour_learns,
    run_recipe,
    wait,
)

PROMPTS = ["a red blob", "a blue circle", "green", "a yellow blob"]
GPU_RECIPE = "diffusion_qwen_image_pickscore_lora.yaml"
QWEN_ARGS = {"steps": 4, "guidance_scale": 4.0, "negative_prompt": " "}


@pytest.fixture(scope="module")
def tiny_qwen_dir(tmp_path_factory) -> str:
    """An untrained tiny Qwen-Image (QwenImagePipeline layout, tiny Qwen2.5-VL, PatchVideoVAE)."""
    from polyrl.diffusion.tiny import tiny_qwen_image

    path = tmp_path_factory.mktemp("models") / "tiny-qwen-image"
    tiny_qwen_image(path, seed=0)
    return str(path)


@pytest.fixture
def qwen_policy(make_policy, tiny_qwen_dir):
    def make(**kw):
        args = dict(QWEN_ARGS, model=tiny_qwen_dir, max_sequence_length=16)
        args.update(kw)
        return make_policy(**args)

    return make


def _pipeline(path, transformer=None):
    from diffusers import QwenImagePipeline

    kw = {} if transformer is None else {"transformer": transformer}
    pipe = QwenImagePipeline.from_pretrained(path, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_prompt_template_and_embeddings_are_the_pipelines(tiny_qwen_dir, qwen_policy):
    """The tokenizer splits the template's system part into exactly the tokens the pipeline
    drops; the family's embeddings are the pipeline's, zero-padded, with their mask."""
    policy, _ = qwen_policy()
    pipe = _pipeline(tiny_qwen_dir, policy.family.transformer)
    template = pipe.prompt_template_encode
    drop = pipe.prompt_template_encode_start_idx
    ids = pipe.tokenizer(template.format("a red blob")).input_ids
    assert pipe.tokenizer.decode(ids[:drop]) == template.split("{}")[0]
    kept = pipe.tokenizer.convert_ids_to_tokens(ids[drop:])
    assert kept == ["a", "Ġred", "Ġblob", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    emb, mask = policy.family.encode(PROMPTS)
    ref, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=16)
    lengths = [8, 8, 6, 8]  # prompt words + the template's 5 closing tokens
    assert emb.shape == (4, 16, 32) and mask.sum(1).tolist() == lengths
    assert ref_mask.sum(1).tolist() == lengths  # the pipeline pads to its longest prompt
    assert torch.equal(emb[:, : ref.shape[1]], ref) and not emb[:, ref.shape[1] :].any()
    assert not emb[2, 6:].any()  # "green": padding is zeros
    # a prompt encoded alone or in a batch: the same valid-token embeddings
    alone, _ = policy.family.encode(["green"])
    torch.testing.assert_close(alone[0, :6], emb[2, :6], rtol=1e-5, atol=1e-6)
    # the data's tokenizer renders a prompt as plain text (the family adds the template)
    assert policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a red blob"}], tokenize=False
    ) == ("a red blob")


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_reproduces_qwen_image_pipeline(qwen_policy, tiny_qwen_dir, guidance):
    """Noise off: every latent of the engine's trajectory equals QwenImagePipeline's own
    (prompt strings encoded by the pipeline, same starting noise, true CFG with its
    rescale at 4, none at 1), and so does the decoded image."""
    from polyrl.diffusion.packed import pack_latents, unpack_latents

    policy, engine = qwen_policy(guidance_scale=guidance, cfg_batch=False)
    traj = engine.sample(PROMPTS, n=1, deterministic=True)
    pipe = _pipeline(tiny_qwen_dir, policy.family.transformer)
    seen = []

    def keep(pipeline, i, t, kw):
        seen.append(unpack_latents(kw["latents"], 8, 8))
        return {}

    common = dict(
        prompt=PROMPTS,
        negative_prompt=[" "] * 4 if guidance > 1 else None,
        true_cfg_scale=guidance,
        latents=pack_latents(traj.latents[:, 0]),
        num_inference_steps=4,
        height=16,
        width=16,
        max_sequence_length=16,
    )
    with torch.no_grad():
        out = pipe(**common, output_type="latent", callback_on_step_end=keep).images
        image = pipe(**common, output_type="pt").images
    assert torch.equal(pipe.scheduler.sigmas, traj.sigmas[0])  # dynamic, exponential, terminal
    assert torch.equal(pipe.scheduler.timesteps, traj.timesteps[0])
    assert abs(float(traj.sigmas[0, -2]) - 0.02) < 1e-6  # shift_terminal
    for t, lat in enumerate(seen):
        assert torch.equal(lat, traj.latents[:, t + 1]), f"step {t}"
    assert torch.equal(unpack_latents(out, 8, 8), traj.latents[:, -1])
    torch.testing.assert_close(engine.decode(traj.latents[:, -1]), image, rtol=0, atol=1e-6)


def test_true_cfg_rescale_against_a_hand_computation():
    """Each 2x2 patch of the guided velocity (all channels: a packed token) takes the norm
    of the conditional velocity's same patch."""
    from polyrl.diffusion.packed import QwenImageFamily

    g = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    c = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    out = QwenImageFamily.rescale_cfg(g, c)
    want = g.clone()
    for b in range(2):
        for i in range(0, 4, 2):
            for j in range(0, 6, 2):
                gp, cp = g[b, :, i : i + 2, j : j + 2], c[b, :, i : i + 2, j : j + 2]
                ratio = cp.pow(2).sum().sqrt() / gp.pow(2).sum().sqrt()
                want[b, :, i : i + 2, j : j + 2] = gp * ratio
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sampler,level", [("flow_sde", 0.7), ("cps", 0.7)])
def test_recomputed_logprobs_equal_the_rollouts(qwen_policy, record_of, sampler, level):
    """First PPO ratio exactly 1 (true CFG, two calls as in training); the LoRA reference
    (adapter off) equals the policy; the mask travels in the pooled slot."""
    policy, engine = qwen_policy(
        lora=4, need_reference=True, sampler=sampler, noise_level=level, cfg_batch=False
    )
    _, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    assert mask[:, :-1].all() and not mask[:, -1].any()
    assert rec["pooled_prompt_embeds"].shape == (16, 16)  # the text masks
    assert set(rec["pooled_prompt_embeds"].unique().tolist()) == {0.0, 1.0}
    logp, _ = policy.logprobs(rec)
    assert torch.equal(logp[mask], rec["rollout_logprobs"][mask])
    assert torch.all(torch.exp(logp[mask] - rec["rollout_logprobs"][mask]) == 1.0)
    assert logp.requires_grad
    assert torch.equal(policy.ref_logprobs(rec), logp.detach())


def test_batched_cfg_agrees_to_rounding(qwen_policy, record_of):
    """Both branches in one call (cond and negative prompts padded to one length, masked):
    the same log-probs to float32 rounding."""
    policy, engine = qwen_policy(sampler="flow_sde", noise_level=0.7)
    _, rec = record_of(policy, engine)
    mask = rec["loss_mask"].bool()
    with torch.no_grad():
        logp, _ = policy.logprobs(rec)
    torch.testing.assert_close(logp[mask], rec["rollout_logprobs"][mask], rtol=1e-5, atol=1e-5)


def test_export_lora_loads_into_qwen_image_pipeline(qwen_policy, tiny_qwen_dir, tmp_path):
    policy, _ = qwen_policy(lora=4)
    names = [n for n, _ in policy.model.named_parameters() if "lora_A" in n]
    assert any("add_q_proj" in n for n in names) and any("attn.to_q" in n for n in names)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    out = policy.export(tmp_path / "lora")
    pipe = _pipeline(tiny_qwen_dir)
    pipe.load_lora_weights(str(out), weight_name="pytorch_lora_weights.safetensors")
    x, t = torch.randn(1, 12, 8, 8), torch.full((1,), 500.0)
    emb, mask = policy.encode(["a red blob"])
    fam = policy.family
    with torch.no_grad():
        a = fam.velocity(policy.model, x, t, emb, mask)
        b = fam.velocity(pipe.transformer, x, t, emb, mask)
        with policy.model.disable_adapter():
            base = fam.velocity(policy.model, x, t, emb, mask)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(a, base)


def test_random_qwen_vae_decodes_with_the_pipelines_normalisation(tmp_path):
    """With a (random) AutoencoderKLQwenImage whose statistics are not 0/1, the family's
    decode equals the pipeline's own decoding of the same latents."""
    from polyrl.diffusion.packed import QwenImageFamily, pack_latents, unpack_latents
    from polyrl.diffusion.tiny import tiny_qwen_image

    path = str(tiny_qwen_image(tmp_path / "qwen-vae", vae="qwen", seed=1))
    fam = QwenImageFamily(path, dtype=torch.float32, device=torch.device("cpu"))
    assert fam.latent_shape(16, 16) == (4, 8, 8)
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    pipe = _pipeline(path, fam.transformer)
    common = dict(
        prompt=["red", "blue"],
        latents=pack_latents(z),
        num_inference_steps=2,
        true_cfg_scale=1.0,
        height=16,
        width=16,
    )
    with torch.no_grad():
        final = pipe(**common, output_type="latent").images
        ref = pipe(**common, output_type="pt").images
    torch.testing.assert_close(fam.decode(unpack_latents(final, 8, 8)), ref, rtol=0, atol=1e-6)


def test_qwen_image_needs_its_text_encoder(tiny_qwen_dir):
    from polyrl.diffusion.families import detect_family
    from polyrl.diffusion.packed import QwenImageFamily

    assert detect_family(tiny_qwen_dir) == "qwen_image"
    with pytest.raises(ValueError, match="Qwen2.5-VL"):
        QwenImageFamily(
            tiny_qwen_dir, dtype=torch.float32, device=torch.device("cpu"), load_t5=False
        )


def test_an_edit_checkpoint_is_refused(tiny_qwen_dir, tmp_path):
    """Same transformer class, another pipeline: the error names model_index.json."""
    import shutil

    from polyrl.diffusion.packed import QwenImageFamily

    edit = tmp_path / "edit"
    shutil.copytree(tiny_qwen_dir, edit)
    index = json.loads((edit / "model_index.json").read_text())
    index["_class_name"] = "QwenImageEditPipeline"
    (edit / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model_index.json names 'QwenImageEditPipeline'"):
        QwenImageFamily(str(edit), dtype=torch.float32, device=torch.device("cpu"))


def test_gpu_recipe_loads_and_validates_without_models(monkeypatch):
    """examples/diffusion_qwen_image_pickscore_lora.yaml (never run here) loads and
    validates; no model is loaded doing so."""
    import polyrl.core  # noqa: F401
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.diffusion import models
    from polyrl.diffusion.engine import sampling_options
    from polyrl.diffusion.policy import policy_options

    def no_load(*a, **k):
        raise AssertionError("a model was loaded while validating a recipe")

    for family in models.FAMILIES:
        monkeypatch.setattr(models.FAMILIES.get(family), "__init__", no_load)
    cfg = load(Config, Path(__file__).parents[2] / "examples" / GPU_RECIPE)
    cfg.validate()
    main = cfg.policies["main"]
    assert (main.model, main.dtype, main.lora.r) == ("Qwen/Qwen-Image", "bfloat16", 32)
    sampling = sampling_options(main, "main")
    assert (sampling.guidance_scale, sampling.negative_prompt) == (4.0, " ")
    assert policy_options(main, "main").max_sequence_length == 256
    assert [t.name for t in cfg.reward.terms] == ["pickscore"]
    assert cfg.algorithm.kl_estimator == "gaussian_mean"


def test_two_training_steps_change_the_transformer(tiny_qwen_dir, two_step_run):
    from safetensors.torch import load_file

    run, steps = two_step_run(
        tiny_qwen_dir,
        "{height: 16, width: 16, steps: 4, guidance_scale: 4.0, negative_prompt: ' ', "
        "train_steps: {mode: window, window_start: 0, window_size: 2}}",
        "policies.main.args={max_sequence_length: 16}",
    )
    assert len(steps) == 2 and all(x["rollout/rows"] == 6 for x in steps)
    assert all(x["main/kl"] is not None and x["main/kl"] >= 0 for x in steps)
    assert (run.path / "grid_after.png").is_file()
    lora = load_file(run.path / "export" / "main" / "pytorch_lora_weights.safetensors")
    b = [v for k, v in lora.items() if "lora_B" in k]
    assert b and any(v.abs().max() > 0 for v in b)  # lora_B starts at zero: the update moved it


# --- the colour demo learns (examples/diffusion_qwen_image_colour.yaml) -------------------
# Three seeds under ``seeds``; CI skips it for time (about 150 CPU-seconds for seed 0 with
# the build). The mechanics above (the pipeline's ODE, log-probs, two training steps) are CI's.

RECIPE = EXAMPLES / "diffusion_qwen_image_colour.yaml"


@pytest.fixture(scope="module")
def demo_qwen(tmp_path_factory) -> str:
    """The recipe's tiny Qwen-Image, built and pre-trained once (one thread)."""
    return build_model(RECIPE, tmp_path_factory, "qwen-colour")


def _check_learns(model: str, root: Path, seeds) -> None:
    """Each seed lifts the colour reward by > 0.4 and ends naming the colour right >= 90%."""
    wait({s: run_recipe(RECIPE, model, root / f"seed{s}", s) for s in seeds})
    for seed in seeds:
        check_colour_learns(root / f"seed{seed}", seed)


@pytest.mark.learning
@pytest.mark.seeds
def test_grpo_learns_the_prompt_colour_three_seeds(demo_qwen, tmp_path):
    _check_learns(demo_qwen, tmp_path, (0, 1, 2))


# --- Ray: the first update equals local mode's (as tests/diffusion/test_flux_ray.py) --------


@pytest.mark.ray
def test_first_update_under_ray_matches_local(first_update_under_ray, tiny_qwen_dir):
    """Tiny Qwen-Image with true CFG under Ray: the first update equals local mode's, and
    the engine actor samples with the trained weights after the sync."""
    first_update_under_ray(
        f"policies.main.model={tiny_qwen_dir}",
        "policies.main.engine.args={height: 16, width: 16, steps: 4, guidance_scale: 4.0, "
        "negative_prompt: ' ', train_steps: {mode: window, window_start: 0, window_size: 2}}",
        "policies.main.args={max_sequence_length: 16}",
    )
