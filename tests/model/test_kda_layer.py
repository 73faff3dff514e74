import pytest
import torch
import torch.nn.functional as F

from kimik3 import K3Config
from kimik3.model.cache import KDAState
from kimik3.model.conv import short_conv
from kimik3.model.kda import KDA
from kimik3.ops.kda import bounded_gate, chunk_kda
from tests.numerics import rel_rms


def _kda(seed=0):
    torch.manual_seed(seed)
    config = K3Config.preset("tiny")
    layer = KDA(config)
    for name, p in layer.named_parameters():
        torch.nn.init.normal_(p, std=0.2 if p.ndim > 1 else 0.5)
    return config, layer


def _state(config, batch):
    h, k = config.kda.num_heads, config.kda_head_dim
    return KDAState(torch.zeros(batch, 3 * h * k, config.kda.conv_kernel - 1), torch.zeros(batch, h, k, k))


def test_short_conv_matches_conv1d_and_continues_from_state():
    torch.manual_seed(0)
    x = torch.randn(2, 11, 6)
    w = torch.randn(6, 4)
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w[:, None], groups=6)).transpose(1, 2)
    y, _ = short_conv(x, w)
    torch.testing.assert_close(y, ref)
    y1, state = short_conv(x[:, :7], w)
    y2, _ = short_conv(x[:, 7:], w, state)
    torch.testing.assert_close(torch.cat([y1, y2], 1), ref)


def test_gate_is_bounded_in_gmin_zero():
    raw = torch.tensor([-1e4, -30.0, -1.0, 0.0, 1.0, 30.0, 1e4]).repeat(2, 1).view(1, 7, 2, 1).expand(1, 7, 2, 3)
    g = bounded_gate(raw, torch.log(torch.tensor([1.0, 16.0])), torch.zeros(2, 3), -5.0)
    assert torch.isfinite(g).all() and (g >= -5.0).all() and (g <= 0.0).all()
    assert g.min() == -5.0 and g.max() == 0.0  # saturates at both ends in fp32


def test_prefill_then_decode_equals_full_forward():
    config, layer = _kda()
    x = torch.randn(2, 40, config.dim)
    full = layer(x)
    state = _state(config, 2)
    parts = [layer(x[:, :17], state), layer(x[:, 17:30], state)]      # prefill, chunked prefill
    parts += [layer(x[:, t:t + 1], state) for t in range(30, 40)]       # decode steps
    assert rel_rms(full, torch.cat(parts, 1)) < 1e-5


def test_pooled_state_advances_its_pool_rows_like_an_owned_state():
    """The serving engine's form: the same prefill and decode steps over pooled states (rows 3 and 0 of a
    5-row pool) give the owned states' outputs, the pool rows end equal to the owned states, an owned
    state's tensor is replaced (never written), and the other pool rows never move."""
    config, layer = _kda(4)
    h, k = config.kda.num_heads, config.kda_head_dim
    x = torch.randn(2, 24, config.dim)
    owned = _state(config, 2)
    pool = torch.randn(5, h, k, k)
    conv_pool = torch.randn(5, *owned.conv_BCW.shape[1:])
    before, conv_before = pool.clone(), conv_pool.clone()
    slots = torch.tensor([3, 0])
    pool[slots] = 0.0
    conv_pool[slots] = 0.0
    pooled = KDAState(None, None, pool_PHKV=pool, slots_B=slots, conv_pool_PCW=conv_pool)
    for a, b in ((0, 20), (20, 21), (21, 22), (22, 24)):     # prefill, two decode steps, a 2-token chunk
        first, first_conv = owned.recurrent_BHKV, owned.conv_BCW
        first_copy, first_conv_copy = first.clone(), first_conv.clone()
        torch.testing.assert_close(layer(x[:, a:b], pooled), layer(x[:, a:b], owned), rtol=0, atol=1e-6)
        assert torch.equal(first, first_copy) and owned.recurrent_BHKV is not first
        assert torch.equal(first_conv, first_conv_copy) and owned.conv_BCW is not first_conv
        torch.testing.assert_close(pool[slots], owned.recurrent_BHKV, rtol=0, atol=1e-6)
        torch.testing.assert_close(conv_pool[slots], owned.conv_BCW, rtol=0, atol=1e-6)
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])
    assert torch.equal(conv_pool[[1, 2, 4]], conv_before[[1, 2, 4]])


