"""FP8 e4m3 weights: quantize / dequantize helpers, `Fp8Linear` (one projection through
`torch._scaled_mm`), and `build_with_fp8` (a model from a checkpoint's state dict: FP8 GEMMs where
the device has them, the weights dequantized where it does not).

Two paths, chosen by the device (`fp8_supported`):
- CPU, and GPUs before sm_89: an FP8 checkpoint is dequantized at load (`fp8 * scale` in
  float32, then the compute dtype) and the model runs unchanged; FP8 compute
  (`quantization="fp8"`) is refused with one line.
- GPUs of compute capability 8.9+: every projection of a decoder layer (fused q/k/v,
  o, fused gate/up, down) whose weights are FP8 (in the checkpoint, or quantized here at
  load with `quantization="fp8"`) becomes an `Fp8Linear`; embeddings, norms and the LM
  head stay in the compute dtype.

Scales inside `Fp8Linear` are always per output row (`[N]`) with per-token activation
scales, applied after a unit-scale `_scaled_mm` (`Fp8Linear`'s docstring says why). A
per-tensor scale is expanded into rows, which is exact; so fused q/k/v and gate/up whose
parts carry separate per-tensor scales keep each part's own scale (no second rounding, as
requantizing to the largest scale would cost).
Block-wise checkpoints are requantized per row at load (one more rounding: at most 1/16 of
a weight's magnitude, like any e4m3 rounding). Per-token activation scales keep a row's
result independent of the rows that share its batch. A checkpoint's static `input_scale`
is honoured (the largest of a fused group's parts: never overflows); checkpoints that ask
for weight-only FP8 (no `input_activations`) or per-group activations still get per-token
activations here, the one activation scheme of this path.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.errors import ModelError
from nanoserve.model.config import STACKED, ModelConfig
from nanoserve.model.model import FP8Out, LlamaForCausalLM, QuantizedRows, ScaledRows, build_model
from nanoserve.model.moe import MoeExperts, SparseMoeBlock
from nanoserve.model.quantization import Fp8Scheme, check_online
from nanoserve_kernels import backend as kernel_backend
from nanoserve_kernels.fp8_quant import quantize_rows as quantize_rows_triton
from nanoserve_kernels.fp8_quant import quantize_rows_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12  # an all-zero row or tensor still gets a finite, nonzero scale
# Hopper's FP8 tensor cores sum a GEMM's products in their own accumulator, without moving
# the partial sums into float32 registers every few steps of K: 3% faster on the 8B
# workload (benchmarks/RESULTS.md), with the logits within the FP8 tests' tolerance (the
# e4m3 rounding of each activation, ~3.6%, is the larger error). vLLM's FP8 kernels do too.
FAST_ACCUM = True

# a decoder layer's GEMMs: the model's projection name -> the checkpoint linears it joins
PROJECTIONS = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "self_attn.o_proj": ("self_attn.o_proj",),
               "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "mlp.down_proj": ("mlp.down_proj",)}


def fp8_supported(device: str | torch.device) -> bool:
    """Whether `device` computes FP8 GEMMs: a CUDA GPU of compute capability 8.9 or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# --- quantize / dequantize (w: [N, K] weights, any float dtype) ------------------------------


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale [1]) with w ~= q * scale."""
    scale = w.abs().amax().float().clamp(min=MIN_AMAX).reshape(1) / FP8_MAX
    return _cast(w.float() / scale), scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale [N, 1]): one scale per output row."""
    scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=MIN_AMAX) / FP8_MAX
    return _cast(w.float() / scale), scale


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale [ceil(N/bo), ceil(K/bi)]): one scale per
    bo x bi block (edge blocks are partial)."""
    (n, k), (bo, bi) = w.shape, block
    rows, cols = -(-n // bo), -(-k // bi)
    padded = w.new_zeros(rows * bo, cols * bi)
    padded[:n, :k] = w
    blocks = padded.view(rows, bo, cols, bi)
    scale = blocks.abs().amax(dim=(1, 3)).float().clamp(min=MIN_AMAX) / FP8_MAX  # [rows, cols]
    return _cast(w.float() / _expand(scale, block, n, k)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 q [N, K] with its scale ([] or [1] per tensor, [N, 1] or [N] per channel, or
    [ceil(N/bo), ceil(K/bi)] with `block`) -> q * scale [N, K], computed in float32."""
    s = scale.float()
    if block is not None:
        s = _expand(s, block, *q.shape)
    elif s.numel() > 1:
        s = s.reshape(-1, 1)
    return (q.float() * s).to(dtype)


