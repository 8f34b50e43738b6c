"""The typed config tree of a training run: one dataclass per section, each field with its doc and limits.

Each component receives only its own section (`cfg.train`, `cfg.parallel`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .settings import dump_toml, option, to_dict

PrecisionName = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp8"]


@dataclass(kw_only=True)
class RunConfig:
    """Where the run folder goes, the seed, and the device."""

    name: str | None = option(None, "run folder name under `dir`; default: <model>-<date>-<time>")
    dir: str = option("runs", "where run folders live")
    seed: int = option(1337, "seed for initialisation, data order and sampling", ge=0)
    device: str = option("auto", "auto | cpu | cuda | rocm | mps | xpu | xla | <type>[:index]")
    keep_host_memory: bool = option(True, "on the CPU, keep freed memory for the next step instead of "
                                          "returning it to the OS (fewer page faults)")


@dataclass(kw_only=True)
class ModelConfig:
    """A preset name plus overrides of that preset's own fields (checked by the model family)."""

    name: str = option("gpt-tiny", "model preset; `gpudl info --models` lists them")
    init_from: str | None = option(None, "weights to fine-tune from, loaded before step 1 (a new optimizer, step 0): "
                                         "a Hugging Face GPT-2 folder, a torchvision ResNet state dict (.safetensors, "
                                         ".pth), a gpudl run folder or export; all but torchvision's set the model's "
                                         "settings, a GPT's its tokenizer (docs/interop.md)")
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"doc": "preset fields to change"})


