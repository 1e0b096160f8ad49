"""The rounding model of an FP8 model (what e4m3's rounding of the activations allows), for
the FP8 tests of dense and mixture-of-experts models (tests/test_fp8_gpu.py,
tests/test_fused_moe_gpu.py, tests/test_moe_families.py).

Against the float model with its own (dequantized) weights an FP8 model differs by every
activation entering an FP8 GEMM, rounded to e4m3 at its scale (per token, per token and
group of columns for block-wise experts, or the static input scale). The rounding model is
that float32 model with each such activation moved by an independent uniform draw within
half an e4m3 step of its value; its logits over `DRAWS` draws give each logit's spread
sigma (`e4m3_spread`). A token near a routing tie moves to another expert in some draws:
the spread of its logits says so. `assert_within_rounding` then holds the FP8 model's logits
to the model's float32 logits: each within LAMBDA sigma plus twice the bfloat16 noise, the
mean square within MEAN_SQUARE of the predicted, greedy tokens equal where the tolerances
decide them (on at least `clear_share` of the positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.model.model import build_model
from nanoserve.model.moe import MoeExperts, SparseMoeBlock
from nanoserve.weights.fp8 import Fp8Linear, dequantize_experts
from nanoserve_kernels.moe_routing import route_reference

LAMBDA = 7.0  # a Gaussian logit error's 7 sigma: ~3e-12 each, ~5e5 logits checked
DRAWS = 128  # draws of the rounding model (the spread's estimate within ~10%)
MEAN_SQUARE = 1.5  # the real mean square error over the predicted one (measured <= 1)
CLEAR_SHARE = 0.25  # positions whose greedy token the tolerances decide


def e4m3_input(x: torch.Tensor, s: torch.Tensor, draw: bool,
               generator: torch.Generator) -> torch.Tensor:
    """x [M, K] float32 at scales s (broadcast to x): clamped to e4m3's range at s and, with
    `draw`, each value moved by a uniform draw within half an e4m3 step of x / s."""
    y = (x / s).clamp(-448, 448)
    if draw:  # e4m3's step at y: 2^(e - 3) for |y| in [2^e, 2^(e+1)), e >= -6
        step = torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=2**-6))) - 3)
        u = torch.rand(y.shape, generator=generator, device=y.device) - 0.5
        y = y + u * step
    return y * s


def _expert_input(a: torch.Tensor, block, draw: bool, generator) -> torch.Tensor:
    """An FP8 expert GEMM's input a [n, K] float32 through `e4m3_input` at the kernel's
    scales: per token, or per token and group of block[1] columns."""
    if block is None:
        amax = a.abs().amax(1, keepdim=True)
        return e4m3_input(a, torch.where(amax > 0, amax / 448, torch.ones_like(amax)), draw,
                          generator)
    n, k = a.shape
    g = a.view(n, k // block[1], block[1])
    amax = g.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return e4m3_input(g, s, draw, generator).view(n, k)


class E4M3Moe(torch.nn.Module):
    """A MoE block of the rounding model: `block`'s router (and shared expert) in its dtype,
    the FP8 model's experts dequantized to float32, each expert GEMM's input through
    `_expert_input`; rounded to the block's dtype where the kernel rounds (each GEMM's
    output, the activation, each pair's weighted row)."""

    def __init__(self, fp8: MoeExperts, block: SparseMoeBlock,
                 generator: torch.Generator) -> None:
        super().__init__()
        assert fp8.gate_up_proj_scale is not None, "the FP8 model's experts are not FP8"
        self.block_scales = fp8.block
        self.w13 = dequantize_experts(fp8.gate_up_proj, fp8.gate_up_proj_scale, fp8.block,
                                      torch.float32)
        self.w2 = dequantize_experts(fp8.down_proj, fp8.down_proj_scale, fp8.block,
                                     torch.float32)
        self.moe = block
        self.generator = generator
        self.draw = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, d]
        dtype = rows.dtype
        weights, ids = route_reference(F.linear(rows, self.moe.gate.weight), self.moe.top_k,
                                       self.moe.renormalize)
        out = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            a = _expert_input(rows[tok].float(), self.block_scales, self.draw, self.generator)
            gate, up = (a @ self.w13[e].T).to(dtype).chunk(2, dim=-1)
            act = (F.silu(gate) * up).to(dtype).float()
            h = _expert_input(act, self.block_scales, self.draw, self.generator)
            y = (h @ self.w2[e].T).to(dtype).float()
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(dtype).float())
        out = out.to(dtype)
        if self.moe.shared_expert is not None:
            gate = torch.sigmoid(F.linear(rows, self.moe.shared_expert_gate.weight))
            out = out + gate * self.moe.shared_expert(rows)
        return out.view(x.shape)


