"""nanoserve.sampling.reasoning: a think block split exactly from the answer, on a tokenizer whose
vocabulary has `<think>` / `</think>` as special tokens (the default model's BPE plus those
two) and a tiny random model over it. A greedy run is forced to think by ending the prompt
with `<think>`; it never closes the block within max_tokens, so it is the unfinished case:
all output is reasoning, the answer empty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.reasoning import ReasoningParser


@pytest.fixture(scope="module")
def think_model(tmp_path_factory, smollm2_gguf_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanoserve.weights.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("think-model")
    backend = Tokenizer.from_path(smollm2_gguf_path).backend
    backend.add_special_tokens(["<think>", "</think>"])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    backend.save(str(folder / "tokenizer.json"))
    template = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>"}))
    return folder


@pytest.fixture(scope="module")
def think_llm(think_model):
    from nanoserve.llm import LLM

    return LLM(model=str(think_model), device="cpu", kv_cache_bytes=16 << 20)


def test_think_tags_are_single_tokens(think_llm):
    tok = think_llm.tokenizer
    p = ReasoningParser("qwen3", tok)
    assert tok.encode("<think>", add_special_tokens=False) == [p.open_id]
    assert tok.encode("</think>", add_special_tokens=False) == [p.close_id]


def test_forced_think_block_unfinished_is_all_reasoning(think_llm):
    tok = think_llm.tokenizer
    parser = ReasoningParser("qwen3", tok)
    prompt = tok.encode("Question: 2+2?", add_special_tokens=False) + [parser.open_id]
    (out,) = think_llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert out.finish_reason == "length" and parser.close_id not in out.token_ids
    split = parser.split(prompt, out.token_ids)
    assert split.reasoning_ids == tuple(out.token_ids) and split.answer_ids == ()
    assert not split.finished and split.num_reasoning_tokens == 6
    reasoning, answer, n, finished = parser.split_text(prompt, out.token_ids)
    assert reasoning == tok.decode(out.token_ids) and answer == "" and n == 6
    # without the forced block, qwen3 reads the same output as all answer
    plain = tok.encode("Question: 2+2?", add_special_tokens=False)
    assert parser.split(plain, out.token_ids).reasoning_ids is None
    # deepseek_r1's template opens the block in its prompt: all reasoning either way
    assert ReasoningParser("deepseek_r1", tok).split(plain, out.token_ids).reasoning_ids \
        == tuple(out.token_ids)


def test_closed_block_splits_exactly_at_the_tags(think_llm):
    tok = think_llm.tokenizer
    parser = ReasoningParser("qwen3", tok)
    think = tok.encode("let me add", add_special_tokens=False)
    answer = tok.encode("\n\nIt is 4.", add_special_tokens=False)
    ids = [parser.open_id] + think + [parser.close_id] + answer
    split = parser.split([5, 6], ids)
    assert split.reasoning_ids == tuple(think) and split.answer_ids == tuple(answer)
    assert split.finished
    # a closed block after a forced <think> in the prompt
    split = parser.split([5, parser.open_id], think + [parser.close_id] + answer)
    assert split.reasoning_ids == tuple(think) and split.answer_ids == tuple(answer)
    assert parser.split_text([5, 6], ids)[:2] == ("let me add", "\n\nIt is 4.")


def test_unknown_parser_and_missing_tags_are_errors(tiny_llm, think_llm):
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        ReasoningParser("r2", think_llm.tokenizer)
    with pytest.raises(ValueError, match="no single <think> / </think> tokens"):
        ReasoningParser("qwen3", tiny_llm.tokenizer)


def test_cli_reasoning_flags_reach_the_rows(think_model, think_llm, hf_think, hf_think_tok,
                                            ray_session, tmp_path, capsys):
    """`nanoserve batch --reasoning-parser qwen3 --max-thinking-tokens 2 --chat-template-kwargs
    '{"enable_thinking": false}'`, held to transformers: a forced block closes at 2 tokens; a
    chat row's prompt ends in the template's empty think block (its num_input_tokens count
    it) and its output is all answer; a row's own budget beyond max_tokens leaves its block
    unfinished (all reasoning, no answer, 'length')."""
    import pyarrow.dataset as ds

    from nanoserve.errors import InputError
    from nanoserve_cli import main as nanoserve_main
    from ray_jobs import run_batch_job

    chat = [{"role": "user", "content": "2+2?"}]
    rows = [{"id": 0, "prompt": "Question: 2+2?<think>"},
            {"id": 1, "messages": chat},
            {"id": 2, "prompt": "Question: 3+3?<think>", "max_thinking_tokens": 50}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = nanoserve_main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"),
                         "--model", str(think_model), "--max-tokens", "6", "--ignore-eos",
                         "--kv-cache-memory", str(16 / 1024), "--reasoning-parser", "qwen3",
                         "--max-thinking-tokens", "2", "--chat-template-kwargs",
                         '{"enable_thinking": false}', "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    got = {r["id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    tok = hf_think_tok
    parser = ReasoningParser("qwen3", think_llm.tokenizer)
    forced = tok(rows[0]["prompt"])["input_ids"]
    assert forced[-1] == parser.open_id
    want = budget_oracle(hf_think, parser, forced, 2, 3)
    assert got[0]["generated_token_ids"] == want and got[0]["num_reasoning_tokens"] == 2
    assert got[0]["num_input_tokens"] == len(forced)
    assert got[0]["reasoning"] == tok.decode(want[:2])
    assert got[0]["generated_text"] == tok.decode(want[3:])
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                       enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")
    prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    want = hf_greedy(hf_think, prompt, 6)
    assert parser.open_id not in want
    assert got[1]["num_input_tokens"] == len(prompt)
    assert got[1]["generated_token_ids"] == want and got[1]["num_reasoning_tokens"] == 0
    assert got[1]["reasoning"] is None and got[1]["generated_text"] == tok.decode(want)
    unfinished = tok(rows[2]["prompt"])["input_ids"]
    want = hf_greedy(hf_think, unfinished, 6)
    assert parser.close_id not in want
    assert got[2]["generated_token_ids"] == want and got[2]["num_reasoning_tokens"] == 6
    assert got[2]["finish_reason"] == "length" and got[2]["generated_text"] == ""
    assert got[2]["reasoning"] == tok.decode(want)
    with pytest.raises(InputError, match="unknown reasoning parser 'r2'"):
        run_batch_job(tmp_path / "in.jsonl", tmp_path / "out2", model=str(think_model),
                      reasoning_parser="r2", progress=False)


def test_openai_chat_lines_carry_reasoning_content(think_model, hf_think, hf_think_tok,
                                                   ray_session, tmp_path):
    """deepseek_r1 reads output as reasoning from its start: with no closing tag in 6
    tokens, the whole output is `reasoning_content` and `content` is empty."""
    from ray_jobs import run_batch_job

    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
            # greedy, as the oracle below (a request without temperature samples at 1)
            "body": {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 6,
                     "temperature": 0, "ignore_eos": True}}
    (tmp_path / "req.jsonl").write_text(json.dumps(line) + "\n")
    run_batch_job(tmp_path / "req.jsonl", tmp_path / "out", model=str(think_model),
                  kv_cache_bytes=16 << 20, reasoning_parser="deepseek_r1", progress=False)
    (out,) = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    choice = out["response"]["body"]["choices"][0]
    tok = hf_think_tok
    prompt = tok(tok.apply_chat_template(line["body"]["messages"], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    want = hf_greedy(hf_think, prompt, 6)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == tok.decode(want) != ""
    assert out["response"]["body"]["usage"]["prompt_tokens"] == len(prompt)


# --- steering while thinking: the budget and constraints after the block -------------------


@pytest.fixture(scope="module")
def hf_think(think_model):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(think_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_think_tok(think_model):
    """transformers' tokenizer of the same folder (its chat template from
    tokenizer_config.json): the prompts the oracle sees."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_model)


