"""precision = "fp8": the first step of `parallelize`'s order, the large linears made float8 (torchao).

torchao (an extra: `pip install 'gpudl[fp8]'`) swaps a chosen `nn.Linear` for its `Float8Linear`,
which casts input, weight and output gradient to float8 for the three matmuls of forward and
backward (with dynamic scales: one per row with the "rowwise" recipe, one per tensor with
"tensorwise") and keeps the weight itself in fp32 under the parameter names it had. So the
optimizer, FSDP and checkpoints see the model they would see in bf16-mixed, and a checkpoint moves
between an fp8 run and a bf16-mixed one unchanged.

Which linears: those with both weight dimensions multiples of 16 (what the fp8 matmul kernels
take), large enough for the casts to pay (torchao's own thresholds, below), and not the output
head, whose logits feed the loss directly and whose weight a GPT shares with its embedding (an
embedding lookup has no float8 kernel). Everything else stays in bf16 under autocast.

It comes first in the order (after a pipeline split, which decides what a rank holds), because
the steps after it wrap what it made: tensor parallelism would shard the float8 modules, compile
traces their casts into its kernels, FSDP2 shards their weights (and, with "tensorwise",
all-gathers them in fp8: `enable_fsdp_float8_all_gather`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ..errors import UserError

RECIPES = ("rowwise", "tensorwise")
# Names an output head goes by; a fallback for a head whose weight is not tied to an embedding.
HEAD_NAMES = ("lm_head", "head", "output")


def check_float8_layout(tp: int) -> None:
    """Refuse fp8 with tensor parallelism: float8 linears sharded by tp want torchao's own float8 styles
    (`torchao.float8.float8_tensor_parallel`), which distributed/tensor.py does not use; refused rather
    than run untried."""
    if tp > 1:
        raise UserError(f"precision 'fp8' with parallel.tp={tp} is not supported yet (float8 linears under tensor "
                        f"parallelism): set --set parallel.tp=1 and shard with parallel.dp_shard, or use "
                        f"precision bf16-mixed")


def worth_float8(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether a linear of weight (N=out_features, K=in_features) runs faster in float8 than in bf16.

    The numbers are torchao's (`_auto_filter_for_rowwise` and `_auto_filter_for_tensorwise` in
    torchao/float8/float8_linear_utils.py, torchao 0.18; measured on H100): below them the casts to
    float8 cost more than the faster matmul saves. Copied, not imported: those functions are private.
    """
    n, k = out_features, in_features
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return not (k <= 4096 and n <= 1024)


def _tied_weights(model: nn.Module) -> list:
    """The weights of the model's embeddings: a linear that shares one is an output head."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]


def _shares(weight, tied: list) -> bool:
    # Identity first (how a GPT ties); the storage too, for a model that ties by sharing data. Addresses
    # only of plain tensors in memory: meta and fake tensors (the memory trace) all report 0, and a
    # DTensor's is not its data's.
    def address(t):
        return t.data_ptr() if type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta else None
    here = address(weight)
    return any(weight is t or (here is not None and here == address(t)) for t in tied)


def why_not_float8(name: str, linear: nn.Linear, recipe: str, tied: list, skip_small: bool = True) -> str:
    """Why the linear `name` stays in bf16: "head", "shape" (dims not multiples of 16), "small"; "" if it converts."""
    if _shares(linear.weight, tied) or name.rsplit(".", 1)[-1] in HEAD_NAMES:
        return "head"
    n, k = linear.weight.shape  # (out_features, in_features): a DTensor's are the global ones
    if n % 16 or k % 16:
        return "shape"
    if skip_small and not worth_float8(n, k, recipe):
        return "small"
    return ""


def linear_verdicts(model: nn.Module, recipe: str, skip_small: bool = True) -> dict[str, str]:
    """Every linear of `model` by name, with why it stays bf16 ("" where it becomes float8)."""
    tied = _tied_weights(model)
    return {name: why_not_float8(name, m, recipe, tied, skip_small)
            for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def float8_config(recipe: str, emulate: bool = False, fsdp: bool = False):
    """torchao's config for `recipe`; `fsdp`: the weights will be sharded by FSDP2, and with "tensorwise"
    all-gathered in fp8 (rowwise scales per row of the whole weight, which a shard does not have)."""
    from torchao.float8 import Float8LinearConfig

    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def apply_float8(model: nn.Module, recipe: str, emulate: bool = False, fsdp: bool = False,
                 skip_small: bool = True) -> list[str]:
    """Make `model`'s chosen linears float8 in place (torchao's `convert_to_float8_training`); their names.

    `emulate`: float8 matmuls emulated in higher precision (runs anywhere; for tests). `fsdp`: see
    `float8_config`. `skip_small=False` converts linears below torchao's size thresholds too: only
    for tests, whose models are small enough for a CPU.
    """
    from torchao.float8 import convert_to_float8_training

    chosen = [name for name, why in linear_verdicts(model, recipe, skip_small).items() if not why]
    wanted = set(chosen)
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in wanted,
                               config=float8_config(recipe, emulate, fsdp))
    return chosen


def float8_note(model: nn.Module, recipe: str, skip_small: bool = True) -> str:
    """One line for the start block: how many linears are float8 and why the others stay bf16, e.g.
    `rowwise: 48 of 49 linears in float8; bf16: the output head`."""
    from torchao.float8.float8_linear import Float8Linear

    tied = _tied_weights(model)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept = [why_not_float8(name, m, recipe, tied, skip_small) for name, m in linears
            if not isinstance(m, Float8Linear)]
    words = {"head": ("the output head", "output heads"),
             "shape": ("1 with a dimension not a multiple of 16", "{} with a dimension not a multiple of 16"),
             "small": ("1 below torchao's size threshold", "{} below torchao's size threshold")}
    parts = []
    for why, (one, many) in words.items():
        count = kept.count(why)
        if count:
            parts.append(one if count == 1 else many.format(count))
    note = f"{recipe}: {len(linears) - len(kept)} of {len(linears)} linears in float8"
    return note + (f"; bf16: {', '.join(parts)}" if parts else "")


def scale_precompute(model: nn.Module) -> Callable[[], None]:
    """What runs after each optimizer step when FSDP2 all-gathers float8 weights: every weight's scale
    computed at once, in one all-reduce (torchtitan's optimizer hook), instead of one per weight at
    its all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
