"""MoonViT-V2 encoder throughput (issue 45): images/s and tokens/s of the vision tower + projector
(``K3VLForCausalLM.encode_images``) on packed batches, the attention kept inside each image, against the same images
encoded one forward each (the peer, in the same run).

Cases (``--sizes``, square images; ``--mixed`` adds one batch of different sizes and aspect ratios): a packed batch
holds as many images of the size as fit ``--max-patches`` patches (at least one), so 1024² images go ~11 to a
batch and a 3584² image (65,536 patches, 16,384 tokens after the 2 x 2 merge) alone. Per case: ms per forward
(median of ``--iters`` after ``--warmup``), images/s, encoder patches/s, language-model tokens/s (after the merge),
peak memory, and the packed/one-at-a-time ratio. Correctness in the same run: each image's rows of the packed output
against its own forward (max |difference|, relative to the output's scale).

GPU (the full tower, 401M parameters, bf16; the projector into K3's width 7168):
    python benchmarks/vision_encoder.py --json $OUT/vision_encoder.json
CPU smoke check (the tiny tower, small images):
    python benchmarks/vision_encoder.py --preset tiny-vl --sizes 224 448 --mixed --device cpu --dtype float32 \\
        --iters 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed

from kimik3.config.schema import K3Config  # noqa: E402
from kimik3.model.vision.encoder import MoonViT  # noqa: E402
from kimik3.model.vision.model import init_vision_weights  # noqa: E402
from kimik3.model.vision.projector import VisionProjector  # noqa: E402
from kimik3.model.vision.tokens import image_grid, pack_images  # noqa: E402

MIXED = [(3584, 3584), (1024, 1024), (1024, 2048), (768, 1344), (448, 448)]


def build(preset: str, device: torch.device, dtype: torch.dtype) -> tuple[MoonViT, VisionProjector]:
    config = K3Config.preset(preset)
    if config.vision is None:
        raise SystemExit(f"--preset {preset}: no vision tower (use k3-vl, debug-vl or tiny-vl)")
    with torch.device("meta"):
        tower, projector = MoonViT(config.vision), VisionProjector(config.vision, config.dim)
    tower.to_empty(device=device), projector.to_empty(device=device)
    with torch.no_grad():
        init_vision_weights(tower, projector, torch.Generator(device=device).manual_seed(0))
    return tower.to(dtype).eval().requires_grad_(False), projector.to(dtype).eval().requires_grad_(False)


def random_images(sizes: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8) for h, w in sizes]


def timed(fn, device: torch.device, iters: int, warmup: int) -> tuple[float, torch.Tensor]:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup``; and its last output."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = None
    for _ in range(warmup):
        out = fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run_case(name: str, sizes: list[tuple[int, int]], tower: MoonViT, projector: VisionProjector,
             args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    images = random_images(sizes, args.seed)
    began = time.perf_counter()
    pixels, grid = pack_images(images)
    singles = [pack_images([image]) for image in images]
    preprocess_s = time.perf_counter() - began
    pixels, grid = pixels.to(device, dtype), grid.to(device)
    singles = [(p.to(device, dtype), g.to(device)) for p, g in singles]

    def encode(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return projector(tower(p, g), g)

    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        packed_s, packed = timed(lambda: encode(pixels, grid), device, args.iters, args.warmup)
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        single_s, _ = timed(lambda: [encode(p, g) for p, g in singles], device, args.iters, args.warmup)
        # each image's rows of the packed output against its own forward
        parts = torch.split(packed.float(), [int(r * c) // tower.config.merge_size ** 2 for r, c in grid.tolist()])
        worst = 0.0
        for part, (p, g) in zip(parts, singles):
            alone = encode(p, g).float()
            worst = max(worst, float((part - alone).abs().max() / alone.abs().max().clamp_min(1e-12)))
    patches = int(pixels.shape[0])
    tokens = int(packed.shape[0])
    result = {"case": name, "images": len(images), "sizes": sizes, "patches": patches, "lm_tokens": tokens,
              "packed_ms": packed_s * 1e3, "one_at_a_time_ms": single_s * 1e3, "packed_speedup": single_s / packed_s,
              "images_per_s": len(images) / packed_s, "patches_per_s": patches / packed_s,
              "lm_tokens_per_s": tokens / packed_s, "peak_gib": peak, "preprocess_s": preprocess_s,
              "max_rel_diff_packed_vs_alone": worst}
    print(f"{name:<12} {len(images):>3} img {patches:>7,} patches {tokens:>6,} tokens | packed {packed_s * 1e3:9.1f} ms"
          f" ({len(images) / packed_s:8.2f} img/s, {patches / packed_s:11,.0f} patches/s, {tokens / packed_s:10,.0f}"
          f" tokens/s) | one at a time {single_s * 1e3:9.1f} ms ({single_s / packed_s:.2f}x) | packed vs alone "
          f"{worst:.1e}" + (f" | peak {peak:.1f} GiB" if peak is not None else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="k3-vl", help="a -vl preset: its tower and the projector to its width")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 3584], help="square image sizes (pixels)")
    parser.add_argument("--mixed", action="store_true", help="add a batch of mixed sizes and aspect ratios")
    parser.add_argument("--max-patches", type=int, default=65_536, help="patches per packed batch (>= 1 image)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tower, projector = build(args.preset, device, dtype)
    params = sum(p.numel() for p in tower.parameters())
    print(f"{args.preset} tower: {params:,} parameters (+ projector {sum(p.numel() for p in projector.parameters()):,}"
          f"), {dtype}, {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
          flush=True)
    cases = []
    for size in args.sizes:
        rows, cols = image_grid(size, size, patch_size=tower.config.patch_size, merge_size=tower.config.merge_size)
        count = max(1, args.max_patches // (rows * cols))
        cases.append((f"{size}x{size}", [(size, size)] * count))
    if args.mixed:
        cases.append(("mixed", MIXED if args.preset != "tiny-vl" else [(h // 8, w // 8) for h, w in MIXED]))
    results = [run_case(name, sizes, tower, projector, args, device, dtype) for name, sizes in cases]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"preset": args.preset, "dtype": str(dtype), "device": str(device),
                                         "tower_parameters": params, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
