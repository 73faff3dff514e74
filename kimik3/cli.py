"""``kimik3 <command>``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kimik3.config import K3Config, format_param_table


def _load_config(name_or_path: str) -> K3Config:
    if name_or_path.endswith(".json"):
        return K3Config.from_json(name_or_path)
    return K3Config.preset(name_or_path)


def cmd_params(args: argparse.Namespace) -> int:
    print(format_param_table(_load_config(args.config)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from kimik3.train.trainer import TrainArgs, Trainer

    train_args = TrainArgs(
        preset=args.preset, config_path=args.config, data=args.data, steps=args.steps,
        time_budget_s=args.time_budget, out=args.out, seed=args.seed, seq_len=args.seq_len,
        batch_size=args.batch_size, lr=args.lr, device=args.device, balance=args.balance, qb_rate=args.qb_rate,
        progress=not args.no_progress)
    Trainer(train_args, resume=args.resume).run()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.train.tokenizer import EOS, load_tokenizer

    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist (train one with `kimik3 train`)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 in PyTorch: inspect, train, serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="print the parameter counts of a preset or config file")
    p.add_argument("config", nargs="?", default="k3", help="preset name (k3, debug, tiny) or a .json config")
    p.set_defaults(func=cmd_params)

    t = sub.add_parser("train", help="train K3 (default: the tiny preset on the stdlib sources, ~5 minutes)")
    t.add_argument("--preset", default="tiny", help="model preset (tiny, debug, k3)")
    t.add_argument("--config", help="a K3Config JSON file (overrides --preset)")
    t.add_argument("--data", help="folder or file of .txt/code, .jsonl (text field) or .parquet; default: stdlib")
    t.add_argument("--steps", type=int, help="total steps (default: as many as fit --time-budget)")
    t.add_argument("--time-budget", type=float, default=300.0, help="seconds, when --steps is not given")
    t.add_argument("--out", help="run directory (default: runs/<preset>-<time>)")
    t.add_argument("--resume", help="continue the run in this directory up to --steps")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--seq-len", type=int, help="fixed sequence length (default: context stages 128/256/512)")
    t.add_argument("--batch-size", type=int, help="sequences per step (default: 4096 tokens / seq-len)")
    t.add_argument("--lr", type=float, default=4e-3)
    t.add_argument("--device", default="cpu")
    t.add_argument("--balance", default="quantile", choices=["quantile", "sign", "none"],
                   help="router-bias balancing: Quantile Balancing (K3), DeepSeek-V3 sign update, or none")
    t.add_argument("--qb-rate", type=float, default=1.0,
                   help="fraction of the way to the quantile bias per step (1: K3's one-shot update)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="stream a completion from a trained run")
    g.add_argument("--run", required=True, help="run directory written by kimik3 train")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"kimik3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