def test_advance_in_place_hands_a_pool_over_as_it_is_and_an_owned_state_as_a_copy():
    """The decode step's contract (``KDAState.advance_in_place``): a pooled state's step gets the pool itself
    and its rows (no copy in or out); an owned state's step gets a contiguous fp32 copy, which replaces it."""
    pool, slots = torch.zeros(4, 2, 3, 3), torch.tensor([2, 0])
    pooled = KDAState(torch.zeros(2, 6, 3), None, pool_PHKV=pool, slots_B=slots)
    seen = []

    def step(states, rows):
        seen.append((states, rows))
        states[rows] += 1.0
        return "out"

    assert pooled.advance_in_place(step) == "out"
    assert seen[-1][0] is pool and seen[-1][1] is slots
    assert torch.equal(pool[:, 0, 0, 0], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    before = torch.zeros(2, 2, 3, 3, dtype=torch.float64)
    owned = KDAState(torch.zeros(2, 6, 3), before)
    owned.advance_in_place(step)
    states, rows = seen[-1]
    assert states is owned.recurrent_BHKV and states.dtype == torch.float32 and states.is_contiguous()
    assert torch.equal(rows, torch.arange(2)) and (states == 1).all() and (before == 0).all()


def test_kda_state_holds_its_recurrent_state_one_way():
    conv, rec = torch.zeros(1, 6, 3), torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="give exactly one"):
        KDAState(conv, rec, pool_PHKV=rec)
    with pytest.raises(ValueError, match="give exactly one"):
        KDAState(conv, None)
    with pytest.raises(ValueError, match="needs slots_B"):
        KDAState(conv, None, pool_PHKV=rec)
    with pytest.raises(ValueError, match="conv inputs either owned"):
        KDAState(None, rec)
    with pytest.raises(ValueError, match="conv inputs either owned"):
        KDAState(conv, rec, conv_pool_PCW=conv)
    with pytest.raises(ValueError, match="needs slots_B"):
        KDAState(None, rec, conv_pool_PCW=conv)


class _ContinueFrom:
    """A ``KDAContextParallel`` seam for the second of two segments, in one process: it enters the segment
    with the conv inputs and recurrent state the first segment left (what KCP receives from earlier ranks)."""

    def __init__(self, state: KDAState):
        self.state = state

    def conv_state(self, x_BTC, width):
        assert width == self.state.conv_BCW.shape[-1] + 1
        return self.state.conv_BCW.to(x_BTC.dtype)

    def chunk_kda(self, q, k, v, g, beta, **options):
        assert options["initial_state"] is None and not options["output_final_state"]
        return chunk_kda(q, k, v, g, beta, **{**options, "initial_state": self.state.recurrent()})


def test_context_parallel_seam_continues_a_segment_like_the_whole_sequence():
    config, layer = _kda(5)
    x = torch.randn(2, 50, config.dim)
    full = layer(x)
    first = _state(config, 2)
    head = layer(x[:, :30], first)
    fresh = layer(x[:, 30:])
    layer.context_parallel = _ContinueFrom(first)
    tail = layer(x[:, 30:])
    assert rel_rms(full, torch.cat([head, tail], 1)) < 1e-5
    assert rel_rms(full[:, 30:], fresh) > 1e-2  # the test has teeth: without the seam's state, far off
    with pytest.raises(ValueError, match="context-parallel"):
        layer(x[:, 30:31], _state(config, 2))
    with pytest.raises(ValueError, match="context-parallel"):
        layer(x[:, 30:], cu_seqlens=torch.tensor([0, 20]))


def test_packed_sequences_equal_separate_calls():
    config, layer = _kda(1)
    lengths = [1, 70, 3, 1, 9]
    xs = [torch.randn(1, n, config.dim) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = layer(torch.cat(xs, 1), cu_seqlens=cu)
    separate = torch.cat([layer(x) for x in xs], 1)
    assert rel_rms(separate, packed) < 1e-5


def test_causal_including_the_short_conv():
    config, layer = _kda(2)
    x = torch.randn(1, 80, config.dim)
    y = x.clone()
    y[:, 50:] = torch.randn(1, 30, config.dim)
    torch.testing.assert_close(layer(x)[:, :50], layer(y)[:, :50])


def test_bf16_layer_is_finite_and_close():
    config, layer = _kda(3)
    x = torch.randn(1, 70, config.dim)
    ref = layer(x)
    out = layer.to(torch.bfloat16)(x.bfloat16())
    assert torch.isfinite(out).all()
    assert rel_rms(ref, out.float()) < 5e-2


def test_conv_state_cannot_mix_with_packing():
    with pytest.raises(ValueError, match="cu_seqlens"):
        short_conv(torch.randn(1, 4, 2), torch.randn(2, 4), torch.zeros(1, 2, 3), cu_seqlens=torch.tensor([0, 4]))