def quantize_rows(x: torch.Tensor, ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: x [M, K] -> (e4m3 [M, K], float32
    scale [M, 1]); a row's amax is capped at `ub` (fbgemm's activation_scale_ub), values
    beyond it saturate. One Triton launch on a GPU (nanoserve_kernels/fp8_quant.py), else its
    PyTorch reference."""
    if kernel_backend.use_triton(x.device):
        return quantize_rows_triton(x, ub)
    return quantize_rows_reference(x, ub)


def _cast(x: torch.Tensor) -> torch.Tensor:
    # e4m3fn has no infinity: a value past 448 would become NaN, so saturate first
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _expand(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(n/bo), ceil(k/bi)] -> one per element [n, k]."""
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


# --- the FP8 GEMM -----------------------------------------------------------------------------


class Fp8Linear(nn.Module):
    """y = x W^T (+ bias) with W = weight * weight_scale (per output row), x quantized to
    e4m3 per token (or by a static input scale), returned in x's dtype.

    The GEMM is `torch._scaled_mm(xq, weight.t())` at unit scales (one scale per tensor:
    cuBLAS picks its kernels for that by the shape, up to 2.2x faster at decode sizes than
    its row-wise-scaled one, a 128 x 128 tile at every size; summed as `FAST_ACCUM` says);
    its raw output (bfloat16 on a GPU, x's dtype on the CPU) is then scaled per row and
    column (nanoserve_kernels/scaled_rows.py): by one kernel here, or, with `keep_scales`
    (`nanoserve.model.model._project`), by the kernel that reads the output next, which gets
    `ScaledRows`. Either way y is ((raw * x_scale) * weight_scale) rounded to x's dtype,
    the same bits.

    weight: e4m3 [N, K], contiguous (its `.t()` is the column-major second operand);
    weight_scale: float32 [1, N]; input_scale: float32 [1, 1] or None (dynamic);
    bias: [N] or None. N and K multiples of 16 (`_scaled_mm`'s constraint)."""

    keeps_scales = True  # forward takes keep_scales (nanoserve.model.model._project)

    def __init__(self, weight: torch.Tensor, row_scale: torch.Tensor,
                 input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 activation_scale_ub: float | None = None) -> None:
        super().__init__()
        n, k = weight.shape
        if weight.dtype != FP8 or n % 16 or k % 16:
            raise ValueError(f"Fp8Linear needs an e4m3 weight with both sides multiples "
                             f"of 16, got {weight.dtype} {list(weight.shape)}")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", row_scale.float().reshape(1, n).contiguous())
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.float().reshape(1, 1))
        self.register_buffer("bias", bias)
        self.register_buffer("unit_scale", torch.ones((), device=weight.device),
                             persistent=False)
        self.activation_scale_ub = activation_scale_ub

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor | QuantizedRows,
                keep_scales: bool = False) -> torch.Tensor | ScaledRows:
        """x [..., K] -> [..., N] in x.dtype. x may come quantized per row already (by the
        kernel before: `fuse_activation_quant`; dynamic input scales only). keep_scales:
        return `ScaledRows` when the raw output is in x's dtype and there is no bias (the
        caller's next kernel applies the scales), else y as always."""
        lead = x.shape[:-1]
        if isinstance(x, QuantizedRows):
            xq, x_scale = x.q, x.scale
        elif self.input_scale is None:
            x2 = x.reshape(-1, x.shape[-1])  # [M, K]
            xq, x_scale = quantize_rows(x2, self.activation_scale_ub)  # [M, K], [M, 1]
        else:
            x2 = x.reshape(-1, x.shape[-1])
            x_scale = self.input_scale.expand(x2.shape[0], 1).contiguous()
            xq = _cast(x2 / self.input_scale)
        # raw sums of e4m3 products reach far past float16's range: bfloat16 on a GPU
        raw_dtype = torch.bfloat16 if xq.is_cuda else x.dtype
        raw = torch._scaled_mm(xq, self.weight.t(), scale_a=self.unit_scale,
                               scale_b=self.unit_scale, out_dtype=raw_dtype,
                               use_fast_accum=FAST_ACCUM)  # [M, N]
        shape = torch.Size((*lead, raw.shape[-1]))
        if keep_scales and raw_dtype == x.dtype and self.bias is None:
            return ScaledRows(raw, x_scale, self.weight_scale, shape)
        y = kernel_backend.scale_rows(raw, x_scale, self.weight_scale, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(shape)

    def dequantized(self) -> torch.Tensor:
        """The weight this linear stands for: [N, K] float32."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"input={'static' if self.input_scale is not None else 'per-token'}")


# --- building a model -------------------------------------------------------------------------


def build_with_fp8(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   quantization: str | None = None) -> LlamaForCausalLM:
    """The model for a checkpoint's state dict (`weights.load_checkpoint`), FP8 where the
    checkpoint (`config.quantization`) or the caller (`quantization="fp8"`: quantized here,
    per row, one matrix at a time) asks and the device computes it; see the module
    docstring. `state_dict` is consumed (its tensors are popped as they are converted)."""
    device = torch.device(device)
    check_quantization(quantization, device)
    scheme = config.quantization
    if scheme is None and quantization is None:
        return build_model(config, state_dict, dtype, device)
    if not fp8_supported(device):
        return build_model(config, dequantized(state_dict, scheme, dtype), dtype, device)
    projections = {}
    for layer in range(config.num_hidden_layers):
        for proj, parts in layer_projections(config, layer).items():
            names = [f"model.layers.{layer}.{p}" for p in parts]
            linear = _fp8_projection(state_dict, names, scheme, quantization is not None,
                                     dtype, device)
            if linear is not None:
                projections[f"model.layers.{layer}.{proj}"] = linear
        if config.is_moe_layer(layer):
            experts = _fp8_experts(state_dict, f"model.layers.{layer}.mlp.experts.", scheme,
                                   quantization is not None, dtype, device)
            if experts is not None:
                projections[f"model.layers.{layer}.mlp.experts"] = experts
    rest = dequantized(state_dict, scheme, dtype) if scheme is not None else state_dict
    return fuse_activation_quant(build_model(config, rest, dtype, device,
                                             projections=projections))


def fuse_activation_quant(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Each kernel whose output goes only to an FP8 projection with per-token activation
    scales quantizes that output itself (`nanoserve.model.model.FP8Out`), saving the projection
    its own quantization launch: a layer's input norm (for q/k/v), its post-attention norm
    (for gate/up), silu-and-mul (for down). The attention's output still goes through
    `quantize_rows` in o_proj; the final norm feeds the LM head. Same values either way:
    the fused kernels quantize exactly as `quantize_rows` does. Returns `model`."""
    for layer in model.model.layers:
        layer.input_layernorm.fp8_out = _dynamic_fp8_input(layer.self_attn.qkv)
        if isinstance(layer.mlp, SparseMoeBlock):  # the router reads the norm's output too
            continue
        layer.post_attention_layernorm.fp8_out = _dynamic_fp8_input(layer.mlp.gate_up)
        layer.mlp.fp8_act = _dynamic_fp8_input(layer.mlp.down_proj)
    return model


def _dynamic_fp8_input(linear) -> FP8Out | None:
    if isinstance(linear, Fp8Linear) and linear.input_scale is None:
        return FP8Out(linear.activation_scale_ub)
    return None


def layer_projections(config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """`PROJECTIONS` of `layer`: the attention's only on a mixture-of-experts layer (its
    experts are `MoeExperts`, nanoserve/model/moe.py)."""
    if config.is_moe_layer(layer):
        return {k: v for k, v in PROJECTIONS.items() if k.startswith("self_attn.")}
    return PROJECTIONS


def quantize_experts(w: torch.Tensor, device: torch.device, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights w [E, N, K] (anywhere) -> (e4m3 [E, N, K], float32 row scales
    [E, N]) on `device`, one expert's matrix at a time there in `dtype`."""
    q = torch.empty(w.shape, dtype=FP8, device=device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=device)
    for e in range(w.shape[0]):
        q[e], s = quantize_per_channel(w[e].to(device=device, dtype=dtype))
        scale[e] = s.reshape(-1)
    return q, scale


def _fp8_experts(sd: dict[str, torch.Tensor], prefix: str, scheme: Fp8Scheme | None,
                 online: bool, dtype: torch.dtype, device: torch.device) -> MoeExperts | None:
    """FP8 experts from a layer's stacked tensors (`prefix` + gate_up_proj / down_proj,
    popped from `sd`): stored e4m3 with their scales (nanoserve/weights/moe_weights.py), or
    quantized per row here (`online`); None (and `sd` untouched) where they stay as they are."""
    stored = sd[prefix + STACKED[0]].dtype == FP8
    if not (stored or online or scheme is not None):  # an FP8 checkpoint's experts that
        return None  # came dequantized (nanoserve/weights/moe_weights.py) are requantized per row
    parts = []
    for name in STACKED:
        w = sd.pop(prefix + name)
        if stored:
            parts += [w.to(device), sd.pop(prefix + name + "_scale").to(device)]
        else:
            parts += list(quantize_experts(w, device, dtype))
    block = scheme.block if stored and parts[1].dim() == 3 else None
    return MoeExperts.fp8(*parts, block=block)


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """e4m3 experts [E, N, K] with row scales [E, N] or block scales -> [E, N, K] in dtype."""
    return torch.stack([dequantize(q[e], scale[e], block if scale.dim() == 3 else None, dtype)
                        for e in range(q.shape[0])])


def check_quantization(quantization: str | None, device: str | torch.device) -> None:
    """Refuse, in one line, an unknown `quantization` or FP8 compute on a device without it."""
    check_online(quantization)
    device = torch.device(device)
    if quantization is not None and not fp8_supported(device):
        raise ModelError(f"quantization={quantization!r} needs FP8 compute: a GPU of compute "
                         f"capability 8.9 or newer, not {_describe(device)}")


def dequantized(state_dict: dict[str, torch.Tensor], scheme: Fp8Scheme | None,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state_dict` with every e4m3 weight replaced by `dequantize(weight, its scale)` in
    `dtype` and the scale tensors dropped; other tensors as they are. Consumes the dict."""
    out = {}
    for name in list(state_dict):
        if name.endswith(STACKED) and state_dict[name].dtype == FP8:  # experts [E, N, K]
            out[name] = dequantize_experts(state_dict.pop(name), state_dict.pop(name + "_scale"),
                                           _block(scheme), dtype)
        elif name.endswith(".weight") and state_dict[name].dtype == FP8:
            prefix = name[:-len("weight")]
            q = state_dict.pop(name)
            out[name] = dequantize(q, _scale(state_dict, prefix, scheme, q), _block(scheme), dtype)
    for name, t in state_dict.items():
        if not name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            out[name] = t
    state_dict.clear()
    return out


def _fp8_projection(sd: dict[str, torch.Tensor], names: list[str], scheme: Fp8Scheme | None,
                    online: bool, dtype: torch.dtype, device: torch.device) -> Fp8Linear | None:
    """One `Fp8Linear` for the checkpoint linears `names` (joined by rows), their tensors
    popped from `sd`; None (and `sd` untouched) where they stay in the compute dtype: a part
    stored unquantized (and no online quantization), or sides not multiples of 16."""
    weights = [sd[n + ".weight"] for n in names]
    stored = [w.dtype == FP8 for w in weights]
    if not (online or all(stored)):
        return None
    if weights[0].shape[1] % 16 or sum(w.shape[0] for w in weights) % 16:
        return None
    qs, rows, inputs = [], [], []
    for n, w, is_fp8 in zip(names, weights, stored):
        if is_fp8:
            scale = _scale(sd, n + ".", scheme, w).to(device)
            q, row = _per_row(w.to(device), scale, _block(scheme))
            if scheme.static_input:
                inputs.append(_input_scale(sd, n, device))
        else:  # online: this matrix alone is on the device in its own dtype
            q, row = quantize_per_channel(w.to(device=device, dtype=dtype))
        qs.append(q)
        rows.append(row.reshape(-1))
        del sd[n + ".weight"]
        for suffix in (".weight_scale", ".weight_scale_inv", ".input_scale"):
            sd.pop(n + suffix, None)
    biases = [sd.pop(n + ".bias") for n in names if n + ".bias" in sd]
    bias = torch.cat(biases).to(device=device, dtype=dtype) if biases else None
    # static input scales only when every part has one (a part quantized here has none)
    input_scale = torch.stack(inputs).amax() if inputs and len(inputs) == len(names) else None
    ub = scheme.activation_scale_ub if scheme is not None else None
    return Fp8Linear(torch.cat(qs), torch.cat(rows), input_scale, bias, ub)


def _per_row(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored e4m3 weight and its scale -> (e4m3 [N, K], row scales [N])."""
    if block is not None:  # requantize per row from the exact dequantized weight
        q, scale = quantize_per_channel(dequantize(q, scale, block))
        return q, scale.reshape(-1)
    return q, scale.float().reshape(-1).expand(q.shape[0]).contiguous()


def _block(scheme: Fp8Scheme | None) -> tuple[int, int] | None:
    return scheme.block if scheme is not None else None


def _scale(sd: dict[str, torch.Tensor], prefix: str, scheme: Fp8Scheme | None,
           q: torch.Tensor) -> torch.Tensor:
    """The weight scale of the e4m3 weight `prefix + "weight"`, its shape checked."""
    if scheme is None:
        raise ModelError(f"tensor {prefix}weight is FP8 but config.json has no "
                         f"quantization_config")
    name = prefix + scheme.weight_scale_name
    if name not in sd:
        raise ModelError(f"tensor {prefix}weight is FP8 but its scale {name!r} is missing")
    scale = sd.pop(name)
    n, k = q.shape
    if scheme.block is not None:
        want = [(-(-n // scheme.block[0]), -(-k // scheme.block[1]))]
    else:
        want = [(), (1,), (n, 1), (n,)]
    if tuple(scale.shape) not in want:
        raise ModelError(f"tensor {name!r} has shape {list(scale.shape)}, expected "
                         f"{' or '.join(str(list(w)) for w in want)} for a weight {[n, k]}")
    return scale


def _input_scale(sd: dict[str, torch.Tensor], linear: str, device: torch.device) -> torch.Tensor:
    name = linear + ".input_scale"
    if name not in sd:
        raise ModelError(f"tensor {name!r} is missing (config.json asks for static "
                         f"activation scales)")
    return sd[name].float().reshape(()).to(device)


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return f"the {device.type.upper()}"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
