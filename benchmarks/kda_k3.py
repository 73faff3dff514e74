"""K3's KDA contract for the benchmark scripts: inputs, and the calls of ours, the torch path, fla 0.6.0 and the
fp32 token loop on them (kda_kernel.py, kda_precision.py, kda_ncu.py, kda_serve_decode.py).

K3's layer hands the op raw q, k, the gate input z and beta logits, with the gate (lower bound -5), the q / k
L2 norm and the beta sigmoid fused (``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel``,
``use_beta_sigmoid_in_kernel``); fla is called with the same contract (``safe_gate=True``, ``lower_bound``).
``DEVICE`` is where inputs are built: "cuda", or "cpu" for a smoke test under the Triton interpreter.
"""

from __future__ import annotations

import torch

from harness import log

G_MIN = -5.0
DEVICE = "cuda"  # where inputs are built (a CPU smoke test sets "cpu")


def interpreter_bf16_fix() -> None:
    """Patch the Triton interpreter's bf16 dots and casts, which are not the GPU's (Triton 3.6), for runs of our
    kernels on bf16 inputs off the GPU (the CPU smoke runs)."""
    from kimik3.ops.kda.interpreter import interpreter_bf16_fix as fix

    fix()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def grad_step(f, xg, do) -> None:
    """One forward (f returns (o, state)) and its backward into the leaves xg, with output gradient do."""
    o, _ = f()
    torch.autograd.grad(o, xg, do)


def load_fla():
    """fla's ``chunk_kda`` and fla's version, or (None, None) when its wheels are not installed."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        import fla

        return fla_chunk_kda, getattr(fla, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        log(f"fla not importable: {exc!r}")
        return None, None


def load_fla_decode():
    """fla's one-token kernel entry (``fused_recurrent_kda_fwd``: continuous batching over a state pool, updated in
    place), or None."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        return fused_recurrent_kda_fwd
    except Exception as exc:  # noqa: BLE001
        log(f"fla decode not importable: {exc!r}")
        return None


def k3_inputs(B, T, H, D, dtype=torch.bfloat16, seed=0, requires_grad=False):
    """([q, k, v, z, beta logits] in ``dtype``, A_log [H], dt_bias [H * D]) on ``DEVICE``, seeded."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * s).to(dtype)

    q, k, v = rn(B, T, H, D), rn(B, T, H, D), rn(B, T, H, D)
    z = rn(B, T, H, D)
    braw = rn(B, T, H)
    a_log = torch.log(torch.empty(H, device=DEVICE).uniform_(1, 16, generator=gen))
    dtb = torch.randn(H * D, generator=gen, device=DEVICE) * 0.5
    xs = [q, k, v, z, braw]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs, a_log, dtb


def ours_k3(xs, a_log, dtb, h0=None, final=False):
    """Our Triton kernels (``chunk_kda(backend="triton")``) on K3's contract."""
    from kimik3.ops.kda import chunk_kda

    H, D = xs[0].shape[2], xs[0].shape[3]
    return chunk_kda(*xs, initial_state=h0, output_final_state=final, backend="triton",
                     A_log=a_log, dt_bias=dtb.view(H, D), lower_bound=G_MIN, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def torch_k3(xs, a_log, dtb, h0=None, final=False):
    """The torch chunk path (``chunk_kda(backend="torch")``) on K3's contract."""
    from kimik3.ops.kda import chunk_kda

    H, D = xs[0].shape[2], xs[0].shape[3]
    return chunk_kda(*xs, initial_state=h0, output_final_state=final, backend="torch",
                     A_log=a_log, dt_bias=dtb.view(H, D), lower_bound=G_MIN, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def fla_k3(fla_fn, xs, a_log, dtb, h0=None, final=False):
    """fla's ``chunk_kda`` on K3's contract."""
    return fla_fn(*xs, initial_state=h0, output_final_state=final, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=G_MIN,
                  A_log=a_log, dt_bias=dtb)


def k3_preactivations(q, k, z, beta_logit, a_log, dt_bias):
    """K3's pre-activations in fp32 from fp32 inputs, as the kernels compute them (the normalised q / k never rounded
    to a 16-bit dtype): the L2-normalised q and k, the bounded gate from z, and beta's sigmoid."""
    from kimik3.ops.kda import bounded_gate, l2_normalize

    return l2_normalize(q), l2_normalize(k), bounded_gate(z, a_log, dt_bias, G_MIN), torch.sigmoid(beta_logit)


def naive_k3(xs, a_log, dtb, h0=None):
    """The fp32 token loop after the fp32 pre-activations: the reference every error is measured against."""
    from kimik3.ops.kda import naive_recurrent_kda

    q, k, v, z, b = (x.float() for x in xs)
    H, D = q.shape[2], q.shape[3]
    qq, kk, gg, bb = k3_preactivations(q, k, z, b, a_log, dtb.view(H, D))
    return naive_recurrent_kda(qq, kk, v, gg, bb, initial_state=h0, output_final_state=True)


def decode_inputs(B: int, H: int, D: int, device: str | None = None):
    """One decode step's inputs for B sequences, seeded by B, on ``device`` (default ``DEVICE``): the raw q, k, v,
    gate input z and beta logits in bf16, a pool of 2B random fp32 states [2B, H, D, D] and B distinct slots in it.
    Also returns the generator, for whatever the caller draws next."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(B)
    q, k, v, z = (torch.randn(B, H, D, device=device, generator=gen).bfloat16() for _ in range(4))
    beta_logit = torch.randn(B, H, device=device, generator=gen).bfloat16()
    pool = torch.randn(2 * B, H, D, D, device=device, generator=gen)
    slots = torch.randperm(2 * B, device=device, generator=gen)[:B]
    return (q, k, v, z, beta_logit), pool, slots, gen


def k3_decode_kwargs(a_log: torch.Tensor, dt_bias: torch.Tensor) -> dict:
    """``kda_decode``'s keywords for K3's contract: the gate with its bound, the q / k L2 norm and the beta sigmoid
    fused."""
    return {"A_log": a_log, "dt_bias": dt_bias, "g_min": G_MIN, "use_gate_in_kernel": True,
            "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
