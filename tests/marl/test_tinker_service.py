"""The Tinker service (marl/tinker_api) driven by the official ``tinker`` client, unchanged
but for the base URL and model name, on a tiny offline model."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.tinker import pretrained_tiny, sft_datum, tinker_service  # noqa: E402

PAIRS = [("3+4=", "7"), ("2+2=", "4"), ("5+1=", "6"), ("1+8=", "9")]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    return pretrained_tiny(tmp_path_factory)


def _data(tok, pairs=PAIRS):
    out = []
    for q, a in pairs:
        prompt = tok.encode(q)
        out.append(sft_datum(prompt + tok.encode(a) + [tok.eos_token_id], len(prompt)))
    return out


def _tokens(td) -> float:
    return float(np.sum(td.loss_fn_inputs["weights"].to_numpy()))


def _step(tc, data, lr=5e-3):
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=lr))
    out = fb.result()
    opt.result()
    return out


def test_sft_loop_loss_falls(base_dir, tmp_path):
    """The documented SFT loop: forward_backward(cross_entropy) + optim_step; the mean token
    loss falls under 65 % of its start (about half, measured); the returned logprobs give the loss back."""
    with tinker_service(base_dir, tmp_path) as (sc, _):
        tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
        data = _data(tc.get_tokenizer())
        n = sum(_tokens(d) for d in data)
        losses = [_step(tc, data).metrics["loss:sum"] / n for _ in range(20)]
        result = tc.forward(data, "cross_entropy").result()
        lp = [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]
        w = [d.loss_fn_inputs["weights"].to_numpy() for d in data]
        again = -sum(float((a * b).sum()) for a, b in zip(lp, w, strict=True))
        assert again == pytest.approx(result.metrics["loss:sum"], rel=1e-5)
        assert losses[-1] < 0.65 * losses[0], losses


def test_two_clients_together_equal_each_alone(base_dir, tmp_path):
    """Two clients whose forward_backward calls arrive together share one pass, and end
    with the weights (probe log-probs) that training each alone gives."""
    with tinker_service(base_dir, tmp_path, batch_window_ms=100.0) as (sc, run):
        tok = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        tok = tok.get_tokenizer()
        data_a, data_b = _data(tok, PAIRS[:2]), _data(tok, PAIRS[2:] + [("9+9=", "18")])
        probe = _data(tok)
        together = [
            sc.create_lora_training_client(base_model="tiny", rank=4, seed=s).result()
            for s in (11, 12)
        ]
        for _ in range(3):
            fa = together[0].forward_backward(data_a, "cross_entropy")
            fb = together[1].forward_backward(data_b, "cross_entropy")
            oa = together[0].optim_step(types.AdamParams(learning_rate=1e-2))
            ob = together[1].optim_step(types.AdamParams(learning_rate=1e-2))
            for f in (fa, fb, oa, ob):
                f.result()
        assert 2 in run.service.passes  # the two calls did run as one pass
        alone = []
        for seed, data in ((11, data_a), (12, data_b)):
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
            for _ in range(3):
                _step(tc, data, lr=1e-2)
            alone.append(tc)
        for t, a in zip(together, alone, strict=True):
            lt = t.forward(probe, "cross_entropy").result().loss_fn_outputs
            la = a.forward(probe, "cross_entropy").result().loss_fn_outputs
            for x, y in zip(lt, la, strict=True):
                np.testing.assert_allclose(
                    x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=2e-5
                )
        # and the two adapters did learn apart: different log-probs on the probe
        l0 = together[0].forward(probe, "cross_entropy").result().metrics["loss:sum"]
        l1 = together[1].forward(probe, "cross_entropy").result().metrics["loss:sum"]
        assert abs(l0 - l1) > 1e-3


def test_save_load_state_resumes_exactly(base_dir, tmp_path):
    """save_state then a client from that state with its optimizer trains on exactly as
    the original did; from the weights alone the first loss matches, the next do not
    (Adam's moments start afresh)."""
    with tinker_service(base_dir, tmp_path) as (sc, _):
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        data = _data(tc.get_tokenizer())
        for _ in range(2):
            _step(tc, data)
        path = tc.save_state("mid").result().path
        first = [_step(tc, data).metrics["loss:sum"] for _ in range(3)]
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        again = [_step(resumed, data).metrics["loss:sum"] for _ in range(3)]
        assert again == pytest.approx(first, rel=1e-6, abs=1e-6)
        fresh = sc.create_training_client_from_state(path).result()
        weights_only = [_step(fresh, data).metrics["loss:sum"] for _ in range(3)]
        assert weights_only[0] == pytest.approx(first[0], rel=1e-6)
        assert abs(weights_only[2] - first[2]) > 1e-4


def test_sampler_logprobs_match_the_training_pass(base_dir, tmp_path):
    """A sampler snapshot's compute_logprobs equals the training client's forward log-probs
    at the same weights, and a sample's own logprobs equal compute_logprobs of it."""
    with tinker_service(base_dir, tmp_path) as (sc, _):
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        tok = tc.get_tokenizer()
        data = _data(tok)
        _step(tc, data, lr=2e-2)
        sampler = tc.save_weights_and_get_sampling_client()
        seq = data[0].model_input.to_ints() + [
            int(data[0].loss_fn_inputs["target_tokens"].data[-1])
        ]
        by_sampler = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()
        by_trainer = tc.forward([data[0]], "cross_entropy").result()
        np.testing.assert_allclose(
            by_sampler[1:], by_trainer.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4
        )
        prompt = tok.encode("3+4=")
        res = sampler.sample(
            types.ModelInput.from_ints(prompt),
            3,
            types.SamplingParams(max_tokens=4, temperature=1.0, seed=7),
        ).result()
        assert len(res.sequences) == 3
        s = res.sequences[0]
        full = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + s.tokens)).result()
        np.testing.assert_allclose(full[len(prompt) :], s.logprobs, atol=1e-4)


def test_bad_requests_get_the_clients_errors(base_dir, tmp_path):
    with tinker_service(base_dir, tmp_path) as (sc, _):
        with pytest.raises(tinker.RequestFailedError, match="'nope' is not served") as e:
            sc.create_lora_training_client(base_model="nope", rank=4).result()
        assert e.value.category == types.RequestErrorCategory.User
        tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        good = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8]},
        )
        with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' is not supported"):
            tc.forward_backward([good], "dro").result()
        short = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7]},
        )
        with pytest.raises(tinker.BadRequestError, match=r"datum 0: .*'target_tokens'.* 2 values"):
            tc.forward_backward([short], "cross_entropy").result()
        with pytest.raises(
            tinker.BadRequestError, match="'ppo' needs loss_fn_inputs\\['logprobs'\\]"
        ):
            tc.forward_backward([good], "ppo").result()
        with pytest.raises(tinker.BadRequestError, match="no checkpoint at"):
            sc.create_training_client_from_state("tinker://nothing/weights/x").result()
        sampler = sc.create_sampling_client(base_model="tiny")
        with pytest.raises(tinker.BadRequestError, match="top_k"):
            sampler.sample(
                types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2, top_k=5)
            ).result()
        # the service lives on: a good request still trains
        assert tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"] > 0


def test_cli_refuses_a_bad_config(tmp_path, capsys):
    from polyrl.core.cli import main

    assert main(["serve", "tinker", "--config", str(tmp_path / "none.yaml")]) == 2
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  tiny: {tmp_path / 'missing'}\nport: 0\n")
    assert main(["serve", "tinker", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "models.tiny" in err and "no config.json" in err
