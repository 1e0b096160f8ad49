"""Output controls in the engine: structured outputs, logprobs and n samples, through both
schedulers (static batches and continuous batching share `nanoserve.sampling.step_sampling`).

Oracles: `json.loads` + `jsonschema` for JSON rows, `re.fullmatch` for regex rows, the
choice list; the row run alone for rows sharing a batch; `log_softmax` of transformers'
logits on the same weights for logprobs; each sample's seeded row alone for n samples."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from nanoserve.cache.block_manager import check_integrity
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.structured import (
    GrammarCache,
    StructuredOutputs,
    allocate_bitmask,
    apply_bitmask,
    structured_from_request,
)
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve.static.generate import generate_batch, pool_for

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {
        "type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15},
                                      "location": {"type": "object", "properties": {
                                          "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                          "lon": {"type": "number", "minimum": -180,
                                                  "maximum": 180}},
                                          "required": ["lat", "lon"],
                                          "additionalProperties": False}},
     "required": ["city", "location"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                      "year": {"type": "integer", "minimum": 1900,
                                               "maximum": 2030},
                                      "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 8}, "maxItems": 2},
        "meta": {"type": "object", "properties": {"source": {"type": "string", "maxLength": 10}},
                 "required": ["source"], "additionalProperties": False}},
     "required": ["meta"], "additionalProperties": False},
]
PROMPTS = [
    "Describe a person as JSON.", "Pick some colors as JSON.", "Give a city and its coordinates.",
    "Rate the sentiment of: I love this!", "Name a good movie.", "Make up a product code.",
    "List a few small numbers.", "Tag this article about sports.",
]


def _chat(llm, text):
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True),
        add_special_tokens=False)


def _json_params(schema, max_tokens=120):
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=schema))


def _both(llm, prompts, params):
    """The same rows through the static batches and continuous batching (eager steps)."""
    static, _ = generate_batch(llm.model, prompts, params, llm.eos_token_ids, llm.pool,
                               llm.tokenizer, grammars=llm.grammars)
    cont, _ = generate_continuous(llm.model, prompts, params, llm.eos_token_ids, llm.pool,
                                  llm.tokenizer, grammars=llm.grammars)
    check_integrity(llm.pool.allocator, [])
    return static, cont


def test_json_schemas_parse_and_validate_through_both_schedulers(smollm2_llm):
    prompts = [_chat(smollm2_llm, p) for p in PROMPTS]
    params = [_json_params(s) for s in SCHEMAS]
    for outs in _both(smollm2_llm, prompts, params):
        for out, schema in zip(outs, SCHEMAS):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_json_object_rows(smollm2_llm):
    llm = smollm2_llm
    prompts = [_chat(llm, "What is today's date?"), _chat(llm, "Is the sky blue?"),
               _chat(llm, "Describe a cat."), _chat(llm, "Write a greeting.")]
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    choices = ("yes", "no", "maybe")
    grammar = 'root ::= "Hello, " name "!"\nname ::= [A-Z][a-z]+'
    params = [SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(regex=regex)),
              SamplingParams(max_tokens=10, structured_outputs=StructuredOutputs(choice=choices)),
              SamplingParams(max_tokens=80, structured_outputs=StructuredOutputs(json_object=True)),
              SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(grammar=grammar))]
    for outs in _both(llm, prompts, params):
        assert re.fullmatch(regex, outs[0].text), outs[0].text
        assert outs[1].text in choices
        assert isinstance(json.loads(outs[2].text), dict)
        assert re.fullmatch(r"Hello, [A-Z][a-z]+!", outs[3].text), outs[3].text
        assert all(o.finish_reason == "stop" for o in outs)


def test_an_unconstrained_row_in_a_constrained_batch_gets_its_tokens_alone(smollm2_llm):
    llm = smollm2_llm
    plain = _chat(llm, "Tell me about the moon.")
    prompts = [_chat(llm, PROMPTS[0]), plain, _chat(llm, PROMPTS[3])]
    params = [_json_params(SCHEMAS[0], 40), SamplingParams(max_tokens=24),
              _json_params(SCHEMAS[3], 40)]
    alone_static, alone_cont = _both(llm, [plain], [SamplingParams(max_tokens=24)])
    static, cont = _both(llm, prompts, params)
    assert static[1].token_ids == alone_static[0].token_ids
    assert cont[1].token_ids == alone_cont[0].token_ids == alone_static[0].token_ids
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    alone, _ = _both(llm, [plain], [seeded])
    mixed = generate_batch(llm.model, prompts, [params[0], seeded, params[2]], llm.eos_token_ids,
                           llm.pool, llm.tokenizer, grammars=llm.grammars)[0]
    assert mixed[1].token_ids == alone[0].token_ids


def test_a_terminated_grammar_ends_its_row_even_with_ignore_eos(smollm2_llm):
    """`ignore_eos` keeps a row going past EOS, but a grammar that accepted its stop token is
    done: the row ends there with 'stop' (nothing unconstrained follows), alone or batched."""
    llm = smollm2_llm
    choices = ("yes", "no", "maybe")
    params = [SamplingParams(max_tokens=16, ignore_eos=True,
                             structured_outputs=StructuredOutputs(choice=choices)),
              SamplingParams(max_tokens=24, ignore_eos=True, structured_outputs=StructuredOutputs(
                  regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))]
    prompts = [_chat(llm, "Is the sky blue?"), _chat(llm, "What is today's date?")]
    for outs in [*_both(llm, prompts, params), *_both(llm, prompts[:1], params[:1])]:
        assert outs[0].text in choices and outs[0].finish_reason == "stop"
        assert outs[0].token_ids[-1] in llm.eos_token_ids
    for outs in _both(llm, prompts, params):
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", outs[1].text)
        assert outs[1].finish_reason == "stop"


def test_a_row_cut_by_max_tokens_ends_with_length(smollm2_llm):
    llm = smollm2_llm
    params = [SamplingParams(max_tokens=3, structured_outputs=StructuredOutputs(
        regex=r"[a-z]{20}"))]
    for outs in _both(llm, [_chat(llm, "Spell a long word.")], params):
        assert outs[0].finish_reason == "length"
        assert re.fullmatch(r"[a-z]+", outs[0].text)


# --- the bitmask and the constraint's checks -----------------------------------------------


def test_apply_bitmask_matches_xgrammar():
    import xgrammar as xgr

    torch.manual_seed(0)
    V = 100
    bm = torch.randint(-(2**31), 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32)
    logits = torch.randn(3, V)
    ours = apply_bitmask(logits.clone(), bm)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bm)
    assert torch.equal(ours, theirs)
    full = allocate_bitmask(1, 4)
    assert torch.equal(apply_bitmask(torch.zeros(1, V), full), torch.zeros(1, V))


class _VocabWithout:
    """The model's tokenizer as xgrammar sees it, with every token containing one of `chars`
    renamed `<goneN>` (text the test's regexes never match): a grammar that needs one of
    those characters reaches a state where no token is allowed."""

    def __init__(self, tokenizer, chars: str) -> None:
        self.inner, self.chars = tokenizer.backend, chars

    @property
    def backend(self):
        return self

    def get_vocab(self, with_added_tokens=True):
        vocab = self.inner.get_vocab(with_added_tokens=with_added_tokens)
        return {(t if not any(c in t for c in self.chars) else f"<gone{i}>"): i
                for t, i in vocab.items()}

    def to_str(self):
        return self.inner.to_str()


def test_a_grammar_that_allows_no_token_ends_its_row_with_an_error(smollm2_llm):
    """A row whose grammar allows no next token ends with finish_reason 'error' (found by the
    masked argmax or draw on the device: token -1, never fed to the model), at its first token
    (the prefill's) or later; the other rows of its batch get their tokens alone, through
    both schedulers and the runner's fixed-tensor steps."""
    from nanoserve.sampling.structured import GrammarCache

    llm = smollm2_llm
    tok = llm.tokenizer
    grammars = GrammarCache(_VocabWithout(tok, "xX"), llm.config.vocab_size, llm.eos_token_ids)
    prompts = [_chat(llm, p) for p in PROMPTS[:4]]
    params = [SamplingParams(max_tokens=6, structured_outputs=StructuredOutputs(regex="x")),
              SamplingParams(max_tokens=6, structured_outputs=StructuredOutputs(regex="a{1,2}x")),
              SamplingParams(max_tokens=8, temperature=0.9, seed=3,
                             structured_outputs=StructuredOutputs(regex="b{1,2}x")),
              SamplingParams(max_tokens=8)]
    alone = llm.generate([prompts[3]], [params[3]])[0]
    static, _ = generate_batch(llm.model, prompts, params, llm.eos_token_ids, llm.pool,
                               tok, grammars=grammars)
    cont, fixed = (generate_continuous(llm.model, prompts, params, llm.eos_token_ids, llm.pool,
                                       tok, grammars=grammars, step_mode=mode)[0]
                   for mode in ("eager", "static"))
    # every row greedy: the fixed-tensor step's masked sampling (one bitmask row per row)
    from nanoserve.scheduling.model_runner import ContinuousRunner

    greedy = [p if p.greedy else SamplingParams(max_tokens=8, structured_outputs=p.structured_outputs)
              for p in params]
    runner = ContinuousRunner(llm.model, llm.pool, 4, "static")
    masked = generate_continuous(llm.model, prompts, greedy, llm.eos_token_ids, llm.pool, tok,
                                 runner=runner, grammars=grammars)[0]
    assert runner.masked_steps > 0
    check_integrity(llm.pool.allocator, [])
    for outs in (static, cont, fixed, masked):
        assert [o.finish_reason for o in outs[:3]] == ["error"] * 3
        assert all("allows no next token" in o.error for o in outs[:3]) and outs[0].token_ids == []
        assert re.fullmatch(r"a{1,2}", outs[1].text) and re.fullmatch(r"b{1,2}", outs[2].text)
        assert outs[3].token_ids == alone.token_ids


def test_the_fill_thread_fills_as_inline_and_hands_back_its_errors(smollm2_llm):
    """`FillThread` writes the rows it is given exactly as `fill_bitmasks` does inline (the
    other rows left alone), raises a failed fill's error from `wait`, and goes on after
    it."""
    from nanoserve.sampling.structured import FillThread, allocate_bitmask, fill_bitmasks

    grammars = smollm2_llm.grammars
    matchers = [grammars.matcher(StructuredOutputs(regex="[a-c]+!")),
                grammars.matcher(StructuredOutputs(choice=("left", "right"))),
                grammars.matcher(StructuredOutputs(json_object=True))]
    inline = allocate_bitmask(5, grammars.words)
    fill_bitmasks(matchers, inline, [0, 2, 4])
    thread = FillThread()
    for _ in range(2):
        out = allocate_bitmask(5, grammars.words)
        thread.start(matchers, out, [0, 2, 4])
        assert thread.wait() is None
        assert torch.equal(out, inline)
        assert (out[1] == -1).all() and (out[3] == -1).all() and not (out[0] == -1).all()
        thread.start(matchers, torch.zeros(5, grammars.words), [0, 2, 4])  # not int32
        with pytest.raises(RuntimeError):
            thread.wait()


def test_batch_accept_reads_xgrammars_answers(smollm2_llm):
    """`accept_tokens` (xgrammar's core call, its result read at once when every token was
    accepted) gives, step after step, the accepted flags, terminations and next masks of
    xgrammar's own public batch call on twin matchers: refused tokens and finished grammars
    among them."""
    import random

    import xgrammar as xgr

    from nanoserve.sampling.structured import accept_tokens, fill_bitmasks

    llm = smollm2_llm
    kinds = [StructuredOutputs(json=json.dumps(s)) for s in SCHEMAS[:3]] + [
        StructuredOutputs(regex="[a-z]{2,6}( [0-9]{1,2}){1,3}"),
        StructuredOutputs(choice=("yes", "no", "perhaps"))]
    rows = 40
    ours = [llm.grammars.matcher(kinds[i % len(kinds)]) for i in range(rows)]
    theirs = [llm.grammars.matcher(kinds[i % len(kinds)]) for i in range(rows)]
    public = xgr.BatchGrammarMatcher(1)
    a, b = allocate_bitmask(rows, llm.grammars.words), allocate_bitmask(rows, llm.grammars.words)
    rng = random.Random(3)
    refused = 0
    for step in range(14):
        live = [j for j in range(rows) if not ours[j].terminated]  # as a step's steered rows
        fill_bitmasks([ours[j] for j in live], a)
        assert a[:len(live)].ne(0).any(dim=1).all()  # every live row allows some token
        public.batch_fill_next_token_bitmask([theirs[j]._m for j in live], b)
        assert torch.equal(a[:len(live)], b[:len(live)])
        tokens = []
        for i, j in enumerate(live):  # an allowed token; at odd steps row 5 sends a refused one
            allowed = torch.nonzero(((a[i].unsqueeze(-1) >> torch.arange(32)) & 1).flatten())
            tokens.append(7 if j == 5 and step % 2 else int(allowed[rng.randrange(len(allowed))]))
        got = accept_tokens([ours[j] for j in live], tokens)
        want = public.batch_accept_token([theirs[j]._m for j in live], tokens)
        assert got == [bool(x) for x in want]
        for j in live:
            theirs[j].terminated = theirs[j]._m.is_terminated()
        assert [m.terminated for m in ours] == [m.terminated for m in theirs]
        refused += got.count(False)
    assert refused and any(m.terminated for m in ours)


@pytest.mark.parametrize(("request_fields", "message"), [
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_json": [1, 2]}, "must be a JSON object"),
    ({"guided_json": {"type": "string", "not": {"maxLength": 2}}}, "'not'"),
    ({"guided_json": {"$ref": "https://example.com/s.json"}}, "outside the schema"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_choice": "yes"}, "list of strings"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured output"),
    ({"response_format": {"type": "xml"}}, "json_schema, json_object, text"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_malformed_requests_are_refused_with_their_problem(request_fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        structured_from_request(request_fields)


def test_response_format_and_guided_fields_are_read():
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured_from_request({"response_format": rf}) == StructuredOutputs(json=schema)
    assert structured_from_request({"response_format": {"type": "json_object"}}).json_object
    assert structured_from_request({"response_format": {"type": "text"}}) is None
    assert structured_from_request({"guided_json": json.dumps(schema)}) == StructuredOutputs(
        json=schema)
    assert structured_from_request({"guided_choice": ["a", "b"]}).choice == ("a", "b")
    assert structured_from_request({}) is None


@pytest.mark.parametrize(("so", "message"), [
    (StructuredOutputs(json={"type": 5}), "JSON schema could not be compiled"),
    (StructuredOutputs(json={"type": "integer", "minimum": 5, "maximum": 3}), "could not be compiled"),
    (StructuredOutputs(regex="[a-z"), "regex could not be compiled"),
    (StructuredOutputs(grammar='root ::= "a" | '), "grammar could not be compiled"),
])
def test_constraints_that_do_not_compile_are_refused(smollm2_llm, so, message):
    cache = GrammarCache(smollm2_llm.tokenizer, smollm2_llm.config.vocab_size,
                         smollm2_llm.eos_token_ids)
    with pytest.raises(ValueError, match=message):
        cache.check(so)
    with pytest.raises(ValueError, match=message):  # the error is cached too
        cache.compile(so)
    with pytest.raises(ValueError, match=message):  # a row with it never starts
        generate_batch(smollm2_llm.model, [[1, 2, 3]], [SamplingParams(structured_outputs=so)],
                       smollm2_llm.eos_token_ids, smollm2_llm.pool, smollm2_llm.tokenizer,
                       grammars=cache)
    check_integrity(smollm2_llm.pool.allocator, [])


@pytest.mark.parametrize(("fields", "message"), [
    ({"n": 0}, "n must be an integer in [1, 128]"), ({"n": 129}, "n must be"),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be"),
    ({"structured_outputs": StructuredOutputs(choice=())}, "non-empty list"),
])
def test_bad_sampling_values_are_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)


# --- logprobs against transformers ---------------------------------------------------------


def _hf_logprobs(model_dir, ids):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)  # [T, V]: position t predicts t + 1


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_logprobs_and_prompt_logprobs_equal_transformers(tiny_model, tiny_model_dir, scheduler):
    prompts = [[5, 9, 17, 33, 2 + 60], [7, 8, 9, 10, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46, 47,
                                         48, 49, 50, 51]]
    params = [SamplingParams(max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.9, seed=3, logprobs=0,
                             prompt_logprobs=0, ignore_eos=True)]
    run = generate_batch if scheduler == "static" else generate_continuous
    pool = pool_for(tiny_model, prompts, 8)
    outs, _ = run(tiny_model, prompts, params, pool=pool)
    for prompt, p, out in zip(prompts, params, outs):
        lsm = _hf_logprobs(tiny_model_dir, prompt + out.token_ids)
        n = len(prompt)
        assert len(out.logprobs) == len(out.token_ids)
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = lsm[n - 1 + j]
            assert entry.token_id == tok
            assert entry.logprob == pytest.approx(float(row[tok]), abs=1e-4)
            assert entry.rank == int((row > row[tok]).sum()) + 1
            top = row.topk(p.logprobs)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert len(out.prompt_logprobs) == n - 1
        for j, entry in enumerate(out.prompt_logprobs):
            row = lsm[j]
            assert entry.token_id == prompt[j + 1]
            assert entry.logprob == pytest.approx(float(row[prompt[j + 1]]), abs=1e-4)
            assert entry.rank == int((row > row[prompt[j + 1]]).sum()) + 1
            assert [t for t, _ in entry.top] == row.topk(p.prompt_logprobs).indices.tolist()
    assert outs[0].logprobs[0].rank == 1  # greedy: the argmax


def test_prompt_logprobs_are_right_whatever_the_prefix_cache_holds(tiny_model):
    prompt = list(range(3, 3 + 37))
    pool = pool_for(tiny_model, [prompt] * 3, 4)
    want, _ = generate_batch(tiny_model, [prompt], [SamplingParams(
        max_tokens=2, prompt_logprobs=2)], pool=pool)
    # The prompt's blocks are cached now; a row asking for prompt logprobs ignores them.
    warm, _ = generate_batch(tiny_model, [prompt], [SamplingParams(max_tokens=2)], pool=pool,
                             prefix_caching=True)
    for run in (generate_batch, generate_continuous):
        got, stats = run(tiny_model, [prompt], [SamplingParams(max_tokens=2, prompt_logprobs=2)],
                         pool=pool, prefix_caching=True)
        assert len(got[0].prompt_logprobs) == len(prompt) - 1
        for a, b in zip(got[0].prompt_logprobs, want[0].prompt_logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert stats.cached_tokens == 0


# --- n samples -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
@pytest.mark.parametrize("prompt_len", [16, 21])  # a full last block, a partial one
def test_each_of_n_samples_equals_its_seeded_row_alone(tiny_model, scheduler, prompt_len):
    prompt = [(7 * i + 3) % 120 + 3 for i in range(prompt_len)]
    other = [9, 10, 11]
    n = 4
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=11, n=n, ignore_eos=True,
                            logprobs=1)
    run = generate_batch if scheduler == "static" else generate_continuous
    pool = pool_for(tiny_model, [prompt] * n + [other], 8)
    outs, stats = run(tiny_model, [prompt, other], [params, SamplingParams(max_tokens=3)],
                      pool=pool)
    assert [o.sample_index for o in outs] == [0, 1, 2, 3, 0]
    assert stats.prefill_real_tokens == prompt_len + len(other)  # the prompt once
    check_integrity(pool.allocator, [])
    for i in range(n):
        alone, _ = generate_batch(tiny_model, [prompt], [SamplingParams(
            max_tokens=7, temperature=1.0, seed=11 + i, ignore_eos=True, logprobs=1)], pool=pool)
        assert outs[i].token_ids == alone[0].token_ids
        assert [e.logprob for e in outs[i].logprobs] == pytest.approx(
            [e.logprob for e in alone[0].logprobs], abs=1e-5)
    assert len({tuple(o.token_ids) for o in outs[:n]}) > 1  # the samples differ


def test_n_samples_in_a_pool_too_small_to_fork_them_all_at_once(tiny_model):
    """Samples that do not fit the prompt's admission run later as rows of their own."""
    prompt = list(range(3, 3 + 20))
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=5, n=3, ignore_eos=True)
    pool = pool_for(tiny_model, [prompt], 6)
    outs, _ = generate_continuous(tiny_model, [prompt], [params], pool=pool, max_batch_size=2)
    for i, out in enumerate(outs):
        alone, _ = generate_batch(tiny_model, [prompt], [SamplingParams(
            max_tokens=6, temperature=0.7, seed=5 + i, ignore_eos=True)], pool=pool)
        assert out.token_ids == alone[0].token_ids
    check_integrity(pool.allocator, [])


# --- every control at once, through the continuous runner's fixed-tensor step --------------


_SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                        "maximum": 99},
                                                  "b": {"enum": ["x", "yy"]}},
                 "required": ["a", "b"], "additionalProperties": False}