def hf_greedy(hf, ids, n):
    """transformers' greedy continuation of `ids` by n tokens (the oracle)."""
    import torch

    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
    return out


@pytest.fixture(scope="module", params=["continuous", "static"])
def steered_llm(request, think_model):
    from nanoserve.llm import LLM

    return LLM(model=str(think_model), device="cpu", kv_cache_bytes=16 << 20,
               scheduler=request.param, reasoning_parser="qwen3")


def budget_oracle(hf, parser, prompt, budget, answer_tokens):
    """What a budget of `budget` tokens gives: the model's greedy tokens up to the budget
    (the budget-th forced to a newline when the one before does not end a line), the
    closing tag, then the model's greedy answer after it."""
    think = hf_greedy(hf, prompt, budget)
    if budget >= 1 and parser.newline_id is not None:
        before = think[budget - 2] if budget >= 2 else prompt[-1]
        if not parser.ends_line(before):
            think = think[:budget - 1] + [parser.newline_id]
    head = think + [parser.close_id]
    return head + hf_greedy(hf, prompt + head, answer_tokens)


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_budget_closes_the_block_at_exactly_n_tokens(steered_llm, hf_think, budget):
    tok = steered_llm.tokenizer
    parser = steered_llm.reasoning
    prompt = tok.encode("Question: 2+2?", add_special_tokens=False) + [parser.open_id]
    (out,) = steered_llm.generate([prompt], SamplingParams(
        max_tokens=budget + 4, ignore_eos=True, max_thinking_tokens=budget))
    assert out.token_ids == budget_oracle(hf_think, parser, prompt, budget, 3)
    assert out.num_reasoning_tokens == budget and out.token_ids[budget] == parser.close_id
    assert out.text == tok.decode(out.token_ids[budget + 1:]) and out.finish_reason == "length"
    assert out.reasoning == tok.decode(out.token_ids[:budget])


