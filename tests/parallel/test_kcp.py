"""KDA context parallelism on gloo ranks: the split sequence reproduces the single-process op and model.

Each worker rebuilds the same global inputs from a seed, runs its contiguous segment, and returns its
outputs and gradients; the test process concatenates them and compares with the single-process run.
Starting the ranks and their process group dominates on shared CPUs, so each group serves one test that checks
everything it can: the ops on four ranks, the Triton kernels on two, the model on two.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kimik3.config import K3Config
from kimik3.model.conv import short_conv
from kimik3.model.k3 import IGNORE_INDEX, K3ForCausalLM
from kimik3.model.kda import KDA
from kimik3.model.mla import GatedMLA
from kimik3.ops.kda import chunk_kda, naive_recurrent_kda
from kimik3.parallel.kcp import apply_context_parallel, kcp_kda, kcp_mla_latents, kcp_short_conv, shard_sequence
from tests.parallel.gloo import run_ranks

B, H, K, V = 2, 2, 16, 8
TOL = 2e-5  # relative rms error, fp32
TWO_RANK_KDA = [37, 91]  # uneven, neither a multiple of the chunk (64); rank 1 spans two chunks
# KDA: a whole chunk, a few tokens, two chunks with a partial one, a partial one; conv: non-last ranks
# need W-1 = 3 tokens.
FOUR_RANK_KDA, FOUR_RANK_CONV = [64, 5, 70, 29], [5, 3, 3, 9]
MODEL_TOTAL, MODEL_BORDER = 95, 41  # 41 + 54 tokens; MTP on (tiny has one MTP module)


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().float(), out.detach().float()
    return float((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def kda_inputs(total: int, seed: int, batch: int = B) -> dict[str, torch.Tensor]:
    """Global KDA inputs with a mild decay, so that the state entering a segment matters."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return {
        "q": r(batch, total, H, K), "k": F.normalize(r(batch, total, H, K), dim=-1), "v": r(batch, total, H, V),
        "g": -0.1 * torch.sigmoid(r(batch, total, H, K)), "beta": torch.sigmoid(r(batch, total, H)),
        "h0": r(batch, H, K, V), "w_o": r(batch, total, H, V), "w_s": r(batch, H, K, V),
    }


def kda_loss(o, final, x, final_weight: bool) -> torch.Tensor:
    loss = (o * x["w_o"]).sum()
    return loss + (final * x["w_s"]).sum() if final_weight else loss


def prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + name: t for name, t in tensors.items()}


def unprefixed(prefix: str, outs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{name[len(prefix):]: t for name, t in r.items() if name.startswith(prefix)} for r in outs]


def triton_interpreted() -> bool:
    """Whether the ranks can run the Triton kernels on CPU tensors (tests/conftest.py turns the
    interpreter on without CUDA; the ranks inherit it)."""
    return importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------ workers


def _kda_worker(rank, world, lengths, seed, use_h0, batch=B, backend="torch"):
    x = kda_inputs(sum(lengths), seed, batch)
    start, n = sum(lengths[:rank]), lengths[rank]
    local = {name: x[name].narrow(1, start, n).clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].clone().requires_grad_() if use_h0 else None
    o, final = kcp_kda(local["q"], local["k"], local["v"], local["g"], local["beta"], None,
                       initial_state=h0, output_final_state=True, backend=backend)
    w = {"w_o": x["w_o"].narrow(1, start, n), "w_s": x["w_s"]}
    kda_loss(o, final, w, final_weight=rank == world - 1).backward()
    out = {"o": o, "final": final, **{f"d{k}": t.grad for k, t in local.items()}}
    if use_h0:
        out["dh0"] = h0.grad
    return out


def conv_mla_inputs(total: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    channels, width = 6, 4
    return {"x": torch.randn(B, total, channels, generator=gen), "weight": torch.randn(channels, width, generator=gen),
            "q": torch.randn(B, total, 3, 8, generator=gen), "kv": torch.randn(B, total, 8, generator=gen),
            "w_y": torch.randn(B, total, channels, generator=gen), "w_a": torch.randn(B, total, 3, 8, generator=gen)}


def _conv_mla_worker(rank, world, lengths, seed):
    g = conv_mla_inputs(sum(lengths), seed)
    start, n = sum(lengths[:rank]), lengths[rank]
    x_l, q_l, kv_l = (g[name].narrow(1, start, n).clone().requires_grad_() for name in ("x", "q", "kv"))
    weight_l = g["weight"].clone().requires_grad_()
    y = kcp_short_conv(x_l, weight_l, lengths=lengths)
    kv_s, mask = kcp_mla_latents(kv_l)  # lengths gathered inside
    attn = F.scaled_dot_product_attention(q_l.transpose(1, 2), kv_s[:, None], kv_s[:, None],
                                          attn_mask=mask).transpose(1, 2)
    ((y * g["w_y"].narrow(1, start, n)).sum() + (attn * g["w_a"].narrow(1, start, n)).sum()).backward()
    return {"y": y, "attn": attn, "dx": x_l.grad, "dweight": weight_l.grad, "dq": q_l.grad, "dkv": kv_l.grad}


def model_batch(total: int, border: int):
    config = K3Config.preset("tiny")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (1, total), generator=gen)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]  # shifted on the global sequence, before splitting
    labels[:, border - 3] = IGNORE_INDEX  # ignored labels near and at the border (MTP masking)
    labels[:, border] = IGNORE_INDEX
    return config, ids, labels