def _small_engine(folder, device: str, mode: str):
    """The model in `folder` (float32), a 64-block pool and a runner in `mode` with 4 row
    slots (fewer than the tests' rows: they queue)."""
    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.llm import LLM
    from nanoserve.scheduling.model_runner import ContinuousRunner

    llm = LLM(str(folder), device=device, dtype="float32", scheduler="static",
              kv_cache_bytes=16 << 20)
    pool = KVPool(CacheShape.of(llm.config), 64, 4, torch.float32, device)
    return llm, pool, ContinuousRunner(llm.model, pool, 4, mode)


def mixed_controls_equal_rows_alone(device: str, mode: str, folder) -> None:
    """Constrained, logprob, n-sample, sampled and plain rows in one continuous batch (rows
    joining and leaving; `mode` "static" runs the captured step's code uncaptured, "graph"
    captures it) each equal the row run alone through the static path on the same model:
    tokens, finish reasons and logprobs. Every block comes back."""
    llm, pool, runner = _small_engine(folder, device, mode)
    tok = llm.tokenizer
    rows = [
        ("alpha", SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(json=_SMALL_SCHEMA))),
        ("beta", SamplingParams(max_tokens=12, logprobs=3)),
        ("gamma", SamplingParams(max_tokens=10, temperature=0.9, seed=4, n=3, logprobs=2)),
        ("delta", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(
            regex="[a-c]{2,5}!"), temperature=0.7, seed=1)),
        ("epsilon", SamplingParams(max_tokens=15)),
        ("zeta", SamplingParams(max_tokens=9, structured_outputs=StructuredOutputs(
            choice=("left", "right")), n=2, temperature=1.0, seed=9)),
        ("eta eta eta eta eta eta", SamplingParams(max_tokens=6, prompt_logprobs=1)),
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t, _ in rows]
    params = [p for _, p in rows]
    outs, _ = generate_continuous(llm.model, prompts, params, llm.eos_token_ids, pool, tok,
                                  max_batch_size=4, runner=runner, grammars=llm.grammars)
    want = []
    for prompt, p in zip(prompts, params):
        want += generate_batch(llm.model, [prompt], [p], llm.eos_token_ids, None, tok,
                               grammars=llm.grammars)[0]
    assert len(outs) == len(want) == sum(p.n for p in params)
    for got, exp in zip(outs, want):
        assert (got.token_ids, got.finish_reason, got.sample_index) == (
            exp.token_ids, exp.finish_reason, exp.sample_index)
        if exp.logprobs is not None:
            assert [(e.token_id, e.rank) for e in got.logprobs] == [
                (e.token_id, e.rank) for e in exp.logprobs]
            assert [e.logprob for e in got.logprobs] == pytest.approx(
                [e.logprob for e in exp.logprobs], abs=1e-4)
        if exp.prompt_logprobs is not None:
            assert [e.logprob for e in got.prompt_logprobs] == pytest.approx(
                [e.logprob for e in exp.prompt_logprobs], abs=1e-4)
    assert json.loads(outs[0].text)["b"] in ("x", "yy")
    assert re.fullmatch("[a-c]{2,5}!", outs[5].text)
    assert {outs[7].text, outs[8].text} <= {"left", "right"}
    assert pool.allocator.num_free == pool.num_blocks


