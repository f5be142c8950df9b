"""The Tinker service (marl/tinker_api) driven by the official ``tinker`` client, unchanged
but for the base URL and model name, on a tiny offline model."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.tinker import API_KEY, pretrained_tiny, sft_datum, tinker_service  # noqa: E402

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


def _rl_datum(prompt: list[int], seq, advantage: float):
    """The cookbook's RL datum: prompt + completion shifted one against the targets, the
    sampler's log-probs and the advantage on the completion tokens, zero on the prompt."""
    full, ob = prompt + list(seq.tokens), len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * ob + list(seq.logprobs),
            "advantages": [0.0] * ob + [advantage] * len(seq.tokens),
        },
    )


@pytest.mark.learning
def test_rl_loop_reward_rises(base_dir, tmp_path):
    """The cookbook's minimal RL loop, unchanged but for the base URL: each step a sampler
    of the current weights (save_weights_and_get_sampling_client), 8 samples of 6 tokens
    for each of four prompts whose answer is 7, reward the share of "7" tokens, advantage
    reward minus its group's mean, forward_backward(importance_sampling), optim_step.
    The client's default LoRA trains the unembedding too (train_unembed), without which a
    tiny base caps the logits. Measured, mean reward of the first 3 / last 3 steps, under
    ATEN_CPU_CAPABILITY default and avx2 (the same curves): this seed 0.01 / 0.93; seeds
    1-3 (service, LoRA and sampling seeds shifted) 0.00-0.02 / 0.48-1.00. Bars 0.1 / 0.3."""
    with tinker_service(base_dir, tmp_path) as (sc, _):
        tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
        tok = tc.get_tokenizer()
        (seven,) = tok.encode("7")
        prompts = [tok.encode(f"{a}+{b}=") for a, b in ((3, 4), (2, 5), (1, 6), (5, 2))]
        curve = []
        for step in range(25):
            sampler = tc.save_weights_and_get_sampling_client().result()
            futures = [
                sampler.sample(
                    types.ModelInput.from_ints(p),
                    8,
                    types.SamplingParams(max_tokens=6, temperature=1.0, seed=10 * step + i),
                )
                for i, p in enumerate(prompts)
            ]
            data, rewards = [], []
            for prompt, future in zip(prompts, futures, strict=True):
                seqs = future.result().sequences
                group = [float(np.mean([t == seven for t in s.tokens])) for s in seqs]
                rewards += group
                data += [
                    _rl_datum(prompt, s, r - float(np.mean(group)))
                    for s, r in zip(seqs, group, strict=True)
                ]
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(types.AdamParams(learning_rate=3e-3))
            fb.result()
            opt.result()
            curve.append(float(np.mean(rewards)))
        assert np.mean(curve[:3]) < 0.1, curve
        assert np.mean(curve[-3:]) > 0.3, curve


def test_policy_losses_equal_a_hand_computation(base_dir, tmp_path):
    """importance_sampling and ppo: the loss is the sum over tokens of -(ratio * A) (ppo:
    clipped), ratio exp(logp - sampler logp), and the adapter's gradient (the unembedding's
    LoRA included) equals the same formula's through plain PEFT on the same weights."""
    import torch

    with tinker_service(base_dir, tmp_path) as (sc, run):
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        _step(tc, _data(tc.get_tokenizer()), lr=1e-2)  # LoRA B off zero: A gets gradient too
        rng = np.random.default_rng(0)
        rows = []
        for n in (7, 4, 9):
            toks = rng.integers(3, 100, n + 1).tolist()
            q = rng.normal(-3, 1, n).astype(np.float32)
            adv = rng.normal(0, 1, n).astype(np.float32)
            rows.append((toks, q, adv))
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={"target_tokens": t[1:], "logprobs": q, "advantages": a},
            )
            for t, q, a in rows
        ]
        service = run.service
        client = next(iter(service.clients.values()))
        assert service.bases["tiny"].unembed in service.client_targets[client.model_id]
        peft = service.bases["tiny"].peft
        unembed = {  # the unembedding's LoRA A and B of this client
            id(p)
            for k, p in peft.named_parameters()
            if f"{service.bases['tiny'].unembed}.lora_" in k and f".{client.adapter}." in k
        }
        for loss in ("importance_sampling", "ppo"):
            out = tc.forward_backward(data, loss).result()
            served = [p.grad.clone() for p in client.params]
            for p in client.params:
                p.grad = None
            total = torch.zeros(())
            peft.set_adapter(client.adapter)
            for (t, q, a), o in zip(rows, out.loss_fn_outputs, strict=True):
                logits = peft(input_ids=torch.tensor([t[:-1]])).logits[0].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t[1:])[:, None])[:, 0]
                ratio, adv = torch.exp(lp - torch.from_numpy(q)), torch.from_numpy(a)
                per = -ratio * adv
                if loss == "ppo":
                    per = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
                np.testing.assert_allclose(
                    o["elementwise_loss"].to_numpy(), per.detach(), atol=1e-5
                )
                total = total + per.sum()
            assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5)
            total.backward()
            for p, g in zip(client.params, served, strict=True):
                torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)
                p.grad = None
            head = [g for p, g in zip(client.params, served, strict=True) if id(p) in unembed]
            assert len(head) == 2 and all(float(g.abs().max()) > 0 for g in head)


