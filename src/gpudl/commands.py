"""What each `gpudl` subcommand does, given its parsed arguments."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from . import models
from .config import load_config, recipe_names
from .device import available, cpu_info, detect
from .errors import UserError

# What `gpudl train` trains when no --config is given: the first run, sized by time on any CPU.
DEFAULT_RECIPE = "gpt-tiny"


def _print_json(data) -> None:
    print(json.dumps(data, indent=1, default=str))


def cmd_info(args, console: Console) -> int:
    from .device.info import as_json, render

    if args.models:
        table = Table("preset", "description", "parameters")
        for name in models.PRESETS:  # described as declared (a ResNet's stem: the rule); counted at 32 px
            n = models.parameter_count(models.resolve(name))
            table.add_row(name, models.describe(models.preset(name)), f"{n / 1e6:,.1f}M")
        console.print(table)
        return 0
    if args.recipes:
        console.print("\n".join(recipe_names()))
        return 0
    infos = [detect(args.device or "auto")]
    if infos[0].type != "cpu":
        infos.append(cpu_info())
    if args.json:
        _print_json({"present": available(), **as_json(infos, measure=not args.no_probe)})
        return 0
    console.print(f"Using device: {infos[0].label}")
    console.print(render(infos, measure=not args.no_probe))
    return 0


def train_config(args):
    """The config `gpudl train` means: a resumed run's own config.toml, else the recipe (the default one
    without --config); --set, --device and --precision on top."""
    from .interop.init_from import source_shape
    from .run.run_dir import resumed_folder

    sets = list(args.sets)
    if args.device:
        sets.append(f"run.device={args.device}")
    if args.precision:
        sets.append(f"train.precision={args.precision}")
    if getattr(args, "plan", None):
        sets.append(f"train.plan={args.plan}")
    if getattr(args, "memory_limit", None):
        sets.append(f"train.memory_limit={args.memory_limit}")
    if args.resume and args.resume != "auto":
        if args.config:
            raise UserError("--resume continues a run with its own config.toml: drop --config "
                            "(use --set to change a setting)")
        path = Path(args.resume)
        if not (path / "config.toml").is_file():
            raise UserError(f"--resume {args.resume!r}: not a run folder (no config.toml in it)")
        return load_config(path / "config.toml", sets)
    cfg = load_config(args.config or DEFAULT_RECIPE, sets)
    run = resumed_folder(cfg, args.resume) if args.resume == "auto" else None
    if run is not None and (run / "config.toml").is_file():  # a restarted worker: the run as its first attempt was
        return load_config(run / "config.toml", sets)
    return source_shape(cfg)  # model.init_from: the source's model settings, for the launcher's preflight and plan too


def print_config(cfg) -> int:
    """`gpudl train --print-config`: the effective settings as TOML on stdout, in the run folder's config.toml
    format, with `auto` still undecided; the model's own fields are checked first, as a run checks them.
    Written plainly: rich would take `[run]` for markup."""
    models.from_config(cfg)
    sys.stdout.write(cfg.to_toml())
    return 0


def cmd_train(args, console: Console) -> int:
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}: e.g. --nproc-per-node 2")
    cfg = train_config(args)
    if args.print_config:
        return print_config(cfg)
    # torchrun's workers have LOCAL_RANK; RANK alone is not one (PyTorchJob gives a node's launcher its rank)
    if "LOCAL_RANK" not in os.environ and (args.nproc_per_node or max(args.nnodes) > 1 or "SLURM_NNODES" in os.environ):
        from .run.launch import launch_training

        return launch_training(args, cfg, console)
    from .run.recipe import train

    result = train(cfg, resume=args.resume, console=console)
    if os.environ.get("RANK", "0") == "0":
        console.print(f"Run folder: {result.run_dir}")
    stopped_by = result.summary.get("stopped_by")
    return 128 + signal.Signals[stopped_by] if stopped_by else 0  # the shell's code for "ended by a signal"


def cmd_launch(args, console: Console) -> int:
    from .run.launch_files import emit

    return emit(args, train_config(args), console)


def cmd_generate(args, console: Console) -> int:
    from .data.tokenizer import run_tokenizer
    from .run.sample import UnknownToken, sample_text
    from .run.trained import find_run, load_trained

    t = load_trained(find_run(args.run_dir), args.device or "auto", "generate")
    if not t.spec.is_language_model:
        raise UserError(f"{t.run_dir} trained {t.spec.name}, not a language model: generate needs a GPT run")
    if args.tokens < 1 or not args.temperature >= 0 or args.top_k < 0:  # `not >=`: NaN is refused too
        raise UserError(f"--tokens must be >= 1, --temperature >= 0 (0: greedy) and --top-k >= 0, got "
                        f"{args.tokens}, {args.temperature:g} and {args.top_k}")
    tokenizer = run_tokenizer(t.run_dir)
    try:
        text = sample_text(t.model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, tokenizer)
    except UnknownToken as e:  # the run's tokenizer.json is not its model's, or the model knows fewer ids than bytes
        raise UserError(f"{t.run_dir}: {e}") from None
    console.print(text, markup=False, highlight=False)
    return 0


def bits_per_byte(loss: float, data) -> float | None:
    """Validation loss in bits per UTF-8 byte of text, comparable across tokenizers: loss / ln 2 /
    bytes per token; None where the data does not know how many bytes a token stands for."""
    import math

    if hasattr(data, "bytes_per_token"):
        per_token = data.bytes_per_token
    else:  # data that does not say (before Data.bytes_per_token): byte-level text only, as evaluate always took it
        per_token = 1.0 if data.vocab_size == 256 else None
    return loss / math.log(2) / per_token if per_token else None


def cmd_evaluate(args, console: Console) -> int:
    from .data import first_batches
    from .run.recipe import evaluation_for
    from .run.trained import find_run, load_trained

    t = load_trained(find_run(args.run_dir), args.device or "auto", "evaluate")
    if t.data.val is None:
        raise UserError(f"{t.run_dir}'s data has no validation part ({t.data.no_val}), then train again")
    if args.batches < 1:
        raise UserError(f"--batches must be >= 1, got {args.batches}")
    metric = evaluation_for(t.spec, t.model)
    sums: dict[str, float] = {}
    samples = 0
    with torch.no_grad():
        for x, y in first_batches(t.data.val, t.data.eval_batches(args.batches), t.device.torch_device):
            for k, v in metric(t.model, (x, y)).items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(x)  # the last batch of a finite set may be smaller
            samples += len(x)
    result = {"run_dir": str(t.run_dir), "step": t.step, "samples": samples,
              **{k: v / samples for k, v in sums.items()}}
    bpb = bits_per_byte(result["loss"], t.data) if t.spec.is_language_model else None
    if bpb is not None:
        result["bits_per_byte"] = bpb
    if args.json:
        _print_json(result)
    else:
        console.print(" · ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    return 0


def cmd_export(args, console: Console) -> int:
    from .run.export import export

    return export(args, console)


def cmd_serve(args, console: Console) -> int:
    from .serve.server import ServeOptions, serve

    return serve(ServeOptions(path=args.model, host=args.host, port=args.port, device=args.device or "auto",
                              precision=args.precision or "auto", max_batch_size=args.max_batch_size,
                              max_queue_delay_ms=args.max_queue_delay_ms, max_queue=args.max_queue,
                              max_wait_s=args.max_wait_s,
                              api_key=args.api_key, request_timeout_s=args.request_timeout_s, name=args.name,
                              threads=args.threads, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                              ssl_ca_certs=args.ssl_ca_certs), console)


def cmd_plan(args, console: Console) -> int:
    from .config.sizes import parse_size
    from .memory.plan import local_machine, plan, target_machine
    from .memory.report import plan_json, plan_table, why

    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise UserError("--nproc-per-node and --nnodes must be >= 1")
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    args.resume = None  # plan takes a recipe as train does, never a run to resume
    cfg = train_config(args)
    machine = target_machine(args.target, args.nproc_per_node, args.nnodes, limit) if args.target else \
        local_machine(args.device or "auto", args.nproc_per_node, args.nnodes, limit)
    if args.json:
        console = Console(stderr=True)
    console.print(f"Tracing one training step of {cfg.model.name} ({models.describe(models.from_config(cfg))}) "
                  f"per layout on fake tensors (nothing is allocated) ...", markup=False, soft_wrap=True)
    result = plan(cfg, machine)
    if args.json:
        _print_json(plan_json(result))
    else:
        if not console.is_terminal:  # a pipe or a file: the whole table, not one squeezed into 80 columns
            console.width = max(console.width, 140)
        console.print(plan_table(result))
    console.print(why(result), markup=False, soft_wrap=True)
    return 0 if result.winner else 2


def _bench_command(args) -> str:
    """The command line as the user could type it again (for the report)."""
    import shlex

    words = ["gpudl", "bench"]
    for flag, values in (("--model", args.models), ("--set", args.sets), ("--device", args.devices),
                         ("--precision", args.precisions)):
        words += [w for v in values for w in (flag, v)]
    for flag, value in (("--config", args.config), ("--batch-size", args.batch_size), ("--out", args.out)):
        words += [flag, str(value)] if value is not None else []
    words += ["--no-compile"] * args.no_compile
    words += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--max-seconds={args.max_seconds:g}"]
    return shlex.join(words)


def cmd_bench(args, console: Console) -> int:
    from .bench import Timing, run_bench

    if args.json:
        console = Console(stderr=True)  # stdout carries only the JSON
    if args.scaling:
        return _bench_scaling(args, console)
    doc = run_bench(models=args.models, config=args.config, sets=args.sets, devices=args.devices,
                    precisions=args.precisions, compile=(False,) if args.no_compile else (False, True),
                    timing=Timing(steps=args.steps, warmup=args.warmup, max_seconds=args.max_seconds),
                    batch_size=args.batch_size, out=args.out,
                    console=console, command=_bench_command(args))
    if args.json:
        _print_json(doc)
    return 0


def _bench_scaling(args, console: Console) -> int:
    from .bench import out_folder
    from .bench.scaling import run_scaling, scaling_markdown, write_scaling

    if len(args.models) > 1 or len(args.devices) > 1:
        raise UserError("--scaling studies one model on one kind of device: give at most one --model and --device")
    folder = out_folder(args.out)
    console.print("Scaling study: each point is a full gpudl train run ...")
    doc = run_scaling(model=(args.models or ["gpt-tiny"])[0], sets=args.sets, device=(args.devices or ["auto"])[0],
                      max_procs=args.max_procs, steps=max(args.steps, 20), console=console)
    written = write_scaling(doc, folder)
    console.print(scaling_markdown(doc), markup=False, highlight=False)
    console.print("Wrote " + ", ".join(str(p) for p in written))
    if args.json:
        _print_json(doc)
    return 0


def cmd_report(args, console: Console) -> int:
    from .observe.report import report_run
    from .run.trained import find_run

    written, notes = report_run(find_run(args.run_dir, fit_runs=True))  # it reads metrics, not the model
    for note in notes:
        console.print(note, markup=False, highlight=False)
    console.print("Wrote " + ", ".join(str(p) for p in written))
    return 0
