import dataclasses

import pytest
import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.cache import K3Cache
from tests.numerics import away_from_init, rel_rms


@pytest.fixture(scope="module")
def tiny():
    config = K3Config.preset("tiny")
    model = away_from_init(K3ForCausalLM(config, seed=0).eval())   # so that every path is exercised
    return config, model


def test_forward_loss_and_backward_reach_every_parameter(tiny):
    config, model = tiny
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 33))
    out = model(ids, labels=ids.roll(-1, 1))
    assert out.logits is None                      # with labels the head and the loss are fused: no logits
    assert out.mtp_loss is not None
    torch.testing.assert_close(out.loss, out.main_loss + config.mtp.loss_weight * out.mtp_loss)
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert no_grad == []
    model.zero_grad(set_to_none=True)
    model.eval()


def test_the_output_carries_what_every_router_saw_in_that_call(tiny):
    config, model = tiny
    ids = torch.randint(0, config.vocab_size, (2, 17))
    routers = model.routers()
    assert routers[-1] is model.mtp.block.ffn.router   # the layers' routers in order, the MTP module's last
    top_k, experts = config.moe.top_k, config.moe.num_experts
    model.train()
    for router in routers:
        router.record_scores = True
    try:
        out = model(ids, labels=ids.roll(-1, 1))
        assert len(out.routing) == len(routers)
        for stats, tokens in zip(out.routing, [34] * (len(routers) - 1) + [32]):   # MTP: one position less
            assert int(stats.loads_E.sum()) == tokens * top_k
            assert stats.scores_TE.shape == (tokens, experts) and not stats.scores_TE.requires_grad
            assert stats.cutoff_T.shape == (tokens,) and stats.ids_TK.shape == (tokens, top_k)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        assert model(ids).routing[-1] is None                        # no labels: the MTP module did not run
        # The record spans the call: a forward hook running part of the model (as context parallelism
        # runs the MTP module) is recorded too, even one registered after the model was built.
        handle = model.register_forward_hook(lambda m, args, out: (m.mtp(out.hidden, m.embed(ids), None), None)[1])
        try:
            assert int(model(ids).routing[-1].loads_E.sum()) == 34 * top_k
        finally:
            handle.remove()
        model.eval()
        with torch.no_grad():
            routing = model(ids).routing
        assert all(s.scores_TE is None for s in routing[:-1])        # evaluation: loads only
        assert model.forward(ids).routing == ()                      # forward() alone is not a call
    finally:
        for router in routers:
            router.record_scores = False
        model.eval()


def test_cached_greedy_decode_equals_recomputing_the_full_forward(tiny):
    config, model = tiny
    prompt = torch.randint(0, config.vocab_size, (2, 11))
    cached = model.generate(prompt, max_new_tokens=24)
    ids = prompt
    with torch.no_grad():
        for _ in range(24):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_chunked_prefill_through_the_cache_equals_one_forward(tiny):
    config, model = tiny
    ids = torch.randint(0, config.vocab_size, (2, 90))
    with torch.no_grad():
        full = model(ids).logits
        cache = K3Cache.allocate(config, 2, 90)
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 40), (40, 77), (77, 78), (78, 90))]
    assert cache.seq_len == 90
    assert rel_rms(full, torch.cat(parts, 1)) < 1e-5


def test_packed_forward_equals_separate_forwards(tiny):
    config, model = tiny
    seqs = [torch.randint(0, config.vocab_size, (1, n)) for n in (7, 1, 30)]
    cu = torch.tensor([0, 7, 8, 38])
    with torch.no_grad():
        packed = model(torch.cat(seqs, 1), cu_seqlens=cu).logits
        separate = torch.cat([model(s).logits for s in seqs], 1)
    assert rel_rms(separate, packed) < 1e-5


