"""LoRA adapters in the engine, on the CPU, held to PEFT: each adapter, made by
`peft.get_peft_model` on a tiny random Llama (nonzero random A and B) and saved by
`save_pretrained`, is merged into its base by `PeftModel.from_pretrained(...)
.merge_and_unload()` (float32); transformers' greedy tokens on the merged model are the
oracle for every row run under that adapter, whatever else shares its batch.

Covered: all seven targets; a subset (q, v, down) under rsLoRA (scale alpha / sqrt(r)); two
more targets at another rank; rows of the base model and of three adapters interleaved in one
call with fewer running rows than rows (continuous batching, rows joining as others leave),
in step modes "eager" and "static" (the CPU form of the captured GPU step), each row equal to
the oracle and to itself alone; fewer device slots than adapters (least recently used out);
the prefix cache with one prompt under two adapters and the base; an FP8 checkpoint on the
FP8-GEMM path with float adapters; bad adapter folders refused naming the field or tensor.
The kernels: tests/test_lora_kernels.py; the job: tests/test_lora_job.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nanoserve.errors import ModelError, NanoserveError
from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.lora_slots import AdapterSlots
from nanoserve.testing import save_tiny_byte_llama
from tests.hf_oracle import hf_greedy

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (target_modules, r, lora_alpha, use_rslora)
ADAPTERS = {"all7": (ALL, 8, 16, False), "qvd_rs": (["q_proj", "v_proj", "down_proj"], 4, 8, True),
            "ou": (["o_proj", "up_proj"], 6, 3, False)}
NEW = 10
PARAMS = SamplingParams(max_tokens=NEW, ignore_eos=True)


def save_peft_adapter(base: Path, folder: Path, targets, r: int, alpha: float, rslora: bool,
                      seed: int) -> Path:
    """A PEFT LoRA adapter of `base` with random nonzero A and B, saved by PEFT."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                          use_rslora=rslora, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(folder)
    return folder


def merged(base: Path, adapter: Path):
    """PEFT's merge of `adapter` into `base`, float32, eval mode: the oracle."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """(base folder, {name: adapter folder}, {name or None: oracle model})."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_byte_llama(root / "base")
    folders = {name: save_peft_adapter(base, root / name, *spec, seed=i + 1)
               for i, (name, spec) in enumerate(ADAPTERS.items())}
    oracles = {name: merged(base, folder) for name, folder in folders.items()}
    oracles[None] = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return base, folders, oracles


def prompts_of(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def engine(lora_models, **kwargs) -> LLM:
    base, folders, _ = lora_models
    return LLM(str(base), device="cpu", kv_cache_bytes=8 << 20, lora=folders, **kwargs)


# --- one adapter per row, against PEFT ---------------------------------------------------------


@pytest.mark.parametrize("step", ["eager", "static"])
def test_a_mixed_batch_equals_peft_per_row_and_each_row_alone(lora_models, step):
    """Base rows and three adapters interleaved, 12 rows through 4 running rows: each row's
    greedy tokens are its merged model's, and the same as the row run alone."""
    _, _, oracles = lora_models
    llm = engine(lora_models, decode_step=step, max_batch_size=4)
    names = [None, "all7", "qvd_rs", "ou"] * 3
    prompts = prompts_of(len(names))
    got = [c.token_ids for c in llm.generate(prompts, PARAMS, lora=names)]
    want = [hf_greedy(oracles[name], p, NEW) for p, name in zip(prompts, names)]
    assert got == want
    assert got != [hf_greedy(oracles[None], p, NEW) for p in prompts]  # adapters matter
    alone = [llm.generate([p], PARAMS, lora=[name])[0].token_ids
             for p, name in list(zip(prompts, names))[:4]]
    assert alone == got[:4]
    assert llm.lora_names == ("all7", "qvd_rs", "ou")


def test_adapters_change_every_adapted_row(lora_models):
    """The oracle is not vacuous: each adapter's tokens differ from the base model's."""
    _, _, oracles = lora_models
    prompt = prompts_of(1, seed=3)[0]
    base = hf_greedy(oracles[None], prompt, NEW)
    assert all(hf_greedy(oracles[n], prompt, NEW) != base for n in ADAPTERS)


def test_fewer_slots_than_adapters_swap_least_recently_used(lora_models):
    """One device slot for three adapters: rows of another adapter wait for the slot, the
    idle adapter goes, and every row still gets its own tokens."""
    _, _, oracles = lora_models
    llm = engine(lora_models, max_batch_size=3, max_loras=1)
    names = ["all7", "ou", None, "qvd_rs", "all7", "ou"]
    prompts = prompts_of(len(names), seed=1)
    got = [c.token_ids for c in llm.generate(prompts, PARAMS, lora=names)]
    assert got == [hf_greedy(oracles[n], p, NEW) for p, n in zip(prompts, names)]
    assert llm.adapters.loads >= 4  # all7, ou, qvd_rs, all7 again at least
    llm.adapters.check_integrity()
    assert sum(llm.adapters.rows.values()) == 0  # every row gave its slot back


def test_samples_of_a_prompt_share_its_adapter(lora_models):
    _, _, oracles = lora_models
    llm = engine(lora_models)
    prompt = prompts_of(1, seed=4)[0]
    outs = llm.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True, n=3),
                        lora="qvd_rs")
    want = hf_greedy(oracles["qvd_rs"], prompt, NEW)
    assert [c.token_ids for c in outs] == [want] * 3


