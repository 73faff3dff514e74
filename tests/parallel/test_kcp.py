"""KDA context parallelism on gloo ranks: the split sequence reproduces the single-process op and model.

Each worker rebuilds the same global inputs from a seed, runs its contiguous segment, and returns its
outputs and gradients; the test process concatenates them and compares with the single-process run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kimik3.config import K3Config
from kimik3.model.conv import short_conv
from kimik3.model.k3 import IGNORE_INDEX, K3ForCausalLM
from kimik3.ops.kda import chunk_kda, naive_recurrent_kda
from kimik3.parallel.kcp import apply_context_parallel, kcp_kda, kcp_mla_latents, kcp_short_conv, shard_sequence
from tests.parallel.gloo import run_ranks

B, H, K, V = 2, 2, 16, 8
TOL = 2e-5  # relative rms error, fp32


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().float(), out.detach().float()
    return float((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def kda_inputs(total: int, seed: int) -> dict[str, torch.Tensor]:
    """Global KDA inputs with a mild decay, so that the state entering a segment matters."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return {
        "q": r(B, total, H, K), "k": F.normalize(r(B, total, H, K), dim=-1), "v": r(B, total, H, V),
        "g": -0.1 * torch.sigmoid(r(B, total, H, K)), "beta": torch.sigmoid(r(B, total, H)),
        "h0": r(B, H, K, V), "w_o": r(B, total, H, V), "w_s": r(B, H, K, V),
    }


def kda_loss(o, final, x, final_weight: bool) -> torch.Tensor:
    loss = (o * x["w_o"]).sum()
    return loss + (final * x["w_s"]).sum() if final_weight else loss


# ------------------------------------------------------------------ workers (module level: spawned)


def _kda_worker(rank, world, lengths, seed, use_h0):
    x = kda_inputs(sum(lengths), seed)
    start, n = sum(lengths[:rank]), lengths[rank]
    local = {name: x[name].narrow(1, start, n).clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].clone().requires_grad_() if use_h0 else None
    o, final = kcp_kda(local["q"], local["k"], local["v"], local["g"], local["beta"], None,
                       initial_state=h0, output_final_state=True)
    w = {"w_o": x["w_o"].narrow(1, start, n), "w_s": x["w_s"]}
    kda_loss(o, final, w, final_weight=rank == world - 1).backward()
    out = {"o": o, "final": final, **{f"d{k}": t.grad for k, t in local.items()}}
    if use_h0:
        out["dh0"] = h0.grad
    return out


def _conv_mla_worker(rank, world, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    total, channels, width = sum(lengths), 6, 4
    x = torch.randn(B, total, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    q = torch.randn(B, total, 3, 8, generator=gen)
    kv = torch.randn(B, total, 8, generator=gen)
    w_y, w_a = torch.randn(B, total, channels, generator=gen), torch.randn(B, total, 3, 8, generator=gen)
    start, n = sum(lengths[:rank]), lengths[rank]
    x_l, q_l, kv_l = (t.narrow(1, start, n).clone().requires_grad_() for t in (x, q, kv))
    weight_l = weight.clone().requires_grad_()
    y = kcp_short_conv(x_l, weight_l, lengths=lengths)
    kv_s, mask = kcp_mla_latents(kv_l)  # lengths gathered inside
    attn = F.scaled_dot_product_attention(q_l.transpose(1, 2), kv_s[:, None], kv_s[:, None],
                                          attn_mask=mask).transpose(1, 2)
    ((y * w_y.narrow(1, start, n)).sum() + (attn * w_a.narrow(1, start, n)).sum()).backward()
    return {"y": y, "attn": attn, "dx": x_l.grad, "dweight": weight_l.grad, "dq": q_l.grad, "dkv": kv_l.grad}


def _four_worker(rank, world, kda_lengths, conv_lengths):
    """Both op checks in one spawn (process start-up dominates on shared CPUs)."""
    out = _kda_worker(rank, world, kda_lengths, 12, False)
    return {**out, **{"cm." + k: t for k, t in _conv_mla_worker(rank, world, conv_lengths, 13).items()}}


def model_batch(total: int, border: int):
    config = K3Config.preset("tiny")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (1, total), generator=gen)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]  # shifted on the global sequence, before splitting
    labels[:, border - 3] = IGNORE_INDEX  # ignored labels near and at the border (MTP masking)
    labels[:, border] = IGNORE_INDEX
    return config, ids, labels