def test_budget_rows_beside_free_rows_and_sampled_rows(steered_llm):
    """Rows with and without a budget share the steps; a sampled row's block ends at its
    budget too; a budget the row never reaches changes nothing."""
    tok = steered_llm.tokenizer
    parser = steered_llm.reasoning
    prompt = tok.encode("Think:", add_special_tokens=False) + [parser.open_id]
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True, max_thinking_tokens=3),
              SamplingParams(max_tokens=8, ignore_eos=True, max_thinking_tokens=2,
                             temperature=1.0, seed=7),
              SamplingParams(max_tokens=8, ignore_eos=True, max_thinking_tokens=50)]
    free, capped, sampled, loose = steered_llm.generate([prompt] * 4, params)
    assert parser.close_id not in free.token_ids and free.num_reasoning_tokens == 8
    assert capped.token_ids[3] == parser.close_id and capped.num_reasoning_tokens == 3
    assert sampled.token_ids[2] == parser.close_id and sampled.num_reasoning_tokens == 2
    assert loose.token_ids == free.token_ids


def test_constraint_applies_after_the_think_block(steered_llm, hf_think):
    """A choice row thinks freely (the model's greedy tokens, which no label starts with)
    until its budget closes the block; the answer is then one of the labels."""
    tok = steered_llm.tokenizer
    parser = steered_llm.reasoning
    from nanoserve.sampling.structured import StructuredOutputs

    prompt = tok.encode("Is it raining? Answer:", add_special_tokens=False) + [parser.open_id]
    labels = ("yes", "no")
    params = [SamplingParams(max_tokens=20, max_thinking_tokens=5,
                             structured_outputs=StructuredOutputs(choice=labels)),
              SamplingParams(max_tokens=20, max_thinking_tokens=3,
                             structured_outputs=StructuredOutputs(regex="[0-9]{3}"))]
    choice, digits = steered_llm.generate([prompt, prompt], params)
    for out, budget in ((choice, 5), (digits, 3)):
        head = budget_oracle(hf_think, parser, prompt, budget, 0)
        assert out.token_ids[:budget + 1] == head
        assert out.finish_reason == "stop" and out.num_reasoning_tokens == budget
    assert choice.text in labels
    assert len(digits.text) == 3 and digits.text.isdigit()
    # the model's free thinking is not held to the grammar: it is no label, no digits
    assert not any(c.isdigit() for c in tok.decode(digits.token_ids[:3]))


