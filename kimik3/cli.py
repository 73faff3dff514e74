"""``kimik3 <command>``: the command-line entry point."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from kimik3.config import K3Config, format_param_table
from kimik3.extras import MissingExtra, require


class _Help(argparse.HelpFormatter):
    """Appends each option's default to its help, unless the help already names it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kimik3")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown (not installed)"


def _load_config(name_or_path: str) -> K3Config:
    if name_or_path.endswith(".json"):
        return K3Config.from_json(name_or_path)
    return K3Config.preset(name_or_path)


def cmd_params(args: argparse.Namespace) -> int:
    print(format_param_table(_load_config(args.config)))
    return 0


def _relaunch(nproc: int, argv: list[str]) -> int:
    """Run ``kimik3 <argv>`` in ``nproc`` processes through torchrun (torch.distributed.run)."""
    import os
    import subprocess

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "kimik3", *argv]
    return subprocess.call(command, env=env)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def cmd_train(args: argparse.Namespace) -> int:
    import os

    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import TrainArgs, Trainer

    check_device(args.device)
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    if args.nproc is not None and not launched:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        ParallelDims.for_world(args.nproc, dp=args.dp, ep=args.ep, cp=args.cp)  # fail before launching
        return _relaunch(args.nproc, _without_nproc(args.argv))
    parallel = None
    if launched or args.dp is not None or args.ep != 1 or args.cp != 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        parallel = ParallelDims.for_world(world, dp=args.dp, ep=args.ep, cp=args.cp)
    train_args = TrainArgs(
        preset=args.preset, config_path=args.config, data=args.data, steps=args.steps,
        time_budget_s=args.time_budget, out=args.out, seed=args.seed, seq_len=args.seq_len,
        batch_size=args.batch_size, lr=args.lr, device=args.device, cuda_graph=args.cuda_graph, compile=args.compile,
        balance=args.balance, qb_rate=args.qb_rate, ep_planner=args.ep_planner, checkpoint_every=args.checkpoint_every,
        checkpoint_async=args.checkpoint_async, qat=args.qat,
        progress=not args.no_progress, vision=args.vision or args.vision_blank, vision_blank=args.vision_blank,
        vision_text_fraction=args.vision_text_fraction, vision_init=args.vision_init)
    trainer = Trainer(train_args, resume=args.resume, parallel=parallel,
                      activation_checkpointing=args.activation_checkpointing)
    trainer.run()
    if trainer.args.vision and trainer.ctx.is_main:   # the target: question answering on held-out images
        from kimik3.train.vision_data import evaluate_qa

        result = evaluate_qa(trainer.model, trainer.data, count=args.vision_eval)
        label = "blank" if trainer.args.vision_blank else "vision"
        print(f"held-out question answering ({result.n} questions, corpus seed {trainer.data.seed}; accuracy, "
              f"Wilson 95% interval, chance):\n{result.table(label)}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # only after success: a failed rank must not wait here
        dist.barrier()
        dist.destroy_process_group()
        if launched:   # a torchrun rank, done: ended here, or gloo's finalisation may fail it (``exit_rank``)
            from kimik3.parallel.context import exit_rank

            exit_rank()
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from kimik3.train.draft import DraftArgs, train_draft

    check_device(args.device)
    train_draft(DraftArgs(run=args.run, loss=args.loss, steps=args.steps, ttt=args.ttt, lr=args.lr, batch=args.batch,
                          seq_len=args.seq_len, device=args.device, seed=args.seed, held_out=args.held_out,
                          data=args.data, draft_vocab=args.draft_vocab or None, regenerate=args.regenerate,
                          progress=not args.no_progress))
    return 0


def resolve_run(run: str | None) -> Path:
    """``run`` itself, or the newest run under ./runs that holds a saved model (what `kimik3 train` writes)."""
    if run is not None:
        path = Path(run)
        if not path.is_dir():
            raise FileNotFoundError(f"run directory {path} does not exist (train one with `kimik3 train`)")
        return path
    from kimik3.model.pretrained import has_weights

    # A single-process run links model.safetensors; a run on several ranks links a sharded checkpoint.
    runs = sorted((p for p in Path("runs").glob("*") if p.is_dir() and has_weights(p)),
                  key=lambda p: p.stat().st_mtime)
    if not runs:
        raise FileNotFoundError("no trained run under ./runs: train one with `kimik3 train` or pass --run DIR")
    return runs[-1]


def cmd_serve(args: argparse.Namespace) -> int:
    require("serve", "kimik3 serve")   # before anything is loaded: a missing extra is one clear line
    from kimik3.serve.engine import LLMEngine
    from kimik3.serve.memory import EngineConfig
    from kimik3.serve.router import ReplicaRouter
    from kimik3.serve.server import default_max_request_bytes, max_token_chars, serve

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    check_device(args.device)
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty")
    run = resolve_run(args.run)
    from kimik3.serve.chat import load_chat_template

    chat_template = load_chat_template(args.chat_template, run)   # a bad template fails before the model loads
    import torch

    on_gpu = torch.device(args.device).type == "cuda"
    utilization = args.gpu_memory_utilization
    if utilization is not None and not on_gpu:
        raise ValueError("--gpu-memory-utilization sizes the cache on a GPU: on the CPU use --memory-mb")
    if utilization is None and on_gpu and args.memory_mb is None:
        utilization = 0.9
    if utilization is not None:
        utilization /= args.replicas   # the replicas share the GPU
    config = EngineConfig(memory_bytes=int((args.memory_mb or 256.0) * 2**20), hash_block=args.hash_block,
                          physical_block=args.physical_block, max_running=args.max_running,
                          checkpoints=args.checkpoints, prefix_policy=args.prefix_policy,
                          max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
                          gpu_memory_utilization=utilization, enforce_eager=args.enforce_eager,
                          speculative_tokens=args.speculative_tokens)
    replicas = [LLMEngine.from_run(run, config, device=args.device, model_name=args.served_model_name)
                for _ in range(args.replicas)]
    engine = replicas[0] if len(replicas) == 1 else ReplicaRouter(replicas)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"kimik3 serve: warning: listening on {args.host} without --api-key: anyone who can reach "
              "this port can use the model", file=sys.stderr)
    body_limit = args.max_request_bytes or default_max_request_bytes(engine.max_context,
                                                                      max_token_chars(engine.tokenizer))
    if args.max_request_bytes is None and getattr(replicas[0], "image_rule", None) is not None:
        from kimik3.serve.images import ImageLimits

        # Room for one image of the largest size accepted, base64-encoded; more large images need the option.
        body_limit += ImageLimits().max_bytes * 4 // 3 + 4096
    print(f"serving {run} as '{engine.model_name}' on http://{args.host}:{args.port}/v1 "
          f"({args.replicas} replica(s); request bodies up to {body_limit:,} bytes)", file=sys.stderr)
    print(f"each replica: {replicas[0].core.describe()}", file=sys.stderr)
    # 1 when the engine gave up after repeated failures: a process supervisor restarts the server.
    return serve(engine, host=args.host, port=args.port, api_key=args.api_key, max_request_bytes=body_limit,
                 chat_template=chat_template)


