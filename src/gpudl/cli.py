"""The `gpudl` command: a thin layer over the Python API.

Bad input ends with one line on stderr and exit status 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--precision", help="auto | fp32 | bf16-mixed | fp16-mixed | bf16-true | fp8")


def _node_range(text: str) -> tuple[int, int]:
    from .run.launch import node_range

    try:
        return node_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _job_size_args(g) -> None:
    g.add_argument("--nproc-per-node", type=int, metavar="N", help="processes on this machine, one per device")
    g.add_argument("--nnodes", type=_node_range, default=(1, 1), metavar="N|MIN:MAX",
                   help="machines in the job; MIN:MAX: elastic, it goes on while MIN remain")
    g.add_argument("--max-restarts", type=int, default=0, help="restart the group this often after a failure")


def _launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (torchrun)")
    _job_size_args(g)
    g.add_argument("--node-rank", type=int, help="this machine's rank (fixed ranks; else assigned on joining)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the machines meet (node 0's address)")


def _launch_file_parser(sub, common) -> None:
    p = sub.add_parser("launch", parents=[common], help="write the file a cluster runs this training job from: "
                                                         "sbatch (SLURM), JobSet or PyTorchJob (Kubernetes), SkyPilot")
    # Checked by the command, not by choices=: a wrong kind is one line, as every other bad input is.
    p.add_argument("--emit", metavar="{slurm,jobset,pytorchjob,skypilot}", help="which scheduler's file to write")
    p.add_argument("--out", metavar="FILE", help="write the file here (default: print it)")
    _config_args(p)
    _job_size_args(p.add_argument_group("the job (each node runs gpudl train --nproc-per-node N)"))
    p.set_defaults(nproc_per_node=1, resume=None)  # resume: the file's own command says --resume auto


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
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in this folder from its newest checkpoint "
                                                       "('auto': run.name's folder if it has one)")
    p.add_argument("--plan", choices=("off", "auto"), help="auto: choose the layout, micro-batch and activation "
                                                          "checkpointing that fit in memory, fastest first "
                                                          "(train.plan)")
    p.add_argument("--memory-limit", metavar="SIZE", help="memory per device the run may use, e.g. 12GiB: enforced "
                                                          "and planned for (train.memory_limit)")
    p.add_argument("--print-config", action="store_true", help="print the settings the run would use (the recipe "
                                                                "with every --set), as TOML, and exit without training")
    _launch_args(p)

    p = sub.add_parser("generate", parents=[common], help="sample text from a trained GPT")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=300,
                   help="tokens to generate (bytes for a byte-level run such as gpt-tiny; BPE tokens where the "
                        "run kept a tokenizer.json)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (the likeliest token each time); "
                                                                    "higher: more varied")
    p.add_argument("--top-k", type=int, default=40, help="draw from the k likeliest tokens only (0: all)")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("evaluate", parents=[common], help="validation loss (and accuracy) of a trained run")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")
    p.add_argument("--batches", type=int, default=50, help="validation batches to average over")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("export", parents=[common], help="write a run's model for another engine: gpudl's safetensors, "
                                                         "a Hugging Face folder (transformers, vLLM) or ONNX (Triton)")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")
    p.add_argument("--format", choices=["gpudl", "hf", "onnx"], default="gpudl",
                   help="gpudl: one safetensors file (gpudl serve); hf: a GPT as GPT2LMHeadModel's folder; onnx: a "
                        "classifier with a dynamic batch axis")
    p.add_argument("--out", help="output file or folder (default: RUN_DIR/model.safetensors, RUN_DIR/hf/, "
                                 "RUN_DIR/model.onnx)")
    p.add_argument("--triton-repo", metavar="DIR", help="with --format onnx: also write Triton's model repository "
                                                        "(DIR/NAME/1/model.onnx and config.pbtxt)")
    _launch_file_parser(sub, common)
    _plan_parser(sub)
    _serve_parser(sub, common)
    _bench_parsers(sub)
    return parser


def _serve_parser(sub, common) -> None:
    p = sub.add_parser("serve", parents=[common], help="answer inference requests over HTTP (Open Inference "
                                                        "Protocol v2; OpenAI API for GPT models)")
    p.add_argument("model", nargs="?", help="a run folder, a folder `gpudl export` wrote, or a .safetensors file "
                                            "`gpudl export --out` wrote (default: the newest run under runs/)")
    p.add_argument("--precision", help="auto (bf16 where the device has it, else fp32) | fp32 | bf16 | fp16")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback needs --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=32, help="rows (classifiers) or sequences (GPT) per call")
    p.add_argument("--max-queue-delay-ms", type=float, default=5.0,
                   help="classifiers: how long a batch waits to fill after its first request")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting at most; more are answered 429")
    p.add_argument("--max-wait-s", type=float, default=0.5,
                   help="admit a request only if it can start within this many seconds, estimated from the "
                        "measured service rate; the rest are answered 429 with Retry-After at once (0: off)")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="a request still queued after this: 504")
    p.add_argument("--api-key", help="requests must send it (Authorization: Bearer KEY); or set GPUDL_API_KEY")
    p.add_argument("--name", help="what clients call the model (default: its preset's name, e.g. gpt-tiny)")
    p.add_argument("--threads", type=int, help="CPU: torch threads for the model (default: the fewest within "
                                               "10%% of the fastest, measured at start)")
    p.add_argument("--ssl-certfile", metavar="PEM", help="serve https: the server's certificate (with --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", metavar="PEM", help="the certificate's private key (unencrypted PEM)")
    p.add_argument("--ssl-ca-certs", metavar="PEM", help="require a client certificate signed by this CA (mutual TLS)")


def _plan_parser(sub) -> None:
    from .device.specs import TARGETS  # the planner's table, so the help lists every GPU it knows and no other

    p = sub.add_parser("plan", parents=[_common()], help="will it fit? every layout's predicted memory and "
                                                          "step time, and the fastest that fits")
    _config_args(p)
    p.add_argument("--target", metavar="GPU", help=f"plan for a GPU that is not here: {', '.join(TARGETS)}")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="devices per machine")
    p.add_argument("--nnodes", type=int, default=1, help="machines")
    p.add_argument("--memory-limit", metavar="SIZE", help="plan for this much memory per device (e.g. 12GiB)")
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout")


def _bench_parsers(sub) -> None:
    p = sub.add_parser("bench", parents=[_common(debug_only=True)],
                       help="throughput, MFU and memory per device x precision x compile, with a report and plots")
    p.add_argument("--model", dest="models", action="append", default=[], metavar="NAME",
                   help="a recipe or preset; repeat for several (default: gpt-tiny and resnet18)")
    p.add_argument("--config", help="a .toml recipe to benchmark (its model, batch size and data)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting of every model's config; repeat as needed")
    p.add_argument("--device", dest="devices", action="append", default=[], metavar="DEVICE",
                   help="cpu | cuda | rocm | mps | xpu | xla | all; repeat for several (default: all present)")
    p.add_argument("--precision", dest="precisions", action="append", default=[], metavar="PRECISION",
                   help="auto | fp32 | bf16-mixed | fp16-mixed | bf16-true; repeat for several "
                        "(default: fp32 and the mixed precisions each device runs)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile cells")
    p.add_argument("--steps", type=int, default=30, help="timed steps per cell, at most")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop timing a cell after this long (at least 3 steps); default 10")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per cell (compile happens here)")
    p.add_argument("--batch-size", type=int, help="samples per step for every model (default: each recipe's)")
    p.add_argument("--out", help="output folder (default: bench/<date>-<time>)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (progress on stderr)")
    p.add_argument("--scaling", action="store_true",
                   help="instead: train on 1, 2, 4 ... N processes of this machine; throughput and efficiency")
    p.add_argument("--max-procs", type=int, help="largest process count for --scaling (default: devices or cores)")

    p = sub.add_parser("report", parents=[_common(debug_only=True)],
                       help="plots and a Markdown page of a training run: loss, throughput, memory")
    p.add_argument("run_dir", nargs="?", help="run folder (default: the newest under runs/)")


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


if __name__ == "__main__":
    raise SystemExit(main())