def test_no_newline_is_forced_after_a_line_end(steered_llm, hf_think):
    """A budget of 1 after a prompt that ends "<think>\\n" (as the templates open a block):
    the block's last token before the budget's slot already ends a line, so the one thinking
    token is the model's own, not a forced newline, and </think> follows it."""
    tok = steered_llm.tokenizer
    parser = steered_llm.reasoning
    prompt = tok.encode("Question: 2+2?", add_special_tokens=False) + [parser.open_id,
                                                                       parser.newline_id]
    assert parser.ends_line(prompt[-1])
    want = budget_oracle(hf_think, parser, prompt, 1, 2)
    assert want[0] == hf_greedy(hf_think, prompt, 1)[0] != parser.newline_id
    (out,) = steered_llm.generate([prompt], SamplingParams(
        max_tokens=4, ignore_eos=True, max_thinking_tokens=1))
    assert out.token_ids == want and out.token_ids[1] == parser.close_id


def test_empty_think_block_in_the_prompt_starts_the_answer(steered_llm, hf_think, hf_think_tok):
    """A chat prompt rendered with enable_thinking=False ends "<think>\\n\\n</think>\\n\\n": its
    last think tag closes the block, so under the qwen3 parser the output is answer from its
    first token, and a thinking budget forces nothing (transformers' greedy tokens)."""
    tok = hf_think_tok
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                   add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    parser = steered_llm.reasoning
    assert prompt.count(parser.open_id) == prompt.count(parser.close_id) == 1
    assert not parser.starts_in_reasoning(prompt)
    want = hf_greedy(hf_think, prompt, 5)
    assert parser.open_id not in want and parser.close_id not in want
    (out,) = steered_llm.generate([prompt], SamplingParams(
        max_tokens=5, ignore_eos=True, max_thinking_tokens=1))
    assert out.token_ids == want and out.num_reasoning_tokens == 0 and out.reasoning is None
    assert out.text == tok.decode(want)


def test_first_mask_holds_think_beside_the_grammar(think_llm):
    """A qwen3 row whose prompt opened no block, under the regex [0-9]{2}: its first mask
    allows exactly the digits and <think>; once it opened the block it thinks freely; a
    digit first puts it in the answer, where <think> is no longer allowed."""
    import numpy as np

    from nanoserve.sampling.reasoning import ThinkSteer
    from nanoserve.sampling.structured import StructuredOutputs, allocate_bitmask

    tok = think_llm.tokenizer
    parser = ReasoningParser("qwen3", tok)
    so = StructuredOutputs(regex="[0-9]{2}")
    digits = {tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert len(digits) == 10
    prompt = tok.encode("Number:", add_special_tokens=False)

    def allowed(steer):
        mask = allocate_bitmask(1, think_llm.grammars.words)
        steer.fill(mask, 0)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    steer = ThinkSteer(parser, prompt, think_llm.grammars.matcher(so), budget=4)
    assert allowed(steer) == digits | {parser.open_id}
    assert steer.accept(parser.open_id) and steer.thinking
    assert len(allowed(steer)) == think_llm.grammars.words * 32  # free while it thinks
    steer = ThinkSteer(parser, prompt, think_llm.grammars.matcher(so), budget=4)
    assert steer.accept(min(digits)) and not steer.thinking
    assert allowed(steer) == digits


def test_qwen3_row_may_open_its_own_block_under_a_constraint(steered_llm):
    """A qwen3 row whose prompt opened no block: its first token may be <think> beside the
    grammar's tokens (here the regex allows only digits, and the model's own choice among
    those or <think> decides); either way the answer matches the regex."""
    from nanoserve.sampling.structured import StructuredOutputs

    tok = steered_llm.tokenizer
    prompt = tok.encode("Number:", add_special_tokens=False)
    (out,) = steered_llm.generate([prompt], SamplingParams(
        max_tokens=12, max_thinking_tokens=2,
        structured_outputs=StructuredOutputs(regex="[0-9]{2}")))
    assert len(out.text) == 2 and out.text.isdigit() and out.finish_reason == "stop"


def test_budget_needs_a_parser(think_model):
    from nanoserve.llm import LLM

    llm = LLM(model=str(think_model), device="cpu", kv_cache_bytes=16 << 20,
              reasoning_parser="none")
    with pytest.raises(ValueError, match="max_thinking_tokens needs a reasoning parser"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, max_thinking_tokens=1))
    with pytest.raises(ValueError, match="max_thinking_tokens must be an integer >= 0"):
        SamplingParams(max_thinking_tokens=-1)