def test_whole_model_is_causal(tiny):
    config, model = tiny
    ids = torch.randint(0, config.vocab_size, (1, 50))
    other = ids.clone()
    other[:, 30:] = torch.randint(0, config.vocab_size, (1, 20))
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    # Batched matmuls may round a row differently when other rows change, hence rms not bits.
    assert rel_rms(a[:, :30], b[:, :30]) < 1e-5
    assert rel_rms(a[:, 30:], b[:, 30:]) > 1e-2


def test_sampling_is_seeded_and_stops_at_eos(tiny):
    config, model = tiny
    prompt = torch.randint(0, config.vocab_size, (1, 5))
    a = model.generate(prompt, 12, temperature=1.0, top_p=0.9, top_k=50, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 12, temperature=1.0, top_p=0.9, top_k=50, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    greedy = model.generate(prompt, 12)
    eos = int(greedy[0, 5 + 3])
    stopped = model.generate(prompt, 12, eos_token_id=eos)
    first = (greedy[0, 5:] == eos).nonzero()[0, 0].item()
    assert torch.equal(stopped, greedy[:, : 5 + first + 1])


def test_streaming_callback_sees_every_token(tiny):
    config, model = tiny
    prompt = torch.randint(0, config.vocab_size, (1, 4))
    seen = []
    out = model.generate(prompt, 6, on_token=lambda t: seen.append(int(t[0])))
    assert seen == out[0, 4:].tolist()


def test_save_and_load_round_trip(tiny, tmp_path):
    config, model = tiny
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert torch.equal(loaded.routers()[0].expert_bias, model.routers()[0].expert_bias)


def test_loading_bad_checkpoints_names_the_file(tiny, tmp_path):
    config, model = tiny
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        K3ForCausalLM.from_pretrained(tmp_path)
    weights.write_bytes(data)
    other = dataclasses.replace(config, dim=64, kda=dataclasses.replace(config.kda))
    other.to_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match="model.safetensors.*shape"):
        K3ForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_bf16_model_keeps_fp32_router_bias_and_decay(tiny):
    config, _ = tiny
    model = K3ForCausalLM(config, dtype=torch.bfloat16, seed=1)
    assert model.dtype == torch.bfloat16
    assert model.layers[1].mixer.A_log.dtype == torch.float32
    assert model.routers()[0].expert_bias.dtype == torch.float32
    logits = model(torch.randint(0, config.vocab_size, (1, 20))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_bad_inputs_raise_clear_errors(tiny):
    config, model = tiny
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        model(torch.tensor([[0, 4096]]))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 4096\), got \[-1, 3\]"):
        model(torch.tensor([[-1, 3]]), labels=torch.tensor([[3, 1]]))
    # Labels: in range or the ignore index; the first bad one and how many are named.
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4096\) or equal -100 .*got 4096 \(2 out"):
        model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[4096, -100, -5]]))
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[4095, -100, 0]]))   # the edges pass
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), config.max_seq_len)


def test_fp32_regions_hold_under_autocast(tiny):
    # Router logits, AttnRes mixes and the KDA recurrence stay fp32 under bf16 autocast (the GPU
    # training path), and the model trains under it.
    from kimik3.ops.kda import chunk_kda

    config, model = tiny
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, _, _ = model.routers()[0](torch.randn(5, config.dim))
        mixed = model.final_mix([torch.randn(2, 3, config.dim), torch.randn(2, 3, config.dim)])
        q, k = (torch.nn.functional.normalize(torch.randn(1, 70, 2, 16), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(1, 70, 2, 16), -5 * torch.rand(1, 70, 2, 16), torch.rand(1, 70, 2)
        o_autocast, _ = chunk_kda(q, k, v, g, beta)
    assert weights.dtype == torch.float32 and mixed.dtype == torch.float32
    torch.testing.assert_close(o_autocast, chunk_kda(q, k, v, g, beta)[0], rtol=0, atol=0)
    ids = torch.randint(0, config.vocab_size, (1, 40))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids.roll(-1, 1)).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    model.eval()
