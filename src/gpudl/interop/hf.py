"""Hugging Face's GPT-2 folder, both ways: a gpudl GPT out as `GPT2LMHeadModel` (`gpudl export --format hf`,
read by `transformers` and vLLM) and such a folder in as a run's starting point (`model.init_from`).

gpudl's GPT is GPT-2's block (pre-norm LayerNorm, GELU's tanh form, learned positions, a tied head by
default), so the mapping is exact: renames, q/k/v fused into `c_attn`, and transposes, because GPT-2's
`Conv1D` stores a linear layer's weight as (in, out). Nothing is rounded, so a round trip is the
identity on the weights, bit for bit. A model without biases (`model.bias=false`) goes out with zero
biases; one comes in with biases (every GPT-2 has them). docs/interop.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from ..data.tokenizer import FILE, Tokenizer
from ..errors import UserError
from ..models import gpt
from ..models.gpt import GPT, GPTConfig
from .hf_tokenizer import folder_tokenizer, hf_tokenizer_json, tokenizer_config
from .pretrained import Pretrained, read_pickle, read_safetensors

ARCHITECTURE = "GPT2LMHeadModel"
# GELU's tanh form under the names transformers gives it (gpt.GELU_APPROXIMATE is gpudl's).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
LN_EPS = nn.LayerNorm(1).eps  # what gpudl's LayerNorms use: they take no eps setting
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# GPT-2's defaults (transformers' GPT2Config) for keys an older config.json leaves out.
GPT2_DEFAULTS = {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257,
                 "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                 "add_cross_attention": False}

# One block's tensors: GPT-2's module, gpudl's (several: fused along the output dimension, in this order),
# and whether GPT-2 keeps it as a Conv1D, whose weight is the transpose of a linear layer's.
BLOCK = (("ln_1", ("norm1",), False), ("attn.c_attn", ("attn.wq", "attn.wk", "attn.wv"), True),
         ("attn.c_proj", ("attn.wo",), True), ("ln_2", ("norm2",), False),
         ("mlp.c_fc", ("mlp.fc",), True), ("mlp.c_proj", ("mlp.proj",), True))


def _modules(cfg: GPTConfig) -> list[tuple[str, tuple[str, ...], bool, bool]]:
    """Every module of the mapping: (GPT-2 name, gpudl names, Conv1D, has a bias in GPT-2)."""
    out = [("transformer.wte", ("wte",), False, False), ("transformer.wpe", ("wpe",), False, False)]
    for i in range(cfg.n_layer):
        out += [(f"transformer.h.{i}.{hf}", tuple(f"blocks.{i}.{p}" for p in ours), conv, True)
                for hf, ours, conv in BLOCK]
    out.append(("transformer.ln_f", ("norm",), False, True))
    if not cfg.tie_embeddings:  # tied, GPT-2's head is wte and its file has no lm_head (save_pretrained's way)
        out.append(("lm_head", ("lm_head",), False, False))
    return out


def to_gpt2(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """gpudl's state dict -> GPT-2's (contiguous: safetensors stores no strides). Missing biases are zeros."""
    out = {}
    for hf, ours, conv, biased in _modules(cfg):
        weight = torch.cat([state[f"{p}.weight"] for p in ours])
        out[f"{hf}.weight"] = (weight.T if conv else weight).contiguous()
        if biased:
            out[f"{hf}.bias"] = torch.cat([state.get(f"{p}.bias", _zeros(state[f"{p}.weight"])) for p in ours])
    return out


def _zeros(weight: torch.Tensor) -> torch.Tensor:
    return torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)  # a bias has one per output


def from_gpt2(hf: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2's state dict (checked by `check_shapes`) -> gpudl's, for a GPTConfig with biases."""
    out = {}
    for name, ours, conv, biased in _modules(cfg):
        weight = hf[f"{name}.weight"]
        for p, part in zip(ours, (weight.T if conv else weight).chunk(len(ours))):
            out[f"{p}.weight"] = part.contiguous()
        if biased:
            out.update((f"{p}.bias", part.clone()) for p, part in zip(ours, hf[f"{name}.bias"].chunk(len(ours))))
    return out


# ---- out: gpudl's GPT as a Hugging Face folder ----

