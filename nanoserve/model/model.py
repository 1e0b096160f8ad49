"""The Llama forward pass in PyTorch, and the families that share its skeleton.

One file, one model: token embedding, RMSNorm, rotary embeddings (plain or llama3
scaled), grouped-query attention, SwiGLU MLP, tied or untied LM head (or, for a
`*ForSequenceClassification` checkpoint, its `score` head instead). Parameter names
equal transformers' `LlamaForCausalLM` state dict (and its Qwen2/Qwen3/Mistral twins,
which use the same names), so a checkpoint loads by name.

LoRA adapters (nanoserve/model/lora.py): each projection with adapter slots
(`lora_qkv`, `lora_o`, `lora_gate_up`, `lora_down`, set by `LoraWeights.attach`) adds its
rows' low-rank updates after its GEMM, when the forward is given a `LoraStep`.

Family differences are the config's named options, applied in `LlamaAttention` only:
`qkv_bias` (Qwen2: biases on q/k/v), `qk_norm` (Qwen3: `q_norm`/`k_norm`, an RMSNorm over
head_dim applied to every head before rotary), and `attention_window(layer)` (Mistral,
Qwen2/3 with use_sliding_window: the layer's sliding window, passed to the attention);
Qwen3-MoE and Mixtral swap the MLP of `config.moe_layers` for a mixture of experts
(nanoserve/model/moe.py).

The forward is explicit: token ids, absolute positions, a KV cache and the step's
`AttentionMetadata` come in as arguments; nothing is kept in module-level state.
Shapes: B rows, T tokens per row this step, d = hidden_size, Hq/Hkv heads, D head_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.attention import AttentionMetadata, gqa_attention
from nanoserve.model.config import ModelConfig
from nanoserve.model.moe import SparseMoeBlock
from nanoserve_kernels import backend as kernel_backend

if TYPE_CHECKING:
    from nanoserve.model.lora import LoraProjection, LoraStep


class QuantizedRows:
    """An activation quantized per row to float8 e4m3 by the kernel that computed it, for
    the FP8 projection it goes to (`nanoserve.weights.fp8.Fp8Linear`): q [M, K] e4m3, scale [M, 1]
    float32 (row i ~= q[i] * scale[i]); `shape` and `dtype`: the activation's own
    ([..., K], M the product of the leading sides)."""

    __slots__ = ("q", "scale", "shape", "dtype")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, shape: torch.Size,
                 dtype: torch.dtype) -> None:
        self.q, self.scale, self.shape, self.dtype = q, scale, shape, dtype


class ScaledRows:
    """An FP8 projection's output before its scales (`nanoserve.weights.fp8.Fp8Linear` asked with
    `keep_scales`), for the kernel after it to apply them as it reads (nanoserve_kernels/scaled_rows.py:
    value = raw * row_scale * col_scale): raw [M, N] in `dtype`, row_scale [M, 1], col_scale
    [1, N] float32; `shape`: the output's own ([..., N], M the product of the leading sides).
    Read by the residual add (`RMSNorm.add_forward`) and silu-and-mul's FP8 form."""

    __slots__ = ("raw", "row_scale", "col_scale", "shape")

    def __init__(self, raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                 shape: torch.Size) -> None:
        self.raw, self.row_scale, self.col_scale, self.shape = raw, row_scale, col_scale, shape

    @property
    def dtype(self) -> torch.dtype:
        return self.raw.dtype

    def parts(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(raw viewed as `shape`, the scales): the arguments of the kernels that read it."""
        return self.raw.view(self.shape), (self.row_scale, self.col_scale)


def with_scales(x: torch.Tensor | ScaledRows
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the tensor a kernel reads, the scales it applies: None for a plain tensor)."""
    return x.parts() if isinstance(x, ScaledRows) else (x, None)


class FP8Out:
    """Set on a kernel whose output feeds only FP8 projections with per-token activation
    scales (`nanoserve.weights.fp8.fuse_activation_quant`): it then returns `QuantizedRows`, the
    quantization done in its own launch. ub: the activations' amax cap (or None)."""

    def __init__(self, ub: float | None = None) -> None:
        self.ub = ub


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp8_out: FP8Out | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedRows:
        # Normalise in float32, cast back, then scale: the order transformers uses (one
        # Triton kernel on a GPU, nanoserve_kernels/rmsnorm.py).
        if self.fp8_out is not None:
            q, scale = kernel_backend.rms_norm_fp8(x, self.weight, self.eps, self.fp8_out.ub)
            return QuantizedRows(q, scale, x.shape, x.dtype)
        return kernel_backend.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor | ScaledRows, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
        """The residual add before this norm, fused with it: (x + residual, norm of that).
        x may be an FP8 projection's output with its scales still to apply."""
        x, scales = with_scales(x)
        if self.fp8_out is not None:
            h, q, scale = kernel_backend.add_rms_norm_fp8(x, residual, self.weight, self.eps,
                                                          self.fp8_out.ub, x_scales=scales)
            return h, QuantizedRows(q, scale, x.shape, x.dtype)
        return kernel_backend.add_rms_norm(x, residual, self.weight, self.eps, x_scales=scales)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed per step from absolute positions (no fixed length).

    Multimodal rotary (Qwen2.5-VL, `config.mrope_section` = (s_t, s_h, s_w)): positions
    [3, B, T] hold each token's temporal, height and width position; frequency pairs
    0..s_t-1 rotate by the first, the next s_h by the second, the last s_w by the third.
    A text token's three positions are equal, so positions [B, T] (one per token) give it
    the plain rotary: decode steps and rows without images pass those."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = torch.tensor(config.rope_inv_freq(), dtype=torch.float32)  # [D/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = config.mrope_section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] (or [3, B, T]: multimodal) -> cos, sin [B, T, D]
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [B, T, D/2]
        if positions.dim() == 3:  # [3, B, T, D/2]: each section from its own position
            parts = freqs.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] (its head dimension contiguous); cos/sin [B, T, D] -> [B, T, H, D]
    contiguous, in one kernel on a GPU (nanoserve_kernels/rotary.py)."""
    B, T, H, D = x.shape
    out = kernel_backend.rotary(x.reshape(B * T, H, D), cos.reshape(B * T, D),
                                sin.reshape(B * T, D))
    return out.view(B, T, H, D)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`parts` concatenated by rows: a view when they already lie one after another in one
    storage (a checkpoint that stores them fused, read back as views), else a copy."""
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.shape[1:] != first.shape[1:] or p.dtype != first.dtype
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or p.storage_offset() != offset):
            return torch.cat(parts)
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _fuse_rows(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum(out), in] (and bias) for several projections of the same input, so
    one GEMM serves them all. Each module's parameters become views of the fused tensors:
    the state dict keeps its names and no memory is held twice."""
    weight = _joined([m.weight.detach() for m in linears])
    bias = None
    if linears[0].bias is not None:
        bias = _joined([m.bias.detach() for m in linears])
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


def _project(x: torch.Tensor | QuantizedRows,
             fused: tuple[torch.Tensor, torch.Tensor | None] | nn.Module,
             keep_scales: bool = False) -> torch.Tensor | ScaledRows:
    """A projection: (weight, bias) from `_fuse_rows`, or a module (a linear, or an FP8 GEMM,
    nanoserve/weights/fp8.py: x may then come quantized). keep_scales: the caller's next kernel
    applies an FP8 GEMM's scales itself, so the GEMM may return `ScaledRows`."""
    if isinstance(fused, tuple):
        return F.linear(x, *fused)
    if keep_scales and getattr(fused, "keeps_scales", False):
        return fused(x, keep_scales=True)
    return fused(x)


