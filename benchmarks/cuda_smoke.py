"""Correctness of the torch paths on a CUDA GPU (run through the device tool; CI has no GPU).

    python benchmarks/cuda_smoke.py

Checks, printing PASS/FAIL per line and exiting non-zero on any failure:
- chunk_kda on CUDA in bf16 against naive_recurrent_kda in fp32 (same inputs), outputs, final
  state and all gradients at fla's tolerances, including K3's per-layer head shape H=96 D=128;
- the tiny model in bf16 on CUDA: finite forward/backward with the MTP loss;
- cached greedy decode on CUDA (fp32) equals recomputing the full forward;
- the serving engine on CUDA (fp32, ragged concurrent requests, its KDA states advanced in place in the
  slot pool by the decode kernel) gives the same greedy tokens as recomputing the full forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kimik3 import K3Config, K3ForCausalLM
from kimik3.ops.kda import chunk_kda, naive_recurrent_kda

TOL = {"o": 5e-3, "state": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2}
failures = 0


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    return float((ref - out).square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-30))


def report(name: str, ok: bool, detail: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'}  {name:<44} {detail}", flush=True)


def kda_case(B: int, T: int, H: int, D: int, seed: int = 0) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, device="cuda", generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, device="cuda", generator=gen) * 2)
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    h0 = torch.randn(B, H, D, D, device="cuda", generator=gen) * 0.1
    names = ("q", "k", "v", "g", "beta")
    bf16 = [t.bfloat16() for t in (q, k, v, g, beta)]
    ref_in = [t.float().requires_grad_() for t in bf16]
    out_in = [t.clone().requires_grad_() for t in bf16]
    do = torch.randn(B, T, H, D, device="cuda", generator=gen)
    ds = torch.randn(B, H, D, D, device="cuda", generator=gen)
    o_ref, s_ref = naive_recurrent_kda(*ref_in, initial_state=h0, output_final_state=True)
    o_out, s_out = chunk_kda(*out_in, initial_state=h0, output_final_state=True)
    ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
    ((o_out.float() * do).sum() + (s_out * ds).sum()).backward()
    errors = {"o": rel_rms(o_ref, o_out), "state": rel_rms(s_ref, s_out)}
    errors.update({n: rel_rms(a.grad, b.grad) for n, a, b in zip(names, ref_in, out_in)})
    ok = all(errors[n] <= TOL[n] for n in errors)
    report(f"chunk_kda bf16 vs naive fp32 B{B} T{T} H{H} D{D}", ok,
           " ".join(f"{n}={e:.1e}" for n, e in errors.items()))


def greedy_by_recompute(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``ids`` [B, T] with n greedy tokens appended, each from a full forward over everything before it (no cache)."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def model_checks() -> None:
    config = K3Config.preset("tiny")
    model = K3ForCausalLM(config, device="cuda", seed=0)  # bf16 by default on CUDA
    ids = torch.randint(0, config.vocab_size, (4, 300), device="cuda")
    out = model(ids, labels=ids.roll(-1, 1))
    out.loss.backward()
    finite = bool(torch.isfinite(out.loss)) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    report("tiny bf16 forward+backward (MTP) finite", finite, f"loss={out.loss.detach().item():.3f} dtype={model.dtype}")

    model = K3ForCausalLM(config, device="cuda", dtype=torch.float32, seed=0).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 70), device="cuda")
    cached = model.generate(prompt, 24)
    ids = greedy_by_recompute(model, prompt, 24)
    report("tiny fp32 cached greedy decode == recompute", torch.equal(cached, ids), f"{cached.shape[1] - 70} tokens")


def engine_check() -> None:
    import dataclasses
    import inspect
    import threading

    import kimik3
    from kimik3.serve.engine import LLMEngine
    from kimik3.serve.memory import EngineConfig
    from kimik3.serve.types import SamplingParams
    from kimik3.train.data import Document
    from kimik3.train.tokenizer import train_tokenizer

    text = inspect.getsource(kimik3.model.k3)
    tokenizer = train_tokenizer([Document(f"part{i}", text[i:i + 2000]) for i in range(0, len(text), 2000)], 512)
    config = dataclasses.replace(K3Config.preset("tiny"), vocab_size=512, max_seq_len=2048)
    model = K3ForCausalLM(config, device="cuda", dtype=torch.float32, seed=0).eval()
    engine = LLMEngine(model, tokenizer, EngineConfig(memory_bytes=64 * 2**20, hash_block=16, physical_block=192,
                                                      max_running=8, checkpoints=0, prefill_chunk=64,
                                                      max_context=1024))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (23 + 7 * i,), generator=gen).tolist() for i in range(5)]
    results: dict[int, list[int]] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.complete(
            prompts[i], SamplingParams(max_tokens=12, temperature=0.0), request_id=f"r{i}")[0]))
            for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.close()
    same = [results.get(i) == greedy_by_recompute(model, torch.tensor([p], device="cuda"), 12)[0, len(p):].tolist()
            for i, p in enumerate(prompts)]
    on_gpu = all(pool.is_cuda for pool in engine.core.states.recurrent)
    report("engine on CUDA: ragged greedy == recompute", all(same) and on_gpu,
           f"{sum(same)}/{len(same)} requests equal, state pool on {'cuda' if on_gpu else 'cpu'}")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the GPU paths")
        return 2
    print(f"{torch.cuda.get_device_name()} torch={torch.__version__}")
    for shape in ((2, 1, 4, 64), (2, 63, 4, 64), (1, 65, 4, 64), (1, 1000, 8, 64), (1, 256, 96, 128)):
        kda_case(*shape)
    model_checks()
    engine_check()
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
