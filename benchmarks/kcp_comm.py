"""Per-rank communication bytes of KDA context parallelism (KCP) vs exchanging K/V blocks, at K3's shapes.

Counted bytes, not timings: nothing is run on a network. Usage: ``python benchmarks/kcp_comm.py``.

Model (K3, DESIGN.md): 69 KDA layers (H = 96, K = V = 128, conv width 4 on q, k, v) and 24 Gated MLA
layers (96 heads, qk head 128 + 64, v head 128, latent 512 + 64 = 576 values per token); bf16
activations, fp32 KDA states. P ranks hold T / P tokens each (one sequence, batch 1).

Convention: a collective in which every rank contributes c bytes costs each rank (P - 1) * c bytes
sent (and as many received) with a bandwidth-optimal (ring) all-gather or reduce-scatter; a
point-to-point send of c bytes costs c. The backward of an all-gather is a reduce-scatter of the
same size (NCCL; on gloo kcp.py all-reduces instead, which is not the path being counted).

KCP, per rank and step (forward + backward):
  KDA layer: all-gather of [H, K, V + K] fp32 (S~ and M)      + the reduce-scatter of its gradient
             send of the last W-1 conv inputs [W-1, 3 H K] bf16 + the same back (gradient)
  MLA layer: all-gather of the latents [T/P, 576] bf16         + the reduce-scatter of its gradient
K/V exchange (what a softmax-attention context parallelism sends, ring-attention style; counted as
an all-gather + reduce-scatter, a lower bound: ring attention's backward circulates K/V *and* dK/dV):
  KDA layer: K and V of every token [T/P, H, K + V] bf16 (a lower bound again: recomputing the state
             from them would also need g [T/P, H, K] and beta)
  MLA layer: per-head K and V [T/P, H, 192 + 128] bf16
"""

from __future__ import annotations

H, K, V, W = 96, 128, 128, 4
KDA_LAYERS, MLA_LAYERS = 69, 24
MLA_LATENT, MLA_QK, MLA_V = 576, 192, 128
BF16, FP32 = 2, 4


def kcp_bytes(tokens: int, ranks: int) -> dict[str, float]:
    local = tokens // ranks
    state = H * K * (V + K) * FP32
    conv = (W - 1) * 3 * H * K * BF16
    kda_fwd = (ranks - 1) * state + conv
    mla_fwd = (ranks - 1) * local * MLA_LATENT * BF16
    return {"kda_layer_fwd": kda_fwd, "mla_layer_fwd": mla_fwd,
            "step": 2 * (KDA_LAYERS * kda_fwd + MLA_LAYERS * mla_fwd)}


def kv_bytes(tokens: int, ranks: int) -> dict[str, float]:
    local = tokens // ranks
    kda_fwd = (ranks - 1) * local * H * (K + V) * BF16
    mla_fwd = (ranks - 1) * local * H * (MLA_QK + MLA_V) * BF16
    return {"kda_layer_fwd": kda_fwd, "mla_layer_fwd": mla_fwd,
            "step": 2 * (KDA_LAYERS * kda_fwd + MLA_LAYERS * mla_fwd)}


def fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    print("Per-rank bytes sent (= received), counted, not timed. 'layer' = one layer's forward; "
          "'step' = forward + backward over all 69 KDA + 24 MLA layers.\n")
    header = ("| tokens | ranks | tokens/rank | KCP KDA layer | K/V KDA layer | ratio | KCP MLA layer (latents) "
              "| K/V MLA layer | KCP step | of which MLA | K/V step | ratio |")
    print(header)
    print("|" + "|".join("---" for _ in range(header.count("|") - 1)) + "|")
    for tokens, label in ((262_144, "256K"), (1_048_576, "1M")):
        for ranks in (8, 16, 64):
            a, b = kcp_bytes(tokens, ranks), kv_bytes(tokens, ranks)
            print(f"| {label} | {ranks} | {tokens // ranks:,} | {fmt(a['kda_layer_fwd'])} | {fmt(b['kda_layer_fwd'])} "
                  f"| {b['kda_layer_fwd'] / a['kda_layer_fwd']:.0f}x | {fmt(a['mla_layer_fwd'])} "
                  f"| {fmt(b['mla_layer_fwd'])} | {fmt(a['step'])} | {fmt(2 * MLA_LAYERS * a['mla_layer_fwd'])} | {fmt(b['step'])} | {b['step'] / a['step']:.0f}x |")
    state = H * K * (V + K) * FP32
    print(f"\nKCP's KDA exchange is {fmt(state)} per rank whatever T; K/V costs {fmt(H * (K + V) * BF16)} per "
          f"token, so KCP sends less once a rank holds more than {state // (H * (K + V) * BF16)} tokens.")


if __name__ == "__main__":
    main()