def test_custom_loss_trains_as_the_builtin_one(base_dir, tmp_path):
    """forward_backward_custom (the client's loss on forward's log-probs, sent back as
    cross-entropy weights) with the cross-entropy written by hand moves the weights as
    forward_backward(cross_entropy) does."""

    def ce(data, logprobs):
        w = [d.loss_fn_inputs["weights"].to_torch() for d in data]
        loss = -sum((lp * wi).sum() for lp, wi in zip(logprobs, w, strict=True))
        return loss, {"ce": float(loss)}

    with tinker_service(base_dir, tmp_path) as (sc, _):
        a, b = (
            sc.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
            for _ in range(2)
        )
        data = _data(a.get_tokenizer())
        for _ in range(2):
            ra = a.forward_backward_custom(data, ce).result()
            a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            rb = _step(b, data, lr=1e-2)
            assert ra.metrics["ce"] == pytest.approx(rb.metrics["loss:sum"], rel=1e-5)
        la = a.forward(data, "cross_entropy").result().metrics["loss:sum"]
        lb = b.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert la == pytest.approx(lb, rel=1e-5) and la < rb.metrics["loss:sum"]


def test_unreachable_samplers_are_freed(base_dir, tmp_path):
    """Memory grows with adapters, not with sampler versions: a client keeps its last
    ``sampler_snapshots`` snapshots (an older one's request says it was freed), samplers
    of one checkpoint share its adapter, and a finished session's clients and samplers
    go; train_unembed=False gives an adapter without the unembedding."""
    with tinker_service(base_dir, tmp_path, sampler_snapshots=2) as (sc, run):
        peft_adapters = lambda: set(run.service.bases["tiny"].peft.peft_config)  # noqa: E731
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode("3+4="))
        params = types.SamplingParams(max_tokens=2, seed=0)
        first = tc.save_weights_and_get_sampling_client().result()
        first.sample(prompt, 1, params).result()
        for _ in range(4):
            last = tc.save_weights_and_get_sampling_client().result()
        assert len(peft_adapters()) == 1 + 1 + 2  # the base's own, the client, 2 snapshots
        with pytest.raises(tinker.BadRequestError, match="was freed: .*last 2 snapshot"):
            first.sample(prompt, 1, params).result()
        assert len(last.sample(prompt, 2, params).result().sequences) == 2
        path = tc.save_weights_for_sampler("ckpt").result().path
        for _ in range(3):
            sampler = sc.create_sampling_client(model_path=path).result()
            sampler.sample(prompt, 1, params).result()
        assert len(peft_adapters()) == 1 + 1 + 2 + 1  # one adapter for the checkpoint
        early = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        before = early.compute_logprobs(prompt).result()
        _step(tc, _data(tc.get_tokenizer()), lr=1e-2)
        late = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        assert len(peft_adapters()) == 5 + 1  # inflight samplers share the client's one
        now = early.compute_logprobs(prompt).result()
        assert now[1:] == late.compute_logprobs(prompt).result()[1:] != before[1:]

        with tinker.ServiceClient(base_url=run.url, api_key=API_KEY) as other:
            oc = other.create_lora_training_client(
                base_model="tiny", rank=2, train_unembed=False
            ).result()
            oc.save_weights_and_get_sampling_client().result()
            mid = next(m for m, c in run.service.clients.items() if c.rank == 2)
            assert run.service.bases["tiny"].unembed not in run.service.client_targets[mid]
            assert len(peft_adapters()) == 6 + 2
        assert len(peft_adapters()) == 6  # its session finished: its client and sampler went
        assert mid not in run.service.clients


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
    from polyrl.core.runner.cli import main

    assert main(["serve", "tinker", "--config", str(tmp_path / "none.yaml")]) == 2
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  tiny: {tmp_path / 'missing'}\nport: 0\n")
    assert main(["serve", "tinker", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "models.tiny" in err and "no config.json" in err