@dataclass(kw_only=True)
class DataConfig:
    """What the model trains on and how batches are made (docs/data.md, docs/text.md)."""

    kind: Literal["auto", "text", "tokens", "images", "synthetic"] = option(
        "auto", "auto: text for GPT models, images for CNNs")
    path: str | None = option(None, "text: a file or folder of text, .jsonl or .parquet files, or a dataset saved by "
                                    "Hugging Face datasets; a token file, an image folder, or 'sklearn:digits'; "
                                    "none: the embedded standard-library corpus or generated shapes")
    val_path: str | None = option(None, "an image folder's own validation folder (class subfolders named as "
                                        "data.path's); none: data.val_fraction of data.path is held out")
    tokenizer: str = option(
        "auto", "how text becomes tokens: bytes (UTF-8 bytes, vocabulary 256); bpe (a byte-level BPE trained once on "
                "the training part, sized to model.vocab_size, cached); the path of a tokenizer.json; auto: bpe where "
                "model.vocab_size is above 256, else bytes. A resumed or evaluated run keeps its own tokenizer.json")
    text_field: str = option("text", "the field of a .jsonl line, or the column of a Parquet file or a saved Hugging "
                                     "Face dataset, that holds the text")
    token_dtype: Literal["uint8", "uint16", "uint32"] = option("uint16", "element type of a token file")
    val_fraction: float = option(0.05, "share of the data held out for evaluation", ge=0.0, le=0.5)
    image_size: int = option(32, "side of the square images fed to a CNN", ge=8)
    num_workers: int | Literal["auto"] = option(
        "auto", "loader workers making batches ahead (threads where the work releases the GIL, as decoding an "
                "image folder does; processes otherwise); 0: in the training process; auto: picked from the "
                "cores and the data (the start block says)", ge=0)
    augment: bool = option(True, "an image folder's training batches: random-resized crops (8-100% of the area) "
                                 "and flips; false: the evaluation's resize and centre crop")
    bad_images: Literal["skip", "error"] = option(
        "skip", "an image file that cannot be decoded: skip it (a substitute takes its place; counted in "
                "metrics.jsonl) or stop the run")
    decode: Literal["auto", "host", "device"] = option(
        "auto", "where an image folder's JPEGs are decoded: auto, on a CUDA GPU where torchvision's nvJPEG "
                "decoder is installed, else on the host")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: its length, batch, precision, compile, guards, evaluation and memory plan."""

    max_steps: int = option(600, "optimizer steps (with a time budget: at most)", ge=1)
    time_budget_s: float = option(0.0, "train for about this many seconds (0: no budget): the first steps are "
                                       "timed, then max_steps is lowered to what fits and the schedule follows", ge=0.0)
    batch_size: int = option(32, "samples per micro-batch on each device", ge=1)
    grad_accum: int = option(1, "micro-batches per optimizer step", ge=1)
    precision: PrecisionName = option(
        "auto", "numeric precision: fp32; bf16-mixed (fp32 weights, bf16 autocast); fp16-mixed (the same in fp16, "
                "with loss scaling); bf16-true (bf16 weights); fp8 (bf16-mixed with the large linears in float8 "
                "through torchao, on NVIDIA GPUs of compute capability 8.9 or newer; pip install 'gpudl[fp8]'); "
                "auto: on a GPU the job's own step timed in fp32 and bf16-mixed (fp16-mixed without bf16) and the "
                "faster taken, on the CPU bf16-mixed where its bf16 peak is at least 1.5x fp32's; never fp8")
    fp8_recipe: Literal["rowwise", "tensorwise"] = option(
        "tensorwise", "precision=fp8's scaling: tensorwise, one scale per tensor (the fastest kernels; under FSDP2 "
                      "the weights are all-gathered in fp8, half the bytes of bf16); rowwise, a scale per row of each "
                      "operand (finer, so closer to bf16; it pays only on larger linears, so fewer are converted)")
    compile: bool | Literal["auto", "reduce-overhead"] = option(
        "auto", "torch.compile the model: true (inductor's default), reduce-overhead (also CUDA graphs: one CUDA "
                "process, no activation checkpointing), false; auto: on a GPU the job's own step timed eager, "
                "compiled and with CUDA graphs and the fastest taken, off on the CPU")
    activation_checkpointing: bool | Literal["full", "selective"] = option(
        False, "recompute block activations in backward: true or full, all of them; selective, all but the "
               "outputs of matmuls, attention and convolutions (less memory saved, almost no FLOPs recomputed)")
    attention: Literal["auto", "sdpa"] = option(
        "auto", "attention kernel: auto takes, on the CPU in bf16/fp16, the one measured fastest per shape "
                "(SDPA flash, SDPA math, or a composed one); sdpa: SDPA's own choice everywhere")
    grad_clip: float = option(1.0, "clip the global grad norm to this (0: no clipping)", ge=0.0)
    max_nonfinite: int = option(20, "stop after this many non-finite steps in a row", ge=1)
    spike_factor: float = option(5.0, "a step whose loss exceeds this multiple of the recent median is a loss "
                                      "spike (after the lr warm-up; 0: no detection)", ge=0.0)
    spike_window: int = option(100, "steps whose losses the spike median is taken over", ge=20)
    on_spike: Literal["warn", "skip", "stop"] = option(
        "warn", "what a loss spike does: warn, record it; skip, also skip its update (decided on the device, "
                "a small all-reduce per step); stop, end the run with the step, its batch and the last checkpoint")
    eval_every: int = option(200, "evaluate every N steps (0: only at the end)", ge=0)
    eval_batches: int = option(10, "micro-batches per evaluation", ge=1)
    log_every: int = option(10, "log metrics every N steps", ge=1)
    plan: Literal["off", "auto"] = option(
        "off", "auto: before building anything, estimate the layouts, micro-batches and activation checkpointing "
               "that fit in memory (memory_limit, else the device's) and train with the fastest; the global "
               "batch (batch_size x grad_accum x data-parallel processes) is kept")
    memory_limit: str = option(
        "", "memory per device the run may use, e.g. 12GiB (empty: the device's): enforced (CUDA: the "
            "allocator's share of the GPU; CPU: live tensor bytes) and planned for")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule: linear warm-up, then cosine down to a floor."""

    lr: float = option(3e-3, "peak learning rate", gt=0.0)
    min_lr_ratio: float = option(0.1, "final lr as a share of the peak (cosine floor)", ge=0.0, le=1.0)
    warmup_steps: int = option(50, "linear warm-up steps", ge=0)
    weight_decay: float = option(0.1, "AdamW weight decay on matrices (not on norms and biases)", ge=0.0)
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon", gt=0.0)
    fused: bool | Literal["auto"] = option("auto", "fused AdamW kernel; auto: where the device has one")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints: how often, how many are kept, and the weights exported at the end."""

    every: int = option(200, "save every N steps (0: only at the end)", ge=0)
    keep: int = option(2, "checkpoints to keep (the newest ones)", ge=2)
    export: bool = option(True, "write model.safetensors at the end when safetensors is installed")
    # TOML's `async` (a Python keyword): `cfg.checkpoint.async_save` in Python.
    async_save: bool | Literal["auto"] = option(
        "auto", "copy the state into reused host buffers at the step and write it on a background thread while "
                "training goes on; auto: on when the buffers fit in half the host's available memory",
        key="async")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the processes of a job share the work. The degrees multiply to the number of processes."""

    dp_replicate: int | Literal["auto"] = option("auto", "data-parallel replicas (DDP; HSDP groups with dp_shard)", ge=1)
    dp_shard: int | Literal["auto"] = option("auto", "data-parallel shards (FSDP2)", ge=1)
    tp: int = option(1, "tensor-parallel degree (GPT models)", ge=1)
    pp: int = option(1, "pipeline stages (GPT models)", ge=1)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = option("1f1b", "pipeline schedule")
    pp_microbatches: int = option(4, "micro-batches each batch is split into for the pipeline", ge=1)
    pp_stages_per_rank: int = option(1, "model chunks per pipeline rank (interleaved-1f1b needs >= 2)", ge=1)
    fsdp_reshard_after_forward: bool = option(True, "free gathered parameters after forward (less memory)")
    fsdp_cpu_offload: bool = option(False, "keep sharded parameters and optimizer state in host memory")
    tp_sequence_parallel: bool = option(False, "shard norms and dropout along the sequence too")
    timeout_s: int = option(600, "seconds a collective may wait before the job fails, naming the late rank", ge=5)


@dataclass(kw_only=True)
class LogConfig:
    """What the run shows and writes beside its metrics."""

    tensorboard: bool | Literal["auto"] = option("auto", "TensorBoard events; auto: when installed")
    plot: bool = option(True, "loss curve at the end (PNG with matplotlib, SVG without)")
    progress: bool = option(True, "live progress bar on the console")


@dataclass(kw_only=True)
class SampleConfig:
    """The text sample a GPT run writes at its end (sample.txt)."""

    tokens: int = option(300, "tokens to generate after training a GPT (bytes for a byte-level run; 0: none)", ge=0)
    prompt: str = option("def ", "text that starts the sample")
    temperature: float = option(0.8, "sampling temperature (0: greedy, the likeliest token each time)", ge=0.0)
    top_k: int = option(40, "sample among the k likeliest tokens (0: all)", ge=0)


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def to_toml(self) -> str:
        data = to_dict(self)
        model = data["model"]
        model.update(model.pop("overrides", {}))
        return dump_toml(data)