def cmd_cost(args: argparse.Namespace) -> int:
    from kimik3.serve.cost import PRICE_CACHED_INPUT, PRICE_OUTPUT, PRICE_UNCACHED_INPUT, session_cost

    cost = session_cost(args.turns, args.prefix, args.new, args.output, growing=args.growing)
    print(f"K3 prices per million tokens: cached input ${PRICE_CACHED_INPUT:.2f}, uncached input "
          f"${PRICE_UNCACHED_INPUT:.2f}, output ${PRICE_OUTPUT:.2f}")
    print(f"{cost.turns} turns, {args.prefix:,}-token prefix, {args.new:,} new and {args.output:,} output tokens "
          f"per turn{' (prefix grows each turn)' if args.growing else ''}")
    print(f"  prompt tokens {cost.prompt_tokens:,}, of which served from the prefix cache {cost.cached_tokens:,}")
    print(f"  without prefix cache: ${cost.uncached_usd:,.2f}")
    print(f"  with prefix cache:    ${cost.cached_usd:,.2f}  ({cost.saving:.1f}x cheaper)")
    return 0


def _check_generate_options(args: argparse.Namespace) -> None:
    """Every ``generate`` option, checked before anything is loaded or printed."""
    from kimik3.model.sampling import SamplingOptionError, check_sampling

    if args.prompt == "":
        raise ValueError("--prompt is empty")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        check_sampling(args.temperature, args.top_p, args.top_k)
    except SamplingOptionError as err:   # the same rules as the sampler's, said with the flag's name
        raise ValueError(f"--{err.option.replace('_', '-')} must be {err.rule}, got {err.value!r}") from None
    check_device(args.device)