def greedy_constrained_equal_rows_alone(device: str, mode: str, folder):
    """Greedy rows only, most of them constrained (a JSON schema, a regex, a choice) and some
    plain, in one continuous batch with fewer row slots than rows: the steps that hold a
    constrained row take the fixed-tensor masked sampling (`ContinuousRunner._masked_step`:
    one bitmask row per step row, a plain or finished row's all-allowed), and each row
    equals itself run alone through the static path. Returns the runner."""
    llm, pool, runner = _small_engine(folder, device, mode)
    tok = llm.tokenizer
    kinds = [StructuredOutputs(json=_SMALL_SCHEMA), StructuredOutputs(regex="[a-c]{2,5}!"), None,
             StructuredOutputs(choice=("left", "right")), None]
    params = [SamplingParams(max_tokens=10 + 3 * (i % 4), structured_outputs=kinds[i % 5])
              for i in range(11)]
    prompts = [tok.encode(f"row {i}: " + "word " * (i % 4), add_special_tokens=False)
               for i in range(11)]
    outs, _ = generate_continuous(llm.model, prompts, params, llm.eos_token_ids, pool, tok,
                                  max_batch_size=4, runner=runner, grammars=llm.grammars)
    for prompt, p, got in zip(prompts, params, outs, strict=True):
        exp = generate_batch(llm.model, [prompt], [p], llm.eos_token_ids, None, tok,
                             grammars=llm.grammars)[0][0]
        assert (got.token_ids, got.finish_reason) == (exp.token_ids, exp.finish_reason)
    assert runner.masked_steps > 0
    assert re.fullmatch("[a-c]{2,5}!", outs[1].text) and outs[3].text in ("left", "right")
    assert pool.allocator.num_free == pool.num_blocks
    return runner


