"""Every family of the registry (nanoserve/model/families.py) held to transformers' own classes, one
parametrised test each: a tiny random checkpoint built from the family's record
(`nanoserve.testing.tiny_hf_model`, a sliding window where the family has one), saved by
`save_pretrained` and loaded through the real folder path, gives transformers' float32
logits and greedy tokens (dense and continuous paths); and the record's config defaults are
what transformers' config class derives when config.json leaves a key out. A new family's
record is checked here without a line added to this file."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_greedy_near, hf_greedy

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.families import FAMILIES, by_architecture
from nanoserve.model.model import build_model
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve.static.generate import greedy_generate, pool_for
from nanoserve.testing import tiny_hf_model
from nanoserve.weights.weights import load_checkpoint

VOCAB = 272  # room for Qwen2.5-VL's special tokens above 256; prompts are drawn below 256
WINDOW = 6  # shorter than the prompts: the window's edge falls inside them
IDS = [f.model_type for f in FAMILIES]


@pytest.fixture(scope="module", params=FAMILIES, ids=IDS)
def family_pair(request, tmp_path_factory):
    """(family, transformers' model, our float32 model) from one saved checkpoint folder."""
    family = request.param
    hf = tiny_hf_model(family, VOCAB, sliding_window=None if family.window == "none" else WINDOW)
    folder = tmp_path_factory.mktemp(family.model_type)
    hf.save_pretrained(folder)
    config, sd = load_checkpoint(folder)
    return family, hf, build_model(config, sd)


def test_family_equals_transformers(family_pair):
    family, hf, model = family_pair
    assert model.config.family is family and model.config.architecture == type(hf).__name__
    rng = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 20), generator=rng)
    ours = model(ids, torch.arange(20).expand(2, 20), None, AttentionMetadata.prefill())
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (ours - ref).abs().max().item() <= 1e-4
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (5, 13)]
    new = 8
    want = [hf_greedy(hf, p, new) for p in prompts]
    assert_greedy_near(hf, prompts, [greedy_generate(model, p, new) for p in prompts], want)
    params = [SamplingParams(max_tokens=new, temperature=0.0)] * len(prompts)
    outs, _ = generate_continuous(model, prompts, params, (), pool_for(model, prompts, new, 4),
                                  max_batch_size=2)
    assert_greedy_near(hf, prompts, [o.token_ids for o in outs], want)


def _their_config(family, **lm):
    from transformers import AutoConfig

    if family.vision:
        return AutoConfig.for_model(family.model_type, text_config=lm,
                                    vision_config=dict(family.tiny["vision_config"]))
    return AutoConfig.for_model(family.model_type, **lm)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_config_defaults_equal_transformers(family):
    """Each default of the record is transformers' value for a config without the key, and
    a config.json with only the required keys reads as transformers' full one does. Given
    there too: the KV heads and the special tokens, whose defaults in transformers are one
    published checkpoint's (Qwen2Config: 32 KV heads); nanoserve reads missing KV heads as
    all heads (LlamaConfig's rule) and takes no token ids from a default."""
    theirs = _their_config(family)
    text = theirs.get_text_config()
    for key, ours in family.defaults.items():
        if key == "rope_theta":  # 5.x keeps it in rope_parameters
            value = text.rope_parameters["rope_theta"]
        else:
            value = getattr(text, key) if hasattr(text, key) else getattr(theirs, key)
        assert value == ours, key
    # head_dim 128 where the rotary has sections (the published ones cover 128), else 32
    lm = dict(vocab_size=1000, hidden_size=256 if family.mrope_section else 64,
              intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    minimal = {"architectures": [family.architecture], "model_type": family.model_type}
    if family.vision:
        minimal.update(text_config=lm, vision_config=dict(family.tiny["vision_config"]))
    else:
        minimal.update(lm)
    full = {**_their_config(family, **lm).to_dict(), "architectures": [family.architecture]}
    assert ModelConfig.from_hf_dict(minimal) == ModelConfig.from_hf_dict(full)


def test_records_are_consistent():
    """Names are unique, and each record is found by its names."""
    for key in ("architecture", "model_type", "name"):
        values = [getattr(f, key) for f in FAMILIES]
        assert len(set(values)) == len(values), key
    for family in FAMILIES:
        assert by_architecture(family.architecture) is family
        if family.base_model:
            assert by_architecture(family.base_model) is family