def _model_worker(rank, world, total, border):
    config, ids, labels = model_batch(total, border)
    model = apply_context_parallel(K3ForCausalLM(config, seed=0))
    lengths = [border, total - border]
    ids_l, labels_l = (shard_sequence(t, lengths=lengths) for t in (ids, labels))
    out = model(ids_l, labels_l)
    out.loss.backward()
    result = {"loss": out.loss, "main": out.main_loss, "mtp": out.mtp_loss, "logits": out.logits}
    named = list(model.named_parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p in named])
    dist.all_reduce(flat)  # loss shares: gradients are summed over the group
    if rank == 0:
        for (name, p), grad in zip(named, flat.split([p.numel() for _, p in named])):
            result["grad." + name] = grad.view_as(p)
    errors = []
    for bad in ({"cu_seqlens": torch.tensor([0, ids_l.shape[1]])}, {"cache": object()}):
        try:
            model(ids_l, **bad)
        except ValueError:
            errors.append(1.0)
    result["errors"] = torch.tensor(errors)
    return result


# ------------------------------------------------------------------ tests


def check_kda(outs, lengths, seed, use_h0):
    x = kda_inputs(sum(lengths), seed)
    leaves = {name: x[name].clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].clone().requires_grad_() if use_h0 else None
    o, final = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         initial_state=h0, output_final_state=True)
    kda_loss(o, final, x, final_weight=True).backward()
    assert rel(o, torch.cat([r["o"] for r in outs], dim=1)) < TOL
    for r in outs:
        assert rel(final, r["final"]) < TOL
    for name, leaf in leaves.items():
        assert rel(leaf.grad, torch.cat([r[f"d{name}"] for r in outs], dim=1)) < TOL, name
    if use_h0:
        assert rel(h0.grad, sum(r["dh0"] for r in outs)) < TOL
    # The test has teeth: segments run from a zero state (no exchange) are far off.
    alone = torch.cat([chunk_kda(*(x[n].narrow(1, sum(lengths[:i]), lengths[i]) for n in ("q", "k", "v", "g", "beta")))[0]
                       for i in range(len(lengths))], dim=1)
    assert rel(o, alone) > 1e-2


def test_identity_state_trick_matches_the_token_loop():
    """[v, 0] from [0, I]: outputs [o_local, q~], final state [S~ | M]; then o = o_local + q~ S_in and
    S_out = M S_in + S~ (M, not its transpose)."""
    x = kda_inputs(50, seed=3)
    q, k, v, g, beta, s_in = x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"]
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=s_in, output_final_state=True)
    v_aug = torch.cat([v, torch.zeros(B, 50, H, K)], dim=-1)
    state = torch.cat([torch.zeros(B, H, K, V), torch.eye(K).expand(B, H, K, K)], dim=-1)
    for op in (naive_recurrent_kda, chunk_kda):
        o, s = op(q, k, v_aug, g, beta, initial_state=state, output_final_state=True)
        o_full = o[..., :V] + torch.einsum("bthk,bhkv->bthv", o[..., V:], s_in)
        assert rel(ref_o, o_full) < 1e-5
        assert rel(ref_s, s[..., V:] @ s_in + s[..., :V]) < 1e-5
        assert rel(ref_s, s[..., V:].transpose(-1, -2) @ s_in + s[..., :V]) > 1e-2


def test_kcp_kda_two_ranks(tmp_path):
    lengths = [37, 91]  # uneven, neither a multiple of the chunk (64)
    check_kda(run_ranks(_kda_worker, 2, tmp_path, lengths, 11, True), lengths, 11, True)