def _local_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def _model_worker(rank, world, total, border):
    from kimik3.parallel.apply import apply_activation_checkpointing

    config, ids, labels = model_batch(total, border)
    model = K3ForCausalLM(config, seed=0)
    keys = list(model.state_dict())
    apply_context_parallel(model)
    mixers = [m for m in model.modules() if isinstance(m, (KDA, GatedMLA))]
    unchanged = (type(model) is K3ForCausalLM and list(model.state_dict()) == keys
                 and all(type(m) in (KDA, GatedMLA) and m.context_parallel is model.context_parallel for m in mixers))
    lengths = [border, total - border]
    ids_l, labels_l = (shard_sequence(t, lengths=lengths) for t in (ids, labels))
    out = model(ids_l, labels_l)
    out.loss.backward()
    with torch.no_grad():  # with labels no logits are made (the loss is fused); a call without labels gives them
        logits = model(ids_l).logits
    result = {"loss": out.loss, "main": out.main_loss, "mtp": out.mtp_loss, "logits": logits,
              "no_logits_with_labels": torch.tensor(out.logits is None), "unchanged": torch.tensor(unchanged)}
    local = _local_grads(model)

    # Applied before activation checkpointing (parallel/apply.py's order): the recomputed blocks redo
    # their exchanges in the backward, and loss and gradients stay the same.
    again = apply_context_parallel(K3ForCausalLM(config, seed=0))
    apply_activation_checkpointing(again)
    out_again = again(ids_l, labels_l)
    out_again.loss.backward()
    result["checkpointed_loss"] = out_again.loss
    result["checkpointed_grad_err"] = torch.tensor(rel(local, _local_grads(again)))

    errors = []  # each refusal is a ValueError raised before any communication, on every rank alike
    for call in (lambda: model(ids_l, cu_seqlens=torch.tensor([0, ids_l.shape[1]])),
                 lambda: model(ids_l, cache=object()),
                 lambda: model(ids_l, labels_l, last_only=True),
                 lambda: model.generate(ids_l, 1),
                 lambda: apply_context_parallel(model),
                 lambda: model(ids_l + config.vocab_size)):  # raised by the forward, after the pre-hook
        try:
            call()
        except ValueError:
            errors.append(1.0)
    result["errors"] = torch.tensor(errors)
    result["cleared"] = torch.tensor(model.context_parallel.lengths is None)  # the hook ran despite the error

    flat = local.clone()
    dist.all_reduce(flat)  # loss shares: gradients are summed over the group
    if rank == 0:
        named = list(model.named_parameters())
        for (name, p), grad in zip(named, flat.split([p.numel() for _, p in named])):
            result["grad." + name] = grad.view_as(p)
    return result


def _four_rank_worker(rank, world):
    out = prefixed("kda.", _kda_worker(rank, world, FOUR_RANK_KDA, 12, True))
    return {**out, **prefixed("cm.", _conv_mla_worker(rank, world, FOUR_RANK_CONV, 13))}


# ------------------------------------------------------------------ tests


