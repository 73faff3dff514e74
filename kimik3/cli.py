"""``kimik3 <command>``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys

from kimik3.config import K3Config, format_param_table


def _load_config(name_or_path: str) -> K3Config:
    if name_or_path.endswith(".json"):
        return K3Config.from_json(name_or_path)
    return K3Config.preset(name_or_path)


def cmd_params(args: argparse.Namespace) -> int:
    print(format_param_table(_load_config(args.config)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 in PyTorch: inspect, train, serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="print the parameter counts of a preset or config file")
    p.add_argument("config", nargs="?", default="k3", help="preset name (k3, debug, tiny) or a .json config")
    p.set_defaults(func=cmd_params)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"kimik3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
