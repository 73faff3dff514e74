import pytest
import torch

from kimik3.model.cache import MLAState
from kimik3.serve.paged_cache import BlockAllocator, LatentPool, PagedIndex
from tests.kernel_testing import DEV, HAS_KERNELS, interpreter_setup  # noqa: F401 (interpreter_setup: autouse)
from tests.numerics import rel_rms


def test_allocator_refcounts_and_reuse():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert alloc.num_free == 1 and sorted(a) == [0, 1, 2]
    alloc.incref(a[:1])
    alloc.decref(a)
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 1
    alloc.decref(a[:1])
    assert alloc.num_free == 4
    with pytest.raises(RuntimeError, match="released more often"):
        alloc.decref(a[:1])
    with pytest.raises(RuntimeError):
        alloc.allocate(5)


def test_paged_view_matches_contiguous_cache_for_ragged_rows():
    """Two rows with different lengths in scattered blocks see exactly what a contiguous cache
    of each row alone sees, and the mask hides the other row's padding."""
    torch.manual_seed(0)
    width, block = 5, 4
    pool = LatentPool(1, num_blocks=10, block_size=block, width=width, dtype=torch.float32, device="cpu")
    tables = torch.tensor([[7, 2, 5], [1, 9, 1]])            # row 1 pads with a valid id
    rows = [torch.randn(1, 9, width), torch.randn(1, 3, width)]
    contiguous = [MLAState(torch.zeros(1, 16, width)) for _ in rows]
    # prefill each row alone (B=1 views), then one batched decode step
    for r, kv in enumerate(rows):
        view = pool.view(0, tables[r:r + 1], torch.tensor([0]))
        got, mask = view.attend(kv)
        want, _ = contiguous[r].attend(kv)
        torch.testing.assert_close(got, want)
        assert mask is None
    new = torch.randn(2, 1, width)
    view = pool.view(0, tables, torch.tensor([9, 3]))
    got, mask = view.attend(new)
    assert got.shape == (2, 10, width) and mask.shape == (2, 1, 1, 10)
    for r in range(2):
        want, _ = contiguous[r].attend(new[r:r + 1])
        valid = int(mask[r, 0, 0].sum())
        assert valid == want.shape[1]
        torch.testing.assert_close(got[r, :valid], want[0])


def test_one_row_chunk_after_cached_tokens_is_offset_causal():
    # A later prefill chunk of one row: every cached latent then the chunk's, with the causality that the
    # fused attention kernels take (no [T, S] mask tensor); its boolean form is causal shifted by the cache.
    from torch.nn.attention.bias import CausalBias

    from kimik3.model.cache import causal_mask

    width = 3
    pool = LatentPool(1, num_blocks=6, block_size=4, width=width, dtype=torch.float32, device="cpu")
    tables = torch.tensor([[4, 0, 3]])
    first, second = torch.randn(1, 6, width), torch.randn(1, 5, width)
    pool.view(0, tables, torch.tensor([0])).attend(first)
    got, mask = pool.view(0, tables, torch.tensor([6]), max_length=6).attend(second)
    torch.testing.assert_close(got, torch.cat([first, second], dim=1))
    assert isinstance(mask, CausalBias) and (mask.seq_len_q, mask.seq_len_kv) == (5, 11)
    want = torch.arange(11)[None, :] <= torch.arange(5)[:, None] + 6
    assert torch.equal(causal_mask(mask, torch.device("cpu")), want)


def test_copy_prefix_is_copy_on_write():
    pool = LatentPool(2, num_blocks=3, block_size=4, width=2, dtype=torch.float32, device="cpu")
    for t in pool.tensors:
        t[0] = torch.arange(8.0).view(4, 2)
    pool.copy_prefix(0, 2, 3)
    for t in pool.tensors:
        torch.testing.assert_close(t[2, :3], t[0, :3])
        assert t[2, 3].abs().sum() == 0
        t[2, 0] = -1
        assert t[0, 0, 0] == 0