def checkpoint_mode_arg(text: str) -> str:
    """``--activation-checkpointing``'s value, checked (``kimik3.parallel.activation_checkpoint.parse_mode``)."""
    from kimik3.parallel.activation_checkpoint import checkpoint_mode

    try:
        return checkpoint_mode(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def draft_vocab_arg(text: str) -> int | str:
    """``--draft-vocab``'s value: "auto" or a count of ids (0: the target's whole vocabulary)."""
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a count of token ids >= 0, got {text!r}")
    return count


def check_device(name: str) -> None:
    """Refuse a --device that is not one, or a CUDA device that torch cannot see, before anything is loaded."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but torch sees no CUDA GPU")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    _check_generate_options(args)
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.tokenizer import EOS, load_tokenizer

    run = resolve_run(args.run)
    tokenizer = load_tokenizer(run / "tokenizer.json")
    model = K3ForCausalLM.from_pretrained(run, device=args.device).eval()
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise ValueError(f"{run / 'tokenizer.json'}: vocabulary of {tokenizer.get_vocab_size()} exceeds "
                         f"the model's {model.config.vocab_size}")
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise ValueError("--prompt is empty")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    produced: list[int] = []
    printed = ""
    sys.stdout.write(args.prompt)

    def stream(token) -> None:
        nonlocal printed
        produced.append(int(token[0]))
        text = tokenizer.decode(produced)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    model.generate(torch.tensor([prompt_ids], device=args.device), args.max_tokens, temperature=args.temperature,
                   top_p=args.top_p, top_k=args.top_k, eos_token_id=tokenizer.token_to_id(EOS),
                   generator=generator, on_token=stream)
    sys.stdout.write("\n")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import shutil

    import torch

    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.model.pretrained import has_weights, is_sharded_checkpoint, stored_dtype

    src, dst = Path(args.src), Path(args.dst)
    if not has_weights(src):
        raise FileNotFoundError(f"{src}: no model.safetensors nor model.safetensors.index.json nor a sharded "
                                "checkpoint (kimik3_dcp.json)")
    if dst.resolve() == src.resolve():
        raise ValueError("convert: the destination must differ from the source")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"convert: {dst} exists and is not empty")
    if args.max_shard_mb is not None and args.max_shard_mb < 1:
        raise ValueError(f"--max-shard-mb must be >= 1, got {args.max_shard_mb}")
    if args.pack_experts and args.layout != "kimik3":
        raise ValueError("--pack-experts writes our layout: add --layout kimik3")
    if args.pack_experts and is_sharded_checkpoint(src):
        raise ValueError(f"--pack-experts reads a single-file model: convert {src} with --layout kimik3 first, "
                         "then pack that")
    dtype = getattr(torch, args.dtype) if args.dtype else stored_dtype(src)
    max_shard_bytes = args.max_shard_mb * 10**6 if args.max_shard_mb else None
    if is_sharded_checkpoint(src):
        # A run on several ranks: streamed one tensor at a time, never the whole model in memory.
        from kimik3.interop.dcp_export import export_dcp

        export_dcp(src, dst, args.layout, dtype=dtype, max_shard_bytes=max_shard_bytes)
    else:
        model = K3ForCausalLM.from_pretrained(src, device="cpu", dtype=dtype)
        if args.layout == "torchtitan":
            from kimik3.files import atomic_write
            from kimik3.interop import to_torchtitan
            from kimik3.interop.dcp_export import TORCHTITAN_CONFIG_FILE
            from kimik3.model.pretrained import HF_SHARD_BYTES, state_tensors, write_shards

            dst.mkdir(parents=True, exist_ok=True)
            write_shards(to_torchtitan(state_tensors(model), model.config), dst, max_shard_bytes or HF_SHARD_BYTES)
            atomic_write(dst / TORCHTITAN_CONFIG_FILE, lambda tmp: tmp.write_text(model.config.to_json()))
        else:
            model.save_pretrained(dst, layout=args.layout, max_shard_bytes=max_shard_bytes,
                                  pack_experts=args.pack_experts)
    copied = [name for name in ("tokenizer.json", "tokenizer_config.json") if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, dst / name)
    print(f"wrote {dst} ({args.layout} layout, {str(dtype).removeprefix('torch.')}"
          + (f"; copied {', '.join(copied)}" if copied else "") + ")")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kimik3.posttrain.cli import add_posttrain_parsers   # imports this module's helpers: not at its top

    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 in PyTorch: inspect, train, serve.",
                                     formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_Help))
    p = sub.add_parser("params", help="print the parameter counts of a preset or config file")
    p.add_argument("config", nargs="?", default="k3", help="preset name (k3, debug, tiny; k3-vl, debug-vl, tiny-vl "
                   "with the vision tower) or a .json config")
    p.set_defaults(func=cmd_params)

    t = sub.add_parser("train", help="train K3 (default: the tiny preset on the stdlib sources, ~5 minutes)")
    t.add_argument("--preset", default="tiny", help="model preset (tiny, debug, k3)")
    t.add_argument("--config", help="a K3Config JSON file (overrides --preset)")
    t.add_argument("--data", help="folder or file of .txt/code, .jsonl (text field) or .parquet; default: stdlib")
    t.add_argument("--steps", type=int, help="total steps (default: as many as fit --time-budget)")
    t.add_argument("--time-budget", type=float, default=300.0, help="seconds, when --steps is not given")
    t.add_argument("--out", help="run directory (default: runs/<preset>-<time>)")
    t.add_argument("--resume", help="continue the run in this directory up to --steps (from its newest intact "
                   "checkpoint, or from step 0 if it stopped before its first one)")
    t.add_argument("--seed", type=int, default=0, help="seeds the weights, the batches and the sample")
    t.add_argument("--seq-len", type=int, help="fixed sequence length (default: context stages 128/256/512)")
    t.add_argument("--batch-size", type=int, help="sequences per step (default: 4096 tokens / seq-len)")
    t.add_argument("--lr", type=float, default=4e-3, help="peak learning rate of the cosine schedule")
    t.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    t.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="on one CUDA device and process, replay the training step as a CUDA graph (default on)")
    t.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each block (default: on for a CUDA device in one process; CUDA only)")
    t.add_argument("--balance", default="quantile", choices=["quantile", "sign", "none"],
                   help="router-bias balancing: Quantile Balancing (K3), DeepSeek-V3 sign update, or none")
    t.add_argument("--qb-rate", type=float, default=1.0,
                   help="fraction of the way to the quantile bias per step (1: K3's one-shot update)")
    t.add_argument("--checkpoint-async", action="store_true",
                   help="on several ranks: write each sharded checkpoint in the background while training goes on")
    t.add_argument("--qat", choices=["mxfp4"],
                   help="quantisation-aware training: routed experts on MXFP4 weights and MXFP8 inputs "
                        "(saved in the config: every later forward quantises the same way)")
    t.add_argument("--checkpoint-every", metavar="N|DURATION",
                   help="checkpoint every N steps (100) or every DURATION of wall time (30s, 2m); default 60s, "
                        "stretched to 10x a checkpoint write's duration when writes are slow. With --resume: "
                        "the run's own setting unless given")
    t.add_argument("--vision", action="store_true",
                   help="train the multimodal model (the preset's -vl variant) on generated image-text samples "
                        "together with the text corpus")
    t.add_argument("--vision-blank", action="store_true",
                   help="the text-only baseline of --vision: the same run with every image blanked")
    t.add_argument("--vision-text-fraction", type=float, default=0.25,
                   help="with --vision: the fraction of batch rows drawn from the text corpus only")
    t.add_argument("--vision-init", metavar="FILE.safetensors",
                   help="with --vision: start the vision tower from this tower file (contrastive pre-training: "
                        "python -m kimik3.train.vision_contrastive --out FILE.safetensors) instead of from scratch")
    t.add_argument("--vision-eval", type=int, default=1000,
                   help="with --vision: held-out questions answered at the end of the run")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--nproc", type=int, help="train on N processes (relaunches itself through torchrun; "
                   "gloo on CPU, nccl on CUDA); under torchrun, leave it out")
    t.add_argument("--dp", type=int, help="data-parallel degree (default: world size / cp)")
    t.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides dp; borrows dp ranks)")
    t.add_argument("--cp", type=int, default=1, help="context-parallel degree (world = dp x cp)")
    t.add_argument("--ep-planner", default="moonep", choices=["moonep", "none"],
                   help="expert placement under --ep: MoonEP perfect balance, or every expert on its owner")
    t.add_argument("--activation-checkpointing", default="none", type=checkpoint_mode_arg,
                   metavar="{none,full,selective,every:N}",
                   help="what a training step recomputes in backward instead of keeping: nothing (none), every "
                        "block whole (full), the cheap ops between the matmuls and attention of every block "
                        "(selective), or every N-th block whole (every:N); default none")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("train-draft", help="fine-tune a run's MTP module into its speculative-decoding draft "
                       "(docs/speculative.md)")
    d.add_argument("--run", required=True, help="run directory written by kimik3 train (the draft is saved there)")
    d.add_argument("--loss", default="lk", choices=["lk", "kl"],
                   help="lk: -log of the acceptance rate (K3's); kl: KL(target || draft)")
    d.add_argument("--steps", type=int, default=200, help="training steps")
    d.add_argument("--ttt", type=int, default=3, help="draft steps unrolled per chain (training-time test)")
    d.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (warmup, then cosine)")
    d.add_argument("--batch", type=int, default=8, help="sequences per step")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    d.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    d.add_argument("--seed", type=int, default=0, help="seeds the batches and the draft's training")
    d.add_argument("--held-out", type=int, default=32,
                   help="held-out sequences (the run's validation split) for the final acceptance figures")
    d.add_argument("--data", help="corpus to train on (default: the one the run trained on, from its run.json)")
    d.add_argument("--draft-vocab", type=draft_vocab_arg, default="auto", metavar="N",
                   help="a reduced vocabulary: the draft proposes only the N most frequent token ids of its training "
                        "data, through a head of its own (EAGLE-3's; 0: the target's whole vocabulary and head; "
                        "default auto: 32768 when the target's vocabulary exceeds 65536, else 0)")
    d.add_argument("--regenerate", type=int, default=0, metavar="P",
                   help="train (and measure held-out) on the target's own text: each window keeps its first P tokens "
                        "and the target continues it greedily (EAGLE-3 regenerates its data; greedy serving feeds the "
                        "draft such text); 0: the corpus as written")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_train_draft)

    v = sub.add_parser("convert", help="rewrite a run's model in another layout (hf: the released checkpoint's)")
    v.add_argument("src", help="a run or model directory (either layout), or a sharded checkpoint of a run on "
                   "several ranks (streamed: one tensor at a time)")
    v.add_argument("dst", help="the directory to write (created; its tokenizer files are copied along)")
    v.add_argument("--layout", default="hf", choices=["hf", "kimik3", "torchtitan"],
                   help="the layout to write (torchtitan: the port's names, our config as kimik3_config.json)")
    v.add_argument("--max-shard-mb", type=int, help="shard the weights at this size (hf default: 5,000 MB)")
    v.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the dtype to write (default: the one the source stores)")
    v.add_argument("--pack-experts", action="store_true",
                   help="with --layout kimik3: a quantisation-aware (--qat mxfp4) model's routed experts as MXFP4 "
                        "codes + scales, for serving (it cannot resume training)")
    v.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="stream a completion from a trained run")
    g.add_argument("--run", help="run directory written by kimik3 train (default: the newest under ./runs)")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.8, help="0 (or below 1e-5): greedy")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible server for a trained run (docs/serving.md)")
    s.add_argument("--run", help="run directory written by kimik3 train (default: the newest under ./runs)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the run directory's name)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route")
    s.add_argument("--replicas", type=int, default=1, help="engine replicas behind a cache-affinity router")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--memory-mb", type=float, default=None,
                   help="cache budget per replica (MLA blocks + KDA slots); default 256 on the CPU; on a GPU the "
                        "default is --gpu-memory-utilization 0.9")
    s.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU's memory the server may fill (weights, activations, graphs, cache), "
                        "split between replicas; the cache gets what is left (as vLLM's)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="decode with the eager forward every step instead of CUDA graphs")
    s.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: the run's draft (kimik3 train-draft) proposes K tokens a step, verified "
                        "by one forward of the model; greedy output is unchanged, sampled output keeps its "
                        "distribution (default 0: off; docs/speculative.md)")
    s.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per chunked-prefill forward")
    s.add_argument("--hash-block", type=int, default=16, help="prefix-hash block in tokens (512 at full scale)")
    s.add_argument("--physical-block", type=int, default=192, help="MLA block in tokens (6144 at full scale)")
    s.add_argument("--checkpoints", type=int, default=64, help="KDA prefix checkpoints kept (0: no prefix cache)")
    s.add_argument("--prefix-policy", default="ours", choices=["ours", "vllm", "coarse", "none"],
                   help="which KDA checkpoints the prefix cache keeps (docs/prefix_cache.md)")
    s.add_argument("--max-running", type=int, default=32, help="sequences decoded together")
    s.add_argument("--max-waiting", type=int, default=128,
                   help="requests left waiting beyond which new ones get 429 (0: no queue; a request that can "
                        "start at once is always taken)")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, else 413 (default: what the context can hold, "
                        "JSON-escaped, plus 1 MiB)")
    s.add_argument("--chat-template", metavar="FILE", default=None,
                   help="Jinja chat template for /v1/chat/completions (the file, or a JSON file with "
                        "'chat_template' such as a tokenizer_config.json); default: the run's "
                        "tokenizer_config.json, else the built-in one (docs/serving.md)")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("cost", help="what a multi-turn session costs at K3's prices, with and without prefix cache")
    c.add_argument("--turns", type=int, default=50, help="conversation turns")
    c.add_argument("--prefix", type=int, default=400_000, help="prompt tokens seen before, each turn")
    c.add_argument("--new", type=int, default=4_000, help="new prompt tokens each turn")
    c.add_argument("--output", type=int, default=0, help="output tokens each turn")
    c.add_argument("--growing", action="store_true", help="the prefix grows by each turn's new + output tokens")
    c.set_defaults(func=cmd_cost)

    add_posttrain_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for `train --nproc`, which relaunches itself
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, MissingExtra) as err:
        print(f"kimik3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