def export_hf(model: nn.Module, tokenizer: Tokenizer, out: Path) -> Path:
    """Write `out/`: config.json, model.safetensors, generation_config.json, tokenizer.json and
    tokenizer_config.json, the folder `AutoModelForCausalLM.from_pretrained` and `vllm serve` read."""
    if not isinstance(model, GPT):
        raise UserError(f"--format hf writes a GPT as GPT-2's folder; this run's model is a "
                        f"{type(model).__name__}: use --format onnx for a classifier")
    config = hf_config(model, tokenizer)
    tensors = to_gpt2({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, model.cfg)
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("--format hf needs the safetensors package: pip install 'gpudl[export]'") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # transformers wants "pt"
        _write_json(out / "config.json", config)
        _write_json(out / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id")})
        _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, model.cfg.block_size))
        (out / FILE).write_text(hf_tokenizer_json(tokenizer), encoding="utf-8")
    except OSError as e:
        raise UserError(f"--out {str(out)!r}: cannot write there ({e.strerror or e}): choose a folder you can "
                        f"write") from e
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def hf_config(model: GPT, tokenizer: Tokenizer) -> dict:
    """config.json of GPT2LMHeadModel for `model`, refusing, in one line that names it, any setting
    GPT-2 cannot say exactly."""
    c = model.cfg
    unknown = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in _SAID]
    if unknown:  # a GPTConfig field added after this mapping: refused rather than dropped in silence
        raise UserError(f"model.{unknown[0]} has no GPT-2 equivalent: --format hf cannot export this model "
                        f"(use --format gpudl)")
    if gpt.GELU_APPROXIMATE != "tanh":
        raise UserError(f"gpudl's MLP uses GELU approximate={gpt.GELU_APPROXIMATE!r}; GPT-2's gelu_new is the "
                        f"tanh form: --format hf cannot export this model")
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise UserError(f"the model's LayerNorms use different eps ({sorted(eps)}); GPT-2 has one "
                        f"layer_norm_epsilon: --format hf cannot export this model")
    eot = tokenizer.eot_id
    said = {k: v for f in _SAID.values() for k, v in f(c).items()}
    return {"architectures": [ARCHITECTURE], "model_type": "gpt2", **said, "activation_function": "gelu_new",
            "layer_norm_epsilon": eps.pop(), "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False, "initializer_range": 0.02,
            "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32", "use_cache": True}


# Each GPTConfig field as GPT-2's config.json says it. bias: none in gpudl is zeros in GPT-2; mlp_ratio:
# GPT-2's n_inner (null: 4 x n_embd); dropout: gpudl's one probability is GPT-2's three, on the same places.
_SAID = {
    "n_layer": lambda c: {"n_layer": c.n_layer}, "n_head": lambda c: {"n_head": c.n_head},
    "d_model": lambda c: {"n_embd": c.d_model}, "block_size": lambda c: {"n_positions": c.block_size},
    "vocab_size": lambda c: {"vocab_size": c.vocab_size}, "bias": lambda c: {},
    "dropout": lambda c: {"embd_pdrop": c.dropout, "attn_pdrop": c.dropout, "resid_pdrop": c.dropout},
    "mlp_ratio": lambda c: {"n_inner": None if c.mlp_ratio == 4 else c.mlp_ratio * c.d_model},
    "tie_embeddings": lambda c: {"tie_word_embeddings": c.tie_embeddings},
}


# ---- in: a Hugging Face GPT-2 folder as a run's starting point (model.init_from) ----