def test_layers_of_one_forward_share_the_index_and_a_reset_recomputes_it():
    """Two MLA layers of a forward through one ``PagedIndex``: the same results as each with its own index, the
    index tensors made once; after the lengths change in place, ``reset`` makes them anew (a prefill graph's
    eager regions, replayed for another row)."""
    torch.manual_seed(1)
    width, block = 3, 4
    shared_pool = LatentPool(2, num_blocks=8, block_size=block, width=width, dtype=torch.float32, device="cpu")
    own_pool = LatentPool(2, num_blocks=8, block_size=block, width=width, dtype=torch.float32, device="cpu")
    tables, lengths = torch.tensor([[3, 1, 6], [0, 5, 2]]), torch.tensor([5, 2])
    index = PagedIndex(tables, lengths, block)
    made = []
    slots = index.slots

    def counted(positions):
        made.append(positions.shape)
        return slots(positions)
    index.slots = counted
    for t_own, t_shared in zip(own_pool.tensors, shared_pool.tensors):   # the same cached latents in both
        t_shared.copy_(torch.randn(t_shared.shape))
        t_own.copy_(t_shared)
    new = torch.randn(2, 2, 1, width)
    for layer in range(2):
        got, got_mask = shared_pool.view(layer, tables, lengths, index=index).attend(new[layer])
        want, want_mask = own_pool.view(layer, tables, lengths).attend(new[layer])
        torch.testing.assert_close(got, want)
        assert torch.equal(got_mask, want_mask)
    assert len(made) == 2   # the new tokens' slots and the keys' slots, once for both layers
    lengths += 1            # in place, as a replayed graph's static inputs change
    index.reset()
    shared_pool.view(0, tables, lengths, index=index).attend(new[0])
    assert len(made) == 4 and int(index.positions(1)[0, 0]) == 6


@pytest.mark.skipif(not HAS_KERNELS, reason="needs triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_absorbed_on_the_kernels_equals_the_torch_path(monkeypatch, tokens):
    """A decode step (T = 1) and a verification (T = 3, ``multi_token``) through ``decode_absorbed``: the CUDA route
    (``paged_store`` finding each slot as it writes, ``paged_mla_decode`` with the row's tokens as queries of one
    table row) against the torch route (the shared index's slots, the torch attention), pools and outputs."""
    import importlib

    import kimik3.serve.paged_cache as paged_cache

    # The modules (the package exports functions of the same names).
    paged_decode = importlib.import_module("kimik3.ops.mla.paged_decode")
    paged_store_module = importlib.import_module("kimik3.ops.mla.paged_store")

    gen = torch.Generator().manual_seed(tokens)
    B, H, C, R, P = 2, 4, 32, 16, 4
    pools = [LatentPool(1, num_blocks=12, block_size=P, width=C + R, dtype=torch.float32, device=DEV)
             for _ in range(2)]
    pools[1].tensors[0].copy_(pools[0].tensors[0].copy_(torch.randn(13, P, C + R, generator=gen)))
    tables = torch.tensor([[3, 7, 1, 9], [0, 5, 11, 2]], device=DEV)
    lengths = torch.tensor([6, 3], device=DEV)
    kv = torch.randn(B, tokens, C + R, generator=gen).to(DEV)
    q_latent = torch.randn(B, tokens, H, C, generator=gen).to(DEV)
    q_slice = torch.randn(B, tokens, H, R, generator=gen).to(DEV)
    outs = []
    for pool, route in zip(pools, ("triton", "torch")):
        for module in (paged_decode, paged_store_module, paged_cache):
            monkeypatch.setattr(module, "paged_mla_backend", lambda x, backend="auto", r=route: r)
        view = pool.view(0, tables, lengths, multi_token=True)
        outs.append(view.decode_absorbed(kv, q_latent, q_slice, (C + R) ** -0.5))
    assert torch.equal(pools[0].tensors[0], pools[1].tensors[0])
    assert rel_rms(outs[1], outs[0]) < 1e-5