def test_parser_auto_pick(think_llm, tiny_llm):
    from nanoserve.sampling.reasoning import pick_parser, resolve_parser

    tok = think_llm.tokenizer  # the qwen3 template: the model opens <think> itself
    assert pick_parser("Qwen3ForCausalLM", tok)[0] == "qwen3"
    assert pick_parser("LlamaForCausalLM", tok)[0] is None  # not certain: no parser
    assert pick_parser("Qwen3ForCausalLM", tiny_llm.tokenizer)[0] is None  # no think tags
    import copy

    r1_tok = copy.copy(tok)  # a DeepSeek-R1 distill's template opens the block itself
    r1_tok._chat_template_source = ("{% for m in messages %}<｜User｜>{{ m['content'] }}"
                                    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>"
                                    "<think>\n{% endif %}")
    r1_tok._chat_template = None
    assert pick_parser("Qwen2ForCausalLM", r1_tok)[0] == "deepseek_r1"
    parser, line = resolve_parser("auto", "LlamaForCausalLM", r1_tok)
    assert parser.name == "deepseek_r1" and line.startswith("reasoning parser: deepseek_r1 (auto")
    assert resolve_parser("none", "Qwen3ForCausalLM", tok) == (None, "reasoning parser: none")
    from nanoserve import choose_reasoning_parser  # the job's: a name, no parser built

    assert choose_reasoning_parser("auto", "Qwen3ForCausalLM", tok) == (
        "qwen3", "reasoning parser: qwen3 (auto: a Qwen3 model with <think> / </think> tokens)")
    assert choose_reasoning_parser("auto", "Qwen3ForCausalLM", tiny_llm.tokenizer) == (None, None)
    assert choose_reasoning_parser("none", "Qwen3ForCausalLM", tok) == (
        None, "reasoning parser: none")
    with pytest.raises(ValueError, match="'qwen3': the tokenizer has no single <think>"):
        choose_reasoning_parser("qwen3", "Qwen3ForCausalLM", tiny_llm.tokenizer)


# --- the budget and the parser's auto-pick through the batch job, OpenAI files, Ray Data ----


@pytest.fixture(scope="module")
def qwen3_think_model(tmp_path_factory, think_model):
    """A tiny Qwen3 checkpoint whose tokenizer has <think> / </think>: the family the job
    picks the qwen3 parser for by itself."""
    from nanoserve.testing import save_tiny_family

    template = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    return save_tiny_family(tmp_path_factory.mktemp("qwen3-think"), "qwen3", think_model,
                            chat_template=template)


