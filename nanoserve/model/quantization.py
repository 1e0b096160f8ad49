"""FP8 checkpoint formats: a `config.json` `quantization_config` read into one `Fp8Scheme`.

Three formats load (all FP8 e4m3 weights `[out, in]` with float32 or bf16 scales; the
weight is `fp8 * scale`, the scale broadcast over its block):

| `quant_method` | weight scale tensor | its shape | activations |
|---|---|---|---|
| `compressed-tensors`, `format: float-quantized` | `weight_scale` | `[1]` or `[]` (tensor), `[out, 1]` (channel), `[ceil(out/bo), ceil(in/bi)]` (block) | static `input_scale` `[1]`, or dynamic per token |
| `fbgemm_fp8` | `weight_scale` | `[out, 1]` | dynamic per token, amax capped at `activation_scale_ub` |
| `fp8` | `weight_scale_inv` with `weight_block_size`, else `weight_scale` | `[ceil(out/bo), ceil(in/bi)]`, else `[1]` or `[]` | `activation_scheme`: dynamic, or static `input_scale` |

Which linears are FP8 is read from the tensors themselves (an e4m3 weight beside its scale),
so the layers a config leaves out (`ignore`, `modules_to_not_convert`, `ignored_layers`: the
LM head, say) need no name matching: they are stored unquantized and load as such.

Torch-free: a job's driver reads configs before any worker loads weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import ModelError

SUPPORTED = ("compressed-tensors float-quantized (FP8 e4m3, per-tensor, per-channel or "
             "block weights)", "fbgemm_fp8", "fp8 (per-tensor or block-wise)")
ONLINE = ("fp8",)  # what LLM(quantization=...) / --quantization accept


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 checkpoint's linears are stored (see the module table)."""

    method: str  # the config's quant_method
    weight_scale_name: str  # "weight_scale" or "weight_scale_inv" (fp8 block-wise)
    block: tuple[int, int] | None  # block-wise scales' (rows, cols) per block; None: per
    # tensor or per channel, told apart by the scale's shape
    static_input: bool  # `input_scale` tensors give the activations' scale; else per token
    activation_scale_ub: float | None = None  # fbgemm: cap on a token's amax


def read_scheme(qc: Any) -> Fp8Scheme | None:
    """A `quantization_config` (None or {} for an unquantized checkpoint) as an `Fp8Scheme`;
    anything else is a one-line `ModelError` naming what loads."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        _refuse(f"quantization_config {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        return Fp8Scheme(method, "weight_scale", None, static_input=False,
                         activation_scale_ub=float(qc.get("activation_scale_ub", 1200.0)))
    if method == "fp8":
        return _fp8(qc)
    _refuse(f"quant_method {method!r}")


def check_online(quantization: str | None) -> None:
    """`quantization` as LLM / the CLIs take it: None or "fp8"."""
    if quantization is not None and quantization not in ONLINE:
        raise ModelError(f"unknown quantization {quantization!r}; choose {', '.join(ONLINE)} "
                         f"(or none)")


def _refuse(what: str) -> None:
    raise ModelError(f"unsupported {what}; nanoserve loads FP8 checkpoints only: "
                     f"{'; '.join(SUPPORTED)}")


def _fp8(qc: dict) -> Fp8Scheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        _refuse(f"fp8 fmt {qc['fmt']!r}")
    static = qc.get("activation_scheme", "dynamic") == "static"
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "weight_scale", None, static_input=static)
    if static or not (isinstance(block, list) and len(block) == 2):
        _refuse(f"fp8 block-wise variant (weight_block_size {block!r}, activation_scheme "
                f"{qc.get('activation_scheme')!r})")
    return Fp8Scheme("fp8", "weight_scale_inv", (int(block[0]), int(block[1])),
                     static_input=False)


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        _refuse("compressed-tensors config without config_groups")
    schemes = {_ct_group(g, qc.get("format")) for g in groups}
    if len(schemes) > 1:
        _refuse("compressed-tensors config whose groups differ in scheme")
    return schemes.pop()


def _ct_group(group: dict, top_format: str | None) -> Fp8Scheme:
    fmt = group.get("format") or top_format
    w = group.get("weights") or {}
    what = (f"compressed-tensors scheme (format {fmt!r}, weights {w.get('type')!r} "
            f"{w.get('num_bits')}-bit {w.get('strategy')!r})")
    if (fmt != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8
            or not w.get("symmetric", True) or w.get("dynamic", False)
            or w.get("strategy") not in ("tensor", "channel", "block")):
        _refuse(what)
    block = None
    if w["strategy"] == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2):
            _refuse(f"{what} with block_structure {bs!r}")
        block = (int(bs[0]), int(bs[1]))
    a = group.get("input_activations")
    static = False
    if a is not None:
        if a.get("type") != "float" or a.get("num_bits") != 8:
            _refuse(f"{what} with {a.get('type')!r} {a.get('num_bits')}-bit activations")
        static = not a.get("dynamic", False)
        if static and a.get("strategy") != "tensor":
            _refuse(f"{what} with static {a.get('strategy')!r} activations")
    return Fp8Scheme("compressed-tensors", "weight_scale", block, static_input=static)


def scale_names(scheme: Fp8Scheme, shapes: dict[str, Any]) -> list[str]:
    """The names of the scale tensors that may sit beside the expected 2-D `.weight`s of
    `shapes` (Hugging Face names) in a checkpoint stored as `scheme`."""
    out = []
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2 and name != "model.embed_tokens.weight":
            prefix = name[:-len("weight")]
            out += [prefix + scheme.weight_scale_name, prefix + "input_scale"]
    return out