def check_kda(outs, lengths, seed, use_h0, batch=B):
    x = kda_inputs(sum(lengths), seed, batch)
    leaves = {name: x[name].clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].clone().requires_grad_() if use_h0 else None
    o, final = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         initial_state=h0, output_final_state=True, backend="torch")
    kda_loss(o, final, x, final_weight=True).backward()
    assert rel(o, torch.cat([r["o"] for r in outs], dim=1)) < TOL
    for r in outs:
        assert rel(final, r["final"]) < TOL
    for name, leaf in leaves.items():
        assert rel(leaf.grad, torch.cat([r[f"d{name}"] for r in outs], dim=1)) < TOL, name
    if use_h0:
        assert rel(h0.grad, sum(r["dh0"] for r in outs)) < TOL
    # The test has teeth: segments run from a zero state (no exchange) are far off.
    alone = torch.cat([chunk_kda(*(x[n].narrow(1, sum(lengths[:i]), lengths[i]) for n in ("q", "k", "v", "g", "beta")),
                                 backend="torch")[0]
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


def test_kcp_kda_two_ranks_triton_kernels(tmp_path):
    """A split through the Triton kernels (forward and backward, under the interpreter on CPU): KCP's
    identity-state columns and final-state gradients go through them on GPUs. One row: the batch is
    covered on the torch path."""
    if not triton_interpreted():
        pytest.skip("the Triton kernels cannot run here (no triton, or no interpreter without CUDA)")
    outs = run_ranks(_kda_worker, 2, tmp_path, TWO_RANK_KDA, 14, True, 1, "triton")
    check_kda(outs, TWO_RANK_KDA, 14, True, batch=1)


def test_kcp_four_ranks(tmp_path):
    """The ops on four uneven segments: KDA (with an initial state whose gradient sums over the ranks),
    the short conv at the W-1 minimum, and causal attention over the gathered MLA latents."""
    both = run_ranks(_four_rank_worker, 4, tmp_path)
    check_kda(unprefixed("kda.", both), FOUR_RANK_KDA, 12, True)
    outs = unprefixed("cm.", both)
    g = conv_mla_inputs(sum(FOUR_RANK_CONV), 13)
    x, weight, q, kv = (g[name].clone().requires_grad_() for name in ("x", "weight", "q", "kv"))
    y, _ = short_conv(x, weight)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), kv[:, None], kv[:, None], is_causal=True).transpose(1, 2)
    ((y * g["w_y"]).sum() + (attn * g["w_a"]).sum()).backward()
    cat = lambda key: torch.cat([r[key] for r in outs], dim=1)
    assert rel(y, cat("y")) < TOL and rel(attn, cat("attn")) < TOL
    assert rel(x.grad, cat("dx")) < TOL and rel(q.grad, cat("dq")) < TOL and rel(kv.grad, cat("dkv")) < TOL
    assert rel(weight.grad, sum(r["dweight"] for r in outs)) < TOL


def test_kcp_model_matches_single_process(tmp_path):
    """Loss shares, logits and summed gradients match one process (MTP across the border included); the
    model keeps its class and state-dict keys; activation checkpointing after KCP changes nothing; what
    KCP cannot run raises ValueError."""
    outs = run_ranks(_model_worker, 2, tmp_path, MODEL_TOTAL, MODEL_BORDER)
    config, ids, labels = model_batch(MODEL_TOTAL, MODEL_BORDER)
    model = K3ForCausalLM(config, seed=0)
    ref = model(ids, labels)
    ref.loss.backward()
    ref.loss, ref.main_loss, ref.mtp_loss = ref.loss.detach(), ref.main_loss.detach(), ref.mtp_loss.detach()
    assert ref.mtp_loss is not None
    assert abs(float(sum(r["loss"] for r in outs)) - float(ref.loss)) < 1e-5 * float(ref.loss)
    assert abs(float(sum(r["main"] for r in outs)) - float(ref.main_loss)) < 1e-5 * float(ref.main_loss)
    assert abs(float(sum(r["mtp"] for r in outs)) - float(ref.mtp_loss)) < 1e-5 * float(ref.mtp_loss)
    with torch.no_grad():
        ref_logits = model.head(model.norm(ref.hidden))
    assert ref.logits is None and all(bool(r["no_logits_with_labels"]) for r in outs)
    assert rel(ref_logits, torch.cat([r["logits"] for r in outs], dim=1)) < TOL
    worst = max(rel(p.grad, outs[0]["grad." + name]) for name, p in model.named_parameters() if p.grad is not None)
    assert worst < 1e-4
    for r in outs:
        assert bool(r["unchanged"]), "same class, same state-dict keys, every mixer's seam set"
        assert abs(float(r["checkpointed_loss"]) - float(r["loss"])) <= 1e-6 * abs(float(r["loss"]))
        assert float(r["checkpointed_grad_err"]) < 1e-6
        # cu_seqlens, a cache, labels with last_only, generate() and a second apply all raise ValueError,
        # and so does the forward on out-of-vocabulary ids, which leaves no segment lengths behind
        assert r["errors"].numel() == 6
        assert bool(r["cleared"])


def test_unsupported_inputs_raise_before_communicating():
    x = kda_inputs(8, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kcp_kda(x["q"][:1], x["k"][:1], x["v"][:1], x["g"][:1], x["beta"][:1], cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError):
        apply_context_parallel(torch.nn.Linear(2, 2))