@pytest.fixture(scope="module")
def hf_qwen3_think(qwen3_think_model):
    """transformers' Qwen3 model and tokenizer over the same folder: the job's oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(qwen3_think_model, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(qwen3_think_model)


def test_job_budget_and_auto_picked_parser(qwen3_think_model, hf_qwen3_think, think_llm,
                                           ray_session, tmp_path):
    """The job picks qwen3 for a Qwen3 model by itself; a job budget of 3 and a row's own 1
    close the block where transformers' greedy tokens, cut at the budget, say; a choice
    row's answer after its block is one of its labels."""
    import pyarrow.dataset as ds

    from ray_jobs import run_batch_job

    hf, tok = hf_qwen3_think
    parser = ReasoningParser("qwen3", think_llm.tokenizer)  # the same vocabulary
    rows = [{"id": 0, "prompt": "Question: 2+2?<think>"},
            {"id": 1, "prompt": "Question: 3+3?<think>", "max_thinking_tokens": 1},
            {"id": 2, "prompt": "Rain?<think>", "guided_choice": ["yes", "no"]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_batch_job(tmp_path / "in.jsonl", tmp_path / "out",
                            model=str(qwen3_think_model), max_tokens=8, ignore_eos=True,
                            max_thinking_tokens=3, kv_cache_bytes=16 << 20, progress=False)
    assert "reasoning parser: qwen3 (auto: a Qwen3 model" in summary.format()
    got = {r["id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    for row, budget in zip(rows[:2], (3, 1)):
        prompt = tok(row["prompt"])["input_ids"]
        want = budget_oracle(hf, parser, prompt, budget, 8 - budget - 1)
        out = got[row["id"]]
        assert out["generated_token_ids"] == want and out["num_reasoning_tokens"] == budget
        assert out["reasoning"] == tok.decode(want[:budget])
        assert out["generated_text"] == tok.decode(want[budget + 1:])
    choice = got[2]
    head = budget_oracle(hf, parser, tok(rows[2]["prompt"])["input_ids"], 3, 0)
    assert choice["generated_token_ids"][:4] == head and choice["num_reasoning_tokens"] == 3
    assert choice["generated_text"] in ("yes", "no") and choice["finish_reason"] == "stop"


def test_openai_body_and_ray_data_take_the_budget(qwen3_think_model, hf_qwen3_think, think_llm,
                                                  ray_session, tmp_path):
    """An OpenAI body's max_thinking_tokens, and the Ray Data processor's option: the same
    transformers tokens. The processor's chat_template_kwargs reach its chat rows: the
    prompt ends in the empty think block and the output is answer from its first token."""
    import ray.data

    from ray_jobs import run_batch_job
    from ray_jobs.data_processor import build_processor

    hf, tok = hf_qwen3_think
    parser = ReasoningParser("qwen3", think_llm.tokenizer)
    line = {"custom_id": "q", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "Question: 2+2?<think>", "max_tokens": 6, "temperature": 0,
                     "ignore_eos": True, "max_thinking_tokens": 2}}
    (tmp_path / "req.jsonl").write_text(json.dumps(line) + "\n")
    run_batch_job(tmp_path / "req.jsonl", tmp_path / "out", model=str(qwen3_think_model),
                  kv_cache_bytes=16 << 20, progress=False)
    want = budget_oracle(hf, parser, tok(line["body"]["prompt"])["input_ids"], 2, 3)
    (out,) = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    assert out["response"]["body"]["choices"][0]["text"] == tok.decode(want[3:])

    chat = [{"role": "user", "content": "2+2?"}]
    process = build_processor(str(qwen3_think_model), concurrency=1, num_gpus=0,
                              kv_cache_bytes=16 << 20, max_tokens=6, ignore_eos=True,
                              max_thinking_tokens=2,
                              chat_template_kwargs={"enable_thinking": False})
    think_row, chat_row = process(ray.data.from_items(
        [{"prompt": "Question: 2+2?<think>", "messages": None},
         {"prompt": None, "messages": chat}])).take_all()
    assert think_row["generated_token_ids"] == want
    assert think_row["reasoning"] == tok.decode(want[:2])
    assert think_row["generated_text"] == tok.decode(want[3:])
    assert think_row["num_reasoning_tokens"] == 2
    prompt = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False),
                 add_special_tokens=False)["input_ids"]
    empty = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert prompt[-len(empty):] == empty
    want = hf_greedy(hf, prompt, 6)
    assert chat_row["num_input_tokens"] == len(prompt)
    assert chat_row["generated_token_ids"] == want and chat_row["num_reasoning_tokens"] == 0