def read_gpt2_folder(folder: str | Path) -> Pretrained:
    """A Hugging Face GPT-2 folder read and checked: each bad input is one line naming what is wrong."""
    folder = Path(folder)
    fields = gpt_fields(_read_config(folder), folder)
    weights, file = read_weights(folder)
    cfg = GPTConfig(**fields)
    check_shapes(weights, cfg, folder / file)
    return Pretrained(folder, ARCHITECTURE, "gpt", fields, from_gpt2(weights, cfg), file, folder_tokenizer(folder))


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        what = "folder does not exist" if not folder.is_dir() else "folder has no config.json"
        raise UserError(f"model.init_from={str(folder)!r}: the {what}: point it at a Hugging Face GPT-2 folder "
                        f"(config.json and model.safetensors, as save_pretrained writes them)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"model.init_from: {path} is not readable JSON ({e}): restore the file") from None
    if not isinstance(config, dict):
        raise UserError(f"model.init_from: {path} is not a JSON object: restore the file")
    return {**GPT2_DEFAULTS, **config}


def gpt_fields(c: dict, folder: Path) -> dict:
    """GPT-2's config.json -> GPTConfig fields (dropout is left to the recipe: a fine-tune chooses its own)."""
    where = f"model.init_from: {folder / 'config.json'}"
    arch = c.get("architectures") or ([ARCHITECTURE] if c.get("model_type") == "gpt2" else [c.get("model_type")])
    if ARCHITECTURE not in arch:
        raise UserError(f"{where} describes {', '.join(map(str, arch))}, not {ARCHITECTURE}: gpudl brings in "
                        f"GPT-2's layout only")
    wrong = {"activation_function": c["activation_function"] not in TANH_GELU,
             "layer_norm_epsilon": c["layer_norm_epsilon"] != LN_EPS,
             "scale_attn_weights": c["scale_attn_weights"] is not True,
             "scale_attn_by_inverse_layer_idx": c["scale_attn_by_inverse_layer_idx"] is not False,
             "add_cross_attention": c["add_cross_attention"] is not False}
    for key, bad in wrong.items():
        if bad:
            raise UserError(f"{where} has {key}={c[key]!r}; gpudl's GPT computes {_OURS[key]}: it cannot "
                            f"start from this model")
    try:
        width = int(c["n_embd"])
        inner = int(c["n_inner"] or 4 * width)
        fields = {"n_layer": int(c["n_layer"]), "n_head": int(c["n_head"]), "d_model": width,
                  "block_size": int(c["n_positions"]), "vocab_size": int(c["vocab_size"]), "bias": True,
                  "mlp_ratio": inner // width, "tie_embeddings": bool(c["tie_word_embeddings"])}
    except (TypeError, ValueError) as e:
        raise UserError(f"{where} has a size that is not a whole number ({e}): restore the file") from None
    if inner % width:
        raise UserError(f"{where} has n_inner={inner}, not a multiple of n_embd={width}: gpudl's model.mlp_ratio "
                        f"is a whole number")
    return fields


_OURS = {"activation_function": "GELU's tanh form (gelu_new)", "layer_norm_epsilon": f"LayerNorm with eps={LN_EPS}",
         "scale_attn_weights": "attention scaled by 1/sqrt(head_dim)",
         "scale_attn_by_inverse_layer_idx": "the same attention scale in every layer",
         "add_cross_attention": "a decoder without cross-attention"}


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The folder's tensors with GPT-2's names ("transformer." prefixed as save_pretrained writes them;
    the causal-mask buffers old files carry dropped), and the file they came from."""
    file = next((name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if file is None:
        raise UserError(f"model.init_from: {folder} has no {', '.join(WEIGHT_FILES[:-1])} or {WEIGHT_FILES[-1]}: "
                        f"save the model with save_pretrained")
    path = folder / file
    if file.endswith(".bin"):
        raw = _torch_load(path)
    elif file.endswith(".index.json"):
        raw = {k: v for shard in _shards(path) for k, v in _safetensors(folder / shard).items()}
    else:
        raw = _safetensors(path)
    out = {}
    for name, t in raw.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # GPT-2's causal mask, a buffer: not a weight
            continue
        out[name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"] = t
    return out, file


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(path, "save the model again")


def _shards(index: Path) -> list[str]:
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError) as e:
        raise UserError(f"model.init_from: {index} is not a safetensors index ({e}): save the model again") from None
    escaping = [s for s in shards if Path(s).name != s]
    if escaping:  # a shard's name leads out of the folder: never read what the folder does not hold
        raise UserError(f"model.init_from: {index} names {escaping[0]!r}, outside its folder: save the model again")
    return shards


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    return read_pickle(path, "save the model with save_pretrained (safetensors)")


def check_shapes(weights: dict[str, torch.Tensor], cfg: GPTConfig, file: Path) -> None:
    """Every tensor GPT-2 of this config.json has, at its shape, and nothing else (a tied head's copy aside)."""
    with torch.device("meta"):
        expected = to_gpt2(GPT(cfg).state_dict(), cfg)
    for name, shape in ((n, tuple(t.shape)) for n, t in expected.items()):
        if name not in weights:
            raise UserError(f"model.init_from: {file} has no tensor {name}, which its config.json implies: the "
                            f"weights and config.json are of different models")
        if tuple(weights[name].shape) != shape:
            raise UserError(f"model.init_from: {name} in {file} has shape {tuple(weights[name].shape)}, its "
                            f"config.json implies {shape}: the weights and config.json are of different models")
    extra = sorted(set(weights) - set(expected) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if extra:
        raise UserError(f"model.init_from: {file} holds {extra[0]} (and {len(extra) - 1} more), which "
                        f"{ARCHITECTURE} does not have: the weights are of another model")


def folder_shape(folder: Path) -> Pretrained:
    """The folder's model settings from config.json alone (no weights read): what `gpudl plan` sizes."""
    return Pretrained(folder, ARCHITECTURE, "gpt", gpt_fields(_read_config(folder), folder), {}, "config.json")
