"""Family detection through the registry, and the tiny builders' shared refusals (no model
is loaded or built here)."""

from __future__ import annotations

import json

import pytest


def _checkpoint(tmp_path, **config):
    (tmp_path / "transformer").mkdir(parents=True)
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_each_builtin_family_claims_its_own_transformer_class(tmp_path):
    import polyrl.diffusion  # noqa: F401
    from polyrl.diffusion.families import FAMILIES, detect_family

    classes = {
        "sd3": "SD3Transformer2DModel",
        "flux": "FluxTransformer2DModel",
        "qwen_image": "QwenImageTransformer2DModel",
        "wan": "WanTransformer3DModel",
    }
    assert sorted(FAMILIES) == sorted(classes)
    for name, cls in classes.items():
        assert detect_family(_checkpoint(tmp_path / name, _class_name=cls)) == name


def test_a_registered_family_is_found_by_its_own_rule(tmp_path, monkeypatch):
    """Detection asks every registered family; an unclaimed checkpoint names the classes
    the registered families serve; two claimants are an error, not a silent pick."""
    import polyrl.diffusion  # noqa: F401
    from polyrl.diffusion.families import FAMILIES, detect_family

    path = _checkpoint(tmp_path, _class_name="TinyDiT", depth=3)
    with pytest.raises(ValueError, match=r"unsupported transformer class 'TinyDiT'.*Wan"):
        detect_family(path)

    class Deep3:
        @classmethod
        def matches(cls, config):
            return config.get("depth") == 3

    # the registry has no unregister: its table is patched for this test only
    monkeypatch.setitem(FAMILIES._items, "deep3", Deep3)
    assert detect_family(path) == "deep3"
    monkeypatch.setitem(FAMILIES._items, "deep3_again", Deep3)
    with pytest.raises(ValueError, match="all claim"):
        detect_family(path)


def test_a_folder_without_a_transformer_is_named(tmp_path):
    from polyrl.diffusion.families import detect_family

    with pytest.raises(FileNotFoundError, match="transformer/ folder"):
        detect_family(str(tmp_path))


@pytest.mark.parametrize(
    "builder,args,match",
    [
        ("tiny_sd3", {"corpus": "colour_video"}, "tiny_sd3 pre-trains on the colour task only"),
        (
            "tiny_qwen_image",
            {"vae": "qwen"},
            "tiny_qwen_image pre-trains on the colour task with vae: patch only",
        ),
        ("tiny_wan", {"vae": "wan"}, "tiny_wan pre-trains on the colour_video task with vae"),
    ],
)
def test_pretraining_is_refused_where_it_cannot_run(tmp_path, builder, args, match):
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.registry import MODELS

    with pytest.raises(ValueError, match=match):
        MODELS.get(builder)(tmp_path / "m", pretrain_steps=1, **args)
    assert not (tmp_path / "m").exists()  # refused before anything was written