def test_kcp_kda_two_ranks_triton_kernels(tmp_path, monkeypatch):
    """The same split through the Triton kernels (forward and backward, under the interpreter on CPU):
    KCP's identity-state columns, initial-state and final-state gradients go through them on GPUs."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks before triton loads
    monkeypatch.setenv("KIMIK3_KDA_BACKEND", "triton")
    lengths = [37, 91]
    outs = run_ranks(_kda_worker, 2, tmp_path, lengths, 14, True)
    monkeypatch.setenv("KIMIK3_KDA_BACKEND", "torch")  # the single-process truth: the torch chunk path
    check_kda(outs, lengths, 14, True)


def test_kcp_four_ranks(tmp_path):
    kda_lengths, lengths = [64, 5, 70, 29], [5, 3, 3, 9]  # conv: non-last ranks need W-1 = 3 tokens
    both = run_ranks(_four_worker, 4, tmp_path, kda_lengths, lengths)
    check_kda(both, kda_lengths, 12, False)
    outs = [{k[3:]: t for k, t in r.items() if k.startswith("cm.")} for r in both]
    gen = torch.Generator().manual_seed(13)
    total, channels, width = sum(lengths), 6, 4
    x = torch.randn(B, total, channels, generator=gen).requires_grad_()
    weight = torch.randn(channels, width, generator=gen).requires_grad_()
    q = torch.randn(B, total, 3, 8, generator=gen).requires_grad_()
    kv = torch.randn(B, total, 8, generator=gen).requires_grad_()
    w_y, w_a = torch.randn(B, total, channels, generator=gen), torch.randn(B, total, 3, 8, generator=gen)
    y, _ = short_conv(x, weight)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), kv[:, None], kv[:, None], is_causal=True).transpose(1, 2)
    ((y * w_y).sum() + (attn * w_a).sum()).backward()
    cat = lambda key: torch.cat([r[key] for r in outs], dim=1)
    assert rel(y, cat("y")) < TOL and rel(attn, cat("attn")) < TOL
    assert rel(x.grad, cat("dx")) < TOL and rel(q.grad, cat("dq")) < TOL and rel(kv.grad, cat("dkv")) < TOL
    assert rel(weight.grad, sum(r["dweight"] for r in outs)) < TOL


def test_kcp_model_matches_single_process(tmp_path):
    total, border = 95, 41  # 41 + 54 tokens; MTP on (tiny has one MTP module)
    outs = run_ranks(_model_worker, 2, tmp_path, total, border)
    config, ids, labels = model_batch(total, border)
    model = K3ForCausalLM(config, seed=0)
    ref = model(ids, labels)
    ref.loss.backward()
    ref.loss, ref.main_loss, ref.mtp_loss = ref.loss.detach(), ref.main_loss.detach(), ref.mtp_loss.detach()
    assert ref.mtp_loss is not None
    assert abs(float(sum(r["loss"] for r in outs)) - float(ref.loss)) < 1e-5 * float(ref.loss)
    assert abs(float(sum(r["main"] for r in outs)) - float(ref.main_loss)) < 1e-5 * float(ref.main_loss)
    assert abs(float(sum(r["mtp"] for r in outs)) - float(ref.mtp_loss)) < 1e-5 * float(ref.mtp_loss)
    assert rel(ref.logits, torch.cat([r["logits"] for r in outs], dim=1)) < TOL
    worst = max(rel(p.grad, outs[0]["grad." + name]) for name, p in model.named_parameters() if p.grad is not None)
    assert worst < 1e-4
    assert all(r["errors"].numel() == 2 for r in outs)  # cu_seqlens and a cache both raise


def test_unsupported_inputs_raise_before_communicating():
    x = kda_inputs(8, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kcp_kda(x["q"][:1], x["k"][:1], x["v"][:1], x["g"][:1], x["beta"][:1], cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError):
        apply_context_parallel(torch.nn.Linear(2, 2))