class E4M3Input(torch.nn.Module):
    """A projection of the rounding model: `weight` (the FP8 model's, dequantized) in float32
    on an input that, where `fp8` quantizes it (an `Fp8Linear`), is clamped as its scale
    clamps it and, with `draw` on, moved by a uniform draw within half an e4m3 step."""

    def __init__(self, fp8, weight: torch.Tensor, bias: torch.Tensor | None,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.fp8 = fp8 if isinstance(fp8, Fp8Linear) else None
        self.weight = (fp8.dequantized() if self.fp8 is not None else weight).float()
        self.bias = None if bias is None else bias.float()
        self.generator = generator
        self.draw = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.fp8 is not None:
            if self.fp8.input_scale is not None:  # static: one scale
                s = self.fp8.input_scale.float().expand(x2.shape[0], 1)
            else:  # per token, its largest value (capped at the format's ub) at 448
                amax = x2.abs().amax(1, keepdim=True)
                if self.fp8.activation_scale_ub is not None:
                    amax = amax.clamp(max=self.fp8.activation_scale_ub)
                s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            x2 = e4m3_input(x2, s, self.draw, self.generator)
        out = F.linear(x2, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


_PROJECTIONS = (("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")),
                ("self_attn", "o_proj", ("o_proj",)),
                ("mlp", "gate_up", ("gate_proj", "up_proj")),
                ("mlp", "down_proj", ("down_proj",)))


def rounding_model(fp8_model, config, state_dict, dtype, generator):
    """The model of `state_dict` (the twin's, or the bf16 checkpoint's) in `dtype` on the
    FP8 model's device, each projection an `E4M3Input` of the FP8 model's and each MoE
    block an `E4M3Moe` of its experts; returns (model, the modules that draw)."""
    device = fp8_model.lm_head.weight.device
    model = build_model(config, dict(state_dict), dtype, device)
    projections = []
    for ours, theirs in zip(fp8_model.model.layers, model.model.layers):
        if isinstance(theirs.mlp, SparseMoeBlock):
            theirs.mlp = E4M3Moe(ours.mlp.experts, theirs.mlp, generator)
            projections.append(theirs.mlp)
        for part, name, parts in _PROJECTIONS:
            if part == "mlp" and isinstance(theirs.mlp, E4M3Moe):
                continue
            module = getattr(theirs, part)
            old = getattr(module, name)
            if isinstance(old, tuple):  # fused (weight, bias)
                weight, bias = old
            elif old is None:  # not fused: its checkpoint linears
                weight = torch.cat([getattr(module, p).weight for p in parts])
                biases = [getattr(module, p).bias for p in parts]
                bias = None if biases[0] is None else torch.cat(biases)
            else:
                weight, bias = old.weight, old.bias
            p = E4M3Input(getattr(getattr(ours, part), name), weight, bias, generator)
            setattr(module, name, p)
            projections.append(p)
    return model, projections


def e4m3_spread(fp8_model, config, state_dict, run):
    """(float32 logits, each logit's spread sigma under the rounding model, the bfloat16
    noise of that model's logits: its largest and its root mean square) for the logits
    `run(model)` gives."""
    generator = torch.Generator(device=fp8_model.lm_head.weight.device).manual_seed(0)
    model, projections = rounding_model(fp8_model, config, state_dict, torch.float32,
                                        generator)
    half, _ = rounding_model(fp8_model, config, state_dict, torch.bfloat16, generator)
    with torch.no_grad():
        center = run(model).float()
        for p in projections:
            p.draw = True
        draws = torch.stack([run(model).float() for _ in range(DRAWS)])
        noise = (run(half).float() - center).abs()
    return center, draws.std(0), float(noise.max()), float(noise.pow(2).mean().sqrt())


def assert_within_rounding(ours, center, sigma, noise_max, noise_rms,
                           clear_share=CLEAR_SHARE):
    """The checks of the module docstring: each logit, the mean square, the clear argmax
    (on at least `clear_share` of the positions)."""
    ours = ours.float()
    tol = LAMBDA * sigma + 2 * noise_max
    err = (ours - center).abs()
    worst = int((err / tol).argmax())
    assert bool((err <= tol).all()), (
        f"logit error {float(err.flatten()[worst]):.4g} beyond {float(tol.flatten()[worst]):.4g}"
        f" ({float(err.flatten()[worst] / sigma.flatten()[worst]):.1f} sigma)")
    ratio = float(err.pow(2).mean() / (sigma.pow(2).mean() + noise_rms ** 2))
    assert ratio <= MEAN_SQUARE, ratio
    top = center.argmax(-1, keepdim=True)
    lead = center.gather(-1, top) - center  # [..., V]: the top token's lead over each
    clear = (lead > tol.gather(-1, top) + tol).sum(-1) == center.shape[-1] - 1
    assert clear.float().mean().item() >= clear_share, clear.float().mean().item()
    assert torch.equal(ours.argmax(-1)[clear], top[..., 0][clear])


def check_fp8_moe(folder, form: str, device: str) -> None:
    """A tiny Qwen3-MoE in FP8, its logits within the rounding model of its float twin:
    form "online" (`quantization="fp8"`: experts and projections per row) or "block" (a
    Qwen-style block-wise FP8 checkpoint, 128 x 128 blocks: I = 128 and d = 256, so gate
    and up blocks stack). On the CPU the experts run the PyTorch reference, on a GPU the
    Triton kernels; the checks are the same."""
    from test_moe_families import CASES, save_moe

    from nanoserve.model.attention import AttentionMetadata
    from nanoserve.testing import save_fp8_checkpoint
    from nanoserve.weights.fp8 import build_with_fp8
    from nanoserve.weights.weights import load_checkpoint

    if form == "online":
        save_moe(folder, "qwen3_moe", CASES[0][1], "per-expert")
        config, sd = load_checkpoint(folder)
        model = build_with_fp8(config, dict(sd), torch.bfloat16, device, quantization="fp8")
    else:
        options = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                       hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
                       head_dim=64)
        save_moe(folder / "src", "qwen3_moe", options, "per-expert")
        save_fp8_checkpoint(folder / "src", folder / "fp8", "fp8-block", folder / "twin")
        model = build_with_fp8(*load_checkpoint(folder / "fp8"), torch.bfloat16, device)
        experts = model.model.layers[0].mlp.experts
        assert experts.block == (128, 128) and experts.gate_up_proj_scale.shape == (8, 2, 2)
        config, sd = load_checkpoint(folder / "twin")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, MoeExperts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)

    def logits(m):
        pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
        return m(ids, pos, None, AttentionMetadata.prefill())

    with torch.no_grad():
        ours = logits(model)
    center, sigma, noise_max, noise_rms = e4m3_spread(model, config, sd, logits)
    assert_within_rounding(ours, center, sigma, noise_max, noise_rms, clear_share=0.0)