def test_greedy_constrained_rows_through_the_fixed_masked_step(tmp_path):
    from nanoserve.testing import save_tiny_byte_llama

    greedy_constrained_equal_rows_alone("cpu", "static", save_tiny_byte_llama(tmp_path / "m"))


def test_mixed_controls_through_the_fixed_tensor_step(tmp_path):
    from nanoserve.testing import save_tiny_byte_llama

    mixed_controls_equal_rows_alone("cpu", "static", save_tiny_byte_llama(tmp_path / "m"))


def test_constrained_rows_preempted_keep_their_tokens(tmp_path):
    """Constrained, sampled and plain rows in a pool too small for all of them: rows are
    preempted and recomputed (their matchers keep their place); each row equals itself run
    alone through the static path, and every block comes back."""
    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.llm import LLM
    from nanoserve.testing import save_tiny_byte_llama

    llm = LLM(str(save_tiny_byte_llama(tmp_path / "m")), dtype="float32", scheduler="static",
              kv_cache_bytes=16 << 20)
    tok = llm.tokenizer
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                               "v": {"type": "integer", "minimum": 0}},
              "required": ["k", "v"], "additionalProperties": False}
    kinds = [StructuredOutputs(regex="[a-z]{3,9}( [0-9]{1,3}){2}"),
             StructuredOutputs(json=schema), StructuredOutputs(choice=("north", "south", "east")),
             None]
    params = [SamplingParams(max_tokens=24, structured_outputs=kinds[i % 4],
                             temperature=0.0 if i % 3 else 0.9, seed=i) for i in range(10)]
    prompts = [tok.encode(f"row {i}: " + "word " * (i % 5), add_special_tokens=False)
               for i in range(10)]
    pool = KVPool(CacheShape.of(llm.config), 14, 4, torch.float32, llm.device)
    outs, stats = generate_continuous(llm.model, prompts, params, llm.eos_token_ids, pool, tok,
                                      max_batch_size=6, grammars=llm.grammars)
    assert stats.preemptions > 0
    for prompt, p, out in zip(prompts, params, outs):
        exp = generate_batch(llm.model, [prompt], [p], llm.eos_token_ids, None, tok,
                             grammars=llm.grammars)[0][0]
        assert (out.token_ids, out.finish_reason) == (exp.token_ids, exp.finish_reason)
    assert pool.allocator.num_free == pool.num_blocks