class Linear(nn.Linear):
    """`nn.Linear` without its random init. The model is built on the meta device and every
    weight then comes from the checkpoint (`build_model`); nn.Linear's kaiming init on meta
    runs Python decompositions, ~1 ms a module (a quarter second of a small model's load)."""

    def reset_parameters(self) -> None:
        pass


# the fused projections and the checkpoint linears each one joins
FUSED_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = config.attention_window(layer_idx)  # None: full causal attention
        d, D = config.hidden_size, config.head_dim
        bias = config.qkv_bias
        self.q_proj = Linear(d, self.num_heads * D, bias=bias)
        self.k_proj = Linear(d, self.num_kv_heads * D, bias=bias)
        self.v_proj = Linear(d, self.num_kv_heads * D, bias=bias)
        self.o_proj = Linear(self.num_heads * D, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()
        self.lora_qkv: LoraProjection | None = None  # adapter slots (LoraWeights.attach)
        self.lora_o: LoraProjection | None = None

    def fuse(self) -> None:
        """q, k and v projections (and their biases) as one GEMM (see `_fuse_rows`)."""
        self.qkv = _fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata,
                lora: LoraStep | None = None) -> torch.Tensor:
        """lora: the step's adapters (None: the base model for every row)."""
        B, T, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is None:
            self.fuse()
        qkv = _project(x, self.qkv)  # [B, T, (Hq + 2 Hkv) D]
        if lora is not None and self.lora_qkv is not None:
            self.lora_qkv.add(qkv, x, lora)
        qkv = qkv.view(B, T, Hq + 2 * Hkv, D)
        if self.q_norm is None and not meta.is_prefill and hasattr(cache, "rotary_store"):
            # a continuous decode step: rotary and the K/V store in one kernel, then the
            # paged read (what gqa_attention does, with the store already done)
            q = cache.rotary_store(self.layer_idx, qkv, cos, sin, Hq)  # [B, 1, Hq, D]
            out = cache.paged_attention(self.layer_idx, q[:, 0], window=self.window)
            return self._out(out.reshape(B, T, Hq * D), lora)
        v = qkv[:, :, Hq + Hkv:]  # [B, T, Hkv, D]
        if self.q_norm is not None:  # per head, over D, before rotary
            q = apply_rotary(self.q_norm(qkv[:, :, :Hq]), cos, sin)  # [B, T, Hq, D]
            k = apply_rotary(self.k_norm(qkv[:, :, Hq:Hq + Hkv]), cos, sin)  # [B, T, Hkv, D]
        else:  # rotary on q and k at once: their heads are neighbours in the fused output
            qk = apply_rotary(qkv[:, :, :Hq + Hkv], cos, sin)  # [B, T, Hq + Hkv, D]
            q, k = qk[:, :, :Hq], qk[:, :, Hq:]
        out = gqa_attention(q, k, v, self.layer_idx, cache, meta,
                            window=self.window)  # [B, T, Hq, D]
        return self._out(out.reshape(B, T, self.num_heads * self.head_dim), lora)

    def _out(self, out: torch.Tensor, lora: LoraStep | None) -> torch.Tensor | ScaledRows:
        """o_proj of the attention's output [B, T, Hq D]: an FP8 GEMM's scales left to the
        residual add after it, unless o_proj has adapter slots (the update goes on y)."""
        y = _project(out, self.o_proj, keep_scales=self.lora_o is None)
        if lora is not None and self.lora_o is not None:
            self.lora_o.add(y, out, lora)
        return y


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, inner, bias=False)
        self.up_proj = Linear(d, inner, bias=False)
        self.down_proj = Linear(inner, d, bias=False)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()
        self.fp8_act: FP8Out | None = None  # silu-and-mul's output quantized for down_proj
        self.lora_gate_up: LoraProjection | None = None  # adapter slots (LoraWeights.attach)
        self.lora_down: LoraProjection | None = None

    def fuse(self) -> None:
        """gate and up projections as one GEMM (see `_fuse_rows`)."""
        self.gate_up = _fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        if self.gate_up is None:
            self.fuse()
        fp8_act = self.fp8_act is not None  # silu-and-mul's FP8 form then applies the scales
        gate_up = _project(x, self.gate_up, keep_scales=fp8_act)  # [..., 2 * inner]: gate | up
        if lora is not None and self.lora_gate_up is not None:
            self.lora_gate_up.add(gate_up, x, lora)
        if fp8_act:
            gate_up, scales = with_scales(gate_up)
            q, scale = kernel_backend.silu_and_mul_fp8(gate_up, self.fp8_act.ub, x_scales=scales)
            shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
            down_in = QuantizedRows(q, scale, torch.Size(shape), gate_up.dtype)
        else:
            down_in = kernel_backend.silu_and_mul(gate_up)
        # an FP8 GEMM's scales left to the residual add, unless an update goes on y first
        y = _project(down_in, self.down_proj, keep_scales=self.lora_down is None)
        if lora is not None and self.lora_down is not None:
            self.lora_down.add(y, down_in, lora)
        return y


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        # Qwen3-MoE, Mixtral: a mixture of experts on the layers the config names
        self.mlp = (SparseMoeBlock(config) if config.is_moe_layer(layer_idx)
                    else LlamaMLP(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, x, cos, sin, cache, meta, next_norm: RMSNorm,
                lora: LoraStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream [B, T, d] entering the layer; x: h normed by this layer's
        input_layernorm. Returns the residual stream leaving the layer and it normed by
        `next_norm` (the next layer's input_layernorm, or the final norm): each residual
        add is fused with the norm after it. lora: the step's adapters, if any."""
        h, x = self.post_attention_layernorm.add_forward(
            self.self_attn(x, cos, sin, cache, meta, lora), h)
        mlp = self.mlp(x, lora) if isinstance(self.mlp, LlamaMLP) else self.mlp(x)
        return next_norm.add_forward(mlp, h)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Given its weight, nn.Embedding skips its random init, which would import
        # torch._dynamo (~1 s per process) only to fill a tensor the checkpoint replaces.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids, positions, cache, meta,
                images: PlacedImages | None = None, lora: LoraStep | None = None
                ) -> torch.Tensor:
        """images: image features that replace the embeddings of some tokens; lora: the
        step's adapters (one slot per token of input_ids; not with a padded prefill)."""
        h = None  # the residual stream [B, T, d], made here only when images go into it
        if images is not None:
            h = self.embed_tokens(input_ids)
            h.view(-1, h.shape[-1]).index_copy_(0, images.index, images.embeds.to(h.dtype))
        if packs_prefill(input_ids, meta):
            if lora is not None:
                raise ValueError("LoRA adapters run in packed or decode steps, not padded ones")
            # Projections and MLP on the real tokens only: one row [1, N]; attention puts
            # q/k/v back in their rectangle (nanoserve/model/attention.py). Padding comes out zero.
            valid = meta.valid
            pos = positions[valid][None] if positions.dim() == 2 else positions[:, valid][:, None]
            x = self._forward(input_ids[valid][None], pos, cache, meta.as_packed(),
                              None if h is None else h[valid][None])
            out = x.new_zeros(*valid.shape, x.shape[-1])
            out[valid] = x[0]
            return out
        return self._forward(input_ids, positions, cache, meta, h, lora)

    def _forward(self, input_ids, positions, cache, meta, h=None, lora=None) -> torch.Tensor:
        if h is None:
            h = self.embed_tokens(input_ids)  # [B, T, d]: the residual stream
        cos, sin = self.rotary_emb(positions, h.dtype)
        x = self.layers[0].input_layernorm(h)
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            h, x = layer(h, x, cos, sin, cache, meta,
                         self.norm if last else self.layers[i + 1].input_layernorm, lora)
        return x


class PlacedImages(NamedTuple):
    """Image features placed into a forward's input: the vision tower's rows `embeds`
    [M, d] replace the token embeddings at `index` [M] (offsets into the flattened
    [B * T] input ids: the image placeholders' places)."""

    index: torch.Tensor
    embeds: torch.Tensor


class _NoHead(nn.Module):
    """The LM head of a checkpoint that has none: embedding (and a classifier's head) works,
    generation says why not."""

    def __init__(self, architecture: str, classifier: bool = False) -> None:
        super().__init__()
        self.architecture = architecture
        self.does = ("classifies (nanoserve classify, nanoserve.classify.load_classifier)"
                     if classifier else "embeds (nanoserve embed, LLM.embed)")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from nanoserve.errors import ModelError

        raise ModelError(f"the model ({self.architecture}) has no LM head: it {self.does}, "
                         f"it does not generate")


def packs_prefill(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a forward runs packed: a padded prefill on the CPU that holds padding. (On a
    GPU, prefills are packed by the scheduler, or run as the padded rectangle.)"""
    return (input_ids.device.type == "cpu" and meta.is_prefill and meta.valid is not None
            and meta.packed_from is None and input_ids.dim() == 2
            and not bool(meta.valid.all()))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # a headless checkpoint (config.headless: an embedding model, a classifier) has no
        # LM head; a classifier has its `score` head instead: [num_labels, d], no bias
        self.lm_head = (_NoHead(config.architecture, config.is_classifier) if config.headless
                        else Linear(config.hidden_size, config.vocab_size, bias=False))
        if config.is_classifier:
            self.score = Linear(config.hidden_size, config.num_labels, bias=False)
        if config.vision is not None:  # Qwen2.5-VL's vision tower
            from nanoserve.multimodal.vision_model import VisionTransformer

            self.visual = VisionTransformer(config.vision)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and not self.config.headless:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids, positions, cache, meta: AttentionMetadata,
                      images: PlacedImages | None = None, lora: LoraStep | None = None
                      ) -> torch.Tensor:
        """input_ids, positions [B, T] (multimodal rotary: [3, B, T]) -> final normed hidden
        states [B, T, d]. images: features replacing some tokens' embeddings; lora: the
        step's adapters (nanoserve/model/lora.py), None for the base model."""
        return self.model(input_ids, positions, cache, meta, images, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V] in float32."""
        return self.lm_head(hidden).float()

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's head: pooled final normed hidden states [B, d] (any float dtype;
        computed in the model's, as transformers does) -> logits [B, num_labels] float32."""
        return self.score(pooled.to(self.dtype)).float()

    def forward(self, input_ids, positions, cache, meta: AttentionMetadata,
                images: PlacedImages | None = None, lora: LoraStep | None = None
                ) -> torch.Tensor:
        """input_ids, positions [B, T] -> logits [B, T, V] (float32)."""
        return self.compute_logits(self.hidden_states(input_ids, positions, cache, meta, images,
                                                      lora))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def build_model(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    projections: dict[str, nn.Module] | None = None,
) -> LlamaForCausalLM:
    """Build on the meta device, then assign the checkpoint's tensors (no init work,
    no copy beyond the dtype/device cast). The caller has checked names and shapes.
    `projections`: modules, built on `device`, that stand for a layer's projections
    (`model.layers.{i}.self_attn.qkv` / `.o_proj`, `model.layers.{i}.mlp.gate_up` /
    `.down_proj`: FP8 GEMMs, nanoserve/weights/fp8.py); the linears they replace have no tensors
    in `state_dict`."""
    projections = projections or {}
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for name, module in projections.items():
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, module)
        for part in FUSED_PARTS.get(attr, ()):
            setattr(parent, part, None)
    tensors = {
        name: t.to(device=device, dtype=dtype)
        for name, t in state_dict.items()
        if not ((config.tie_word_embeddings or config.headless) and name == "lm_head.weight")
    }
    missing, _ = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")
               and not any(m.startswith(p + ".") for p in projections)]
    if missing:
        from nanoserve.errors import ModelError

        raise ModelError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")
    model.tie_weights()
    for layer in model.model.layers:
        if layer.self_attn.qkv is None:
            layer.self_attn.fuse()
        if isinstance(layer.mlp, LlamaMLP) and layer.mlp.gate_up is None:
            layer.mlp.fuse()
    # Non-persistent buffers are still on meta: rebuild them on the target device.
    model.model.rotary_emb = RotaryEmbedding(config).to(device)
    return model.train(False).requires_grad_(False)
