import pytest
import torch

from kimik3 import K3Config
from kimik3.model.cache import K3Cache, MLAState
from kimik3.model.mla import GatedMLA
from tests.numerics import rel_rms


def _mla(seed=0):
    torch.manual_seed(seed)
    config = K3Config.preset("tiny")
    mla = GatedMLA(config)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.15) if p.ndim > 1 else torch.nn.init.normal_(p, mean=1.0, std=0.1)
    return config, mla


def test_naive_and_absorbed_paths_agree_fp32():
    config, mla = _mla()
    x = torch.randn(2, 37, config.dim)
    naive = mla(x, absorbed=False)
    absorbed = mla(x, absorbed=True)
    assert rel_rms(naive, absorbed) < 1e-5


def test_cached_prefill_then_decode_matches_full_sequence_on_both_paths():
    config, mla = _mla(1)
    x = torch.randn(2, 20, config.dim)
    full = mla(x)
    for absorbed in (False, True):
        state = MLAState(torch.zeros(2, 32, config.mla.cache_width))
        parts = [mla(x[:, :9], state, absorbed=absorbed), mla(x[:, 9:15], state, absorbed=absorbed)]
        parts += [mla(x[:, t:t + 1], state, absorbed=absorbed) for t in range(15, 20)]
        assert state.length == 20
        assert rel_rms(full, torch.cat(parts, dim=1)) < 1e-5


def test_packed_sequences_equal_separate_calls():
    config, mla = _mla(2)
    lengths = [5, 1, 12]
    xs = [torch.randn(1, n, config.dim) for n in lengths]
    cu = torch.tensor([0, 5, 6, 18])
    packed = mla(torch.cat(xs, dim=1), cu_seqlens=cu)
    separate = torch.cat([mla(x) for x in xs], dim=1)
    assert rel_rms(separate, packed) < 1e-5
    assert rel_rms(separate, mla(torch.cat(xs, dim=1), cu_seqlens=cu, absorbed=True)) < 1e-5


def test_causal():
    config, mla = _mla(3)
    x = torch.randn(1, 16, config.dim)
    y = x.clone()
    y[:, 10:] += torch.randn(1, 6, config.dim)
    torch.testing.assert_close(mla(x)[:, :10], mla(y)[:, :10])


def test_cache_is_576_values_per_token_per_layer_at_full_scale():
    k3 = K3Config.preset("k3")
    assert k3.mla.cache_width == 512 + 64 == 576
    tiny = K3Config.preset("tiny")
    cache = K3Cache.allocate(tiny, batch_size=1, max_len=8)
    mla_states = [s for s in cache.layers if isinstance(s, MLAState)]
    assert len(mla_states) == 3 and all(s.kv_BSC.shape == (1, 8, tiny.mla.cache_width) for s in mla_states)


def test_output_gate_is_applied_before_wo():
    config, mla = _mla(4)
    x = torch.randn(1, 6, config.dim)
    with torch.no_grad():
        mla.gate.weight.zero_()           # sigmoid(0) = 1/2 on every channel
        half = mla(x)
        mla.gate.weight.fill_(0.0)
        mla.wo.weight.mul_(2.0)           # doubling wo undoes the halving exactly
        torch.testing.assert_close(mla(x), 2 * half)


class _AfterEarlier:
    """An ``MLAContextParallel`` seam for the second of two segments, in one process: its queries see the
    first segment's latents too (what KCP gathers from earlier ranks)."""

    def __init__(self, earlier_BSC: torch.Tensor):
        self.earlier_BSC = earlier_BSC

    def attend(self, kv_BTC):
        kv_BSC = torch.cat([self.earlier_BSC, kv_BTC], dim=1)
        query_T = torch.arange(kv_BTC.shape[1])[:, None] + self.earlier_BSC.shape[1]
        return kv_BSC, torch.arange(kv_BSC.shape[1])[None, :] <= query_T


def test_context_parallel_seam_attends_over_the_earlier_segment_on_both_paths():
    config, mla = _mla(5)
    x = torch.randn(2, 20, config.dim)
    full = mla(x)
    assert rel_rms(full[:, 9:], mla(x[:, 9:])) > 1e-2  # the test has teeth: the earlier latents matter
    mla.context_parallel = _AfterEarlier(mla.latents(mla.wkv_a(x[:, :9])))
    for absorbed in (False, True):
        assert rel_rms(full[:, 9:], mla(x[:, 9:], absorbed=absorbed)) < 1e-5
    with pytest.raises(ValueError, match="context-parallel"):
        mla(x[:, 9:10], MLAState(torch.zeros(2, 32, config.mla.cache_width)))
    with pytest.raises(ValueError, match="context-parallel"):
        mla(x[:, 9:], cu_seqlens=torch.tensor([0, 11]))