def test_the_prefix_cache_is_keyed_by_adapter(lora_models):
    """One 40-token prompt (2 full blocks) under two adapters and the base, each run twice:
    the second run of each finds its own blocks, the first never another's, and every run
    gives its adapter's tokens."""
    _, _, oracles = lora_models
    llm = engine(lora_models, enable_prefix_caching=True)
    prompt = prompts_of(1, seed=5)[0] * 3
    prompt = (prompt * 10)[:40]
    for name in ("all7", "ou", None):
        want = hf_greedy(oracles[name], prompt, NEW)
        first, second = (llm.generate([prompt], PARAMS, lora=[name])[0] for _ in range(2))
        assert first.token_ids == want and second.token_ids == want, name
        assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32, name
    both = llm.generate([prompt] * 3, PARAMS, lora=["ou", "all7", None])  # one admission
    assert [c.token_ids for c in both] == [hf_greedy(oracles[n], prompt, NEW)
                                           for n in ("ou", "all7", None)]


def test_fp8_checkpoint_with_float_adapters(lora_models, tmp_path, monkeypatch):
    """An FP8 checkpoint on the FP8-GEMM path (forced on the CPU, as tests/test_fp8_weights.py
    does) with float adapters: the update goes on each projection's finished output, so the
    logits stay within the FP8 tolerance of PEFT's merge into the dequantized twin, and the
    LoRA projections get unquantized input and scaled output (no fused FP8 hand-offs)."""
    from nanoserve.model.attention import AttentionMetadata
    from nanoserve.model.lora import LoraStep
    from nanoserve.testing import save_fp8_checkpoint
    from nanoserve.weights import fp8

    base, folders, _ = lora_models
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)
    save_fp8_checkpoint(base, tmp_path / "fp8", "ct-channel-dynamic", tmp_path / "twin")
    llm = LLM(str(tmp_path / "fp8"), device="cpu", kv_cache_bytes=8 << 20,
              lora={"all7": folders["all7"]})
    layer = llm.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv, fp8.Fp8Linear)
    assert layer.input_layernorm.fp8_out is None and layer.mlp.fp8_act is None
    twin = merged(tmp_path / "twin", folders["all7"])
    ids = torch.tensor([prompts_of(1, seed=6)[0]])
    slot = llm.adapters.acquire("all7")
    step = LoraStep(torch.full((ids.numel(),), slot), llm.adapters.weights.num_slots)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ours = llm.model(ids, pos, None, AttentionMetadata.prefill(), lora=step)[0]
        base_fp8 = llm.model(ids, pos, None, AttentionMetadata.prefill())[0]
        want = twin(ids).logits[0]
    assert (ours - want).abs().max() < 0.05  # tests/test_fp8_weights.py's GEMM_LOGITS_ATOL
    assert (base_fp8 - want).abs().max() > 0.1  # (without the update: far off)


# --- the slots' bookkeeping (plain Python) -----------------------------------------------------


class _Slots:
    num_slots = 2

    def __init__(self):
        self.loaded = []

    def load(self, slot, tensors):
        self.loaded.append((slot, tensors))


def test_adapter_slots_share_evict_least_recently_used_and_wait():
    weights = _Slots()
    slots = AdapterSlots({n: type("A", (), {"tensors": n})() for n in "abc"}, weights)
    assert slots.acquire(None) == -1
    a = slots.acquire("a")
    assert slots.acquire("a") == a and weights.loaded == [(a, "a")]  # shared, loaded once
    b = slots.acquire("b")
    assert b != a and slots.acquire("c") is None  # both slots serve running rows: c waits
    slots.release("a")
    slots.release("a")
    slots.release("b")  # idle now: a (least recently used), then b
    assert slots.acquire("c") == a and weights.loaded[-1] == (a, "c")  # a out
    assert slots.acquire("b") == b and len(weights.loaded) == 3  # resident b: no load
    slots.check_integrity()
    with pytest.raises(ValueError, match="unknown LoRA adapter 'z'"):
        slots.acquire("z")


