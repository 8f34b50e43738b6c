"""The `gpudl` command: a thin layer over the Python API.

Bad input ends with one line on stderr and exit status 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from .errors import UserError


def _common(debug_only: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand must not reset a --debug given before it (gpudl --debug train).
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    if not debug_only:
        p.add_argument("--device", help="auto | cpu | cuda | rocm | mps | xpu | xla (default: auto)")
    return p


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a .toml recipe or the name of a shipped one (see gpudl info --recipes)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting; repeat as needed")
    p.add_argument("--precision", help="auto | fp32 | bf16-mixed | fp16-mixed | bf16-true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpudl", parents=[_common(debug_only=True)],
                                     description="Train CNNs and Transformers as fast as your hardware allows.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()

    p = sub.add_parser("info", parents=[common], help="the devices found, as GPU -> SMs -> cores -> threads")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-probe", action="store_true", help="skip the peak FLOP/s measurement")
    p.add_argument("--models", action="store_true", help="list model presets")
    p.add_argument("--recipes", action="store_true", help="list shipped recipes")

    p = sub.add_parser("train", parents=[common], help="train a model (default: tiny GPT on Python's own source)")
    _config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in this folder from its newest checkpoint")

    p = sub.add_parser("generate", parents=[common], help="sample text from a trained GPT")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=300, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("evaluate", parents=[common], help="validation loss (and accuracy) of a trained run")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")
    p.add_argument("--batches", type=int, default=50, help="validation batches to average over")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("export", parents=[common], help="write a run's weights to one safetensors file")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")
    p.add_argument("--out", help="output file (default: RUN_DIR/model.safetensors)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.debug = getattr(args, "debug", False)
    console = Console()
    try:
        from . import commands

        return getattr(commands, f"cmd_{args.command}")(args, console) or 0
    except UserError as e:
        if args.debug:
            raise
        print(f"gpudl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpudl: interrupted", file=sys.stderr)
        return 130


def print_json(data: dict) -> None:
    print(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