# --- what is refused ---------------------------------------------------------------------------


def _broken(folder: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("changes, words", [
    ({"use_dora": True}, "use_dora = true is not supported"),
    ({"bias": "all"}, "bias = \"all\" is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens' (an embedding target)"),
    ({"target_modules": ".*proj"}, "a regular expression is not supported"),
    ({"target_modules": ["dense"]}, "'dense' is not supported"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"fancy_new_field": 1}, "unknown field 'fancy_new_field'"),
    ({"peft_type": "IA3"}, "peft_type = \"IA3\""),
    ({"r": 0}, "r must be an integer >= 1"),
    ({"r": 5}, "has shape [8, 128], expected [5, 128]"),
])
def test_bad_adapter_configs_are_refused_naming_the_field(lora_models, tmp_path, changes, words):
    base, folders, _ = lora_models
    bad = _broken(folders["all7"], tmp_path, **changes)
    with pytest.raises(ModelError) as e:
        LLM(str(base), device="cpu", kv_cache_bytes=8 << 20, lora={"x": bad})
    assert words in str(e.value) and str(bad) in str(e.value)


def test_bad_adapter_files_are_refused(lora_models, tmp_path):
    from safetensors.torch import load_file, save_file

    base, folders, _ = lora_models

    def refused(folder) -> str:
        with pytest.raises(ModelError) as e:
            LLM(str(base), device="cpu", kv_cache_bytes=8 << 20, lora={"x": folder})
        return str(e.value)

    assert "no such folder" in refused(tmp_path / "nowhere")
    extra = _broken(folders["ou"], tmp_path)
    tensors = load_file(extra / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.bias"
    save_file({**tensors, name: torch.zeros(64)}, extra / "adapter_model.safetensors")
    assert f"tensor {name!r} is not a LoRA A/B" in refused(extra)
    tensors.pop("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight")
    save_file(tensors, extra / "adapter_model.safetensors")
    assert "layers.1.mlp.up_proj.lora_A.weight' is missing" in refused(extra)
    (extra / "adapter_model.safetensors").rename(extra / "adapter_model.bin")
    assert "pickle, never read" in refused(extra)


def test_bad_names_and_specs_are_refused(lora_models):
    base, folders, _ = lora_models
    llm = engine(lora_models)
    with pytest.raises(NanoserveError, match="unknown LoRA adapter 'sql' \\(the engine's: all7, "):
        llm.generate([[1, 2, 3]], PARAMS, lora=["sql"])
    with pytest.raises(NanoserveError, match="NAME=PATH"):
        LLM(str(base), device="cpu", lora=[str(folders["ou"])])
    with pytest.raises(NanoserveError, match="continuous scheduler only"):
        LLM(str(base), device="cpu", scheduler="static", lora={"ou": folders["ou"]})
    with pytest.raises(NanoserveError, match="read from local folders"):
        LLM(str(base), device="cpu", lora=["ou=s3://bucket/ou"])
    plain = LLM(str(base), device="cpu", kv_cache_bytes=8 << 20)
    with pytest.raises(NanoserveError, match="the engine's: none"):
        plain.generate([[1, 2, 3]], PARAMS, lora="ou")


def test_nanoserve_generate_runs_each_prompt_under_each_adapter(lora_models, capsys):
    from nanoserve_cli import main as nanoserve_main

    base, folders, oracles = lora_models
    rc = nanoserve_main(["generate", "--model", str(base), "--device", "cpu", "--max-tokens",
                         str(NEW), "--lora", f"all7={folders['all7']}", "--lora",
                         f"ou={folders['ou']}", "abc"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "=== [0] abc (LoRA all7)" in out and "=== [1] abc (LoRA ou)" in out
    from nanoserve.weights.tokenizer import Tokenizer

    tok = Tokenizer.from_path(base)
    for name in ("all7", "ou"):
        assert tok.decode(hf_greedy(oracles[name], tok.encode("abc"), NEW)) in out
    assert nanoserve_main(["generate", "--lora", "nope", "abc"]) == 2
    assert "--lora must be NAME=PATH" in capsys.readouterr().err
