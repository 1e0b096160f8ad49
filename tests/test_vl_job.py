"""Rows with images through the batch job, OpenAI request files and the Ray Data processor
(a tiny random Qwen2.5-VL on the CPU, local Ray, images written with Pillow).

Oracle: transformers' `generate` on each row alone (`hf_oracle.qwen2_5_vl_generate`: its
tokenizer renders the chat template, its image processor makes the pixels), with the
conversation the documentation gives a row: its messages as they are, or for a `prompt` row
with images one user turn, the images first and then the text; a `prompt` row without images
is plain text. Images are opened here with Pillow, turned by their EXIF orientation. The
checkpoint's weights are scaled (`weight_scale=10`) so that greedy tokens differ from image
to image: a row answered with another row's images, or none, would not match. Rows with and
without images share one shard (one engine call), and each must equal itself alone.
Broken, oversized and missing images are error rows naming the cause while the other rows
run; the driver never reads an image (its image reading is made to fail during the job).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hf_oracle import qwen2_5_vl_generate
from PIL import Image, ImageOps

from nanoserve.testing import png_header, save_tiny_qwen2_5_vl
from ray_jobs import run_batch_job

NEW = 8
KV_BYTES = 8 << 20
JOB = dict(max_tokens=NEW, ignore_eos=True, batch_size=32, kv_cache_bytes=KV_BYTES,
           progress=False)


def _png(w: int, h: int, seed: int, mode: str = "RGB") -> bytes:
    channels = len(mode)
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG")
    return buf.getvalue()


def _jpeg_rotated(w: int, h: int, seed: int) -> bytes:
    """A JPEG whose EXIF orientation (6) says: turn me 90 degrees to view."""
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", exif=exif, quality=90)
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _image(source) -> dict:
    return {"type": "image", "image": source}


def _image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl"), weight_scale=10.0)


@pytest.fixture(scope="module")
def hf_vl(vl_model):
    """transformers' model, tokenizer and image processor over the same folder."""
    import torch
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_model,
                                                            dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf, AutoTokenizer.from_pretrained(vl_model), AutoImageProcessor.from_pretrained(vl_model)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pictures")
    files = {"a.png": _png(84, 56, 1), "b.png": _png(56, 140, 2),
             "rotated.jpg": _jpeg_rotated(112, 56, 3), "alpha.png": _png(70, 70, 4, "RGBA"),
             "huge.png": png_header(9000, 9000), "broken.png": _png(40, 40, 5)[:80]}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


def _open(source) -> Image.Image:
    """An image part's source (bytes, a data: URL, a path, a file:// URL) as Pillow reads it,
    turned upright by its EXIF orientation."""
    if isinstance(source, str) and source.startswith("data:"):
        source = base64.b64decode(source.split(",", 1)[1])
    if isinstance(source, bytes):
        img = Image.open(io.BytesIO(source))
    else:
        img = Image.open(str(source).removeprefix("file://"))
    return ImageOps.exif_transpose(img)


def _hf_answer(hf_vl, row: dict) -> tuple[list[int], int]:
    """transformers' (tokens, prompt tokens) for one input row, alone."""
    hf, tok, proc = hf_vl
    messages = row.get("messages")
    if messages is None and row.get("image") is None:
        return qwen2_5_vl_generate(hf, tok, proc, tok(row["prompt"])["input_ids"], [], NEW)
    if messages is None:
        image = row["image"]
        messages = _user(*[_image(x) for x in (image if isinstance(image, list) else [image])],
                         _text(row["prompt"]))
    images, plain = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] in ("image", "image_url"):
                    images.append(_open(part["image"] if part["type"] == "image"
                                        else part["image_url"]["url"]))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            content = parts
        plain.append({"role": m["role"], "content": content})
    text = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    return qwen2_5_vl_generate(hf, tok, proc, tok(text)["input_ids"], images, NEW)


def _assert_rows_equal_oracle(out_rows: list[dict], rows: dict, hf_vl) -> None:
    answered = {}
    for r in out_rows:
        want, num_prompt = _hf_answer(hf_vl, rows[r["id"]])
        assert r["error"] is None and r["finish_reason"] == "length", (r["id"], r["error"])
        assert list(r["generated_token_ids"]) == want, r["id"]
        assert r["num_input_tokens"] == num_prompt, r["id"]
        answered[r["id"]] = tuple(want)
    # the rows' answers differ: one answered with another row's images would not match
    assert len(set(answered.values())) == len(answered)


# --- the batch job over JSON Lines: content parts, image paths, lists, bad images ----------


@pytest.fixture(scope="module")
def jsonl_job(tmp_path_factory, vl_model, pictures, ray_session):
    p = {k: str(v) for k, v in pictures.items()}
    rows = [
        {"id": 0, "messages": _user(_image_url(_url(_png(84, 56, 9))), _text("What is it?"))},
        {"id": 1, "messages": [{"role": "user", "content": "No image here."}]},
        {"id": 2, "messages": [{"role": "system", "content": "Be short."},
                               *_user(_text("Compare "), _image_url(p["b.png"]), _text(" and "),
                                      _image_url("file://" + p["rotated.jpg"]))]},
        {"id": 3, "prompt": "Describe.", "image": p["a.png"]},
        {"id": 4, "prompt": "Plain text, no template."},
        {"id": 5, "prompt": "Both, in order.", "image": [p["alpha.png"], p["rotated.jpg"]]},
        {"id": 6, "prompt": "Describe.", "image": p["b.png"]},
        {"id": 7, "messages": _user(_image_url(_url(b"not an image at all")), _text("?"))},
        {"id": 8, "prompt": "Too big.", "image": p["huge.png"]},
        {"id": 9, "prompt": "Cut short.", "image": p["broken.png"]},
        {"id": 10, "prompt": "Gone.", "image": p["a.png"] + ".missing"},
        {"id": 11, "messages": _user(_image_url("https://example.invalid/cat.png"))},
        {"id": 12, "messages": [{"role": "user", "content": "x"}], "image": p["a.png"]},
    ]
    folder = tmp_path_factory.mktemp("vl-jsonl")
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = folder / "out"
    from nanoserve.multimodal import image_input
    def refuse(*args, **kwargs):
        raise AssertionError("the driver read an image")

    with pytest.MonkeyPatch.context() as mp:  # this process is the driver; workers are not
        mp.setattr(image_input, "read_image_bytes", refuse)
        summary = run_batch_job(path, out, model=str(vl_model), **JOB)
    return rows, path, out, summary


BAD_JSONL = {7: "does not decode", 8: "refused before decoding", 9: "does not decode",
             10: "cannot read image", 11: "nothing is fetched from a network",
             12: "'image' goes with a 'prompt'"}


def test_job_rows_equal_each_row_alone(jsonl_job, hf_vl):
    rows, _, out, summary = jsonl_job
    got = ds.dataset(out).to_table().to_pylist()
    assert len(list(out.glob("part-*.parquet"))) == 1  # one shard: one engine call for all
    assert sorted(r["id"] for r in got) == [r["id"] for r in rows]
    good = [r for r in got if r["id"] not in BAD_JSONL]
    _assert_rows_equal_oracle(good, {r["id"]: r for r in rows}, hf_vl)
    for r in got:
        if r["id"] in BAD_JSONL:
            assert r["finish_reason"] == "error" and BAD_JSONL[r["id"]] in r["error"], r
            assert r["generated_token_ids"] is None
    assert summary.error_rows == len(BAD_JSONL)


def test_job_output_repeats_paths_and_messages(jsonl_job):
    rows, _, out, _ = jsonl_job
    got = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    for row in rows:
        image = row.get("image")
        # a column mixing one path and lists of them reads as lists (ray_jobs/input/json_shapes.py)
        assert got[row["id"]]["image"] == (None if image is None else
                                           image if isinstance(image, list) else [image])
    # a string content sits beside content parts: it reads as one text part
    assert got[1]["messages"][0]["content"] == [
        {"type": "text", "text": "No image here.", "image_url": None}]


def test_rerun_resumes_and_the_manifest_names_the_image_column(jsonl_job, vl_model, tmp_path):
    from ray_jobs.dispatch.driver import _job_settings
    from ray_jobs.input.io import scan_input
    from ray_jobs.output.manifest import MANIFEST_NAME
    from ray_jobs.preparation.prepare import plan_columns
    from ray_jobs.workers.options import JobOptions

    rows, path, out, _ = jsonl_job
    again = run_batch_job(path, out, model=str(vl_model), **JOB)
    assert again.rows == 0 and again.rows_resumed == len(rows)
    settings = json.loads((out / MANIFEST_NAME).read_text())["settings"]
    assert settings["columns"]["image_column"] == "image"
    text = tmp_path / "text.jsonl"  # a text job's settings are what they were before images
    text.write_text(json.dumps({"prompt": "hi"}) + "\n")
    info = scan_input(text)
    columns = _job_settings(JobOptions(reasoning_parser="none"), info, vl_model,
                            plan_columns(info.schema))["columns"]
    assert columns == {"prompt_column": None, "id_column": None}


# --- Parquet with image bytes; the Ray Data processor on the same rows ---------------------


@pytest.fixture(scope="module")
def parquet_rows(tmp_path_factory, pictures):
    parts = pa.list_(pa.struct([("type", pa.string()), ("text", pa.string()),
                                ("image", pa.binary())]))
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("image", pa.binary()),
                        ("messages", pa.list_(pa.struct([("role", pa.string()),
                                                         ("content", parts)])))])
    rows = [
        {"id": 0, "prompt": "Describe.", "image": pictures["a.png"].read_bytes()},
        {"id": 1, "prompt": "Plain text."},
        {"id": 2, "prompt": "Again.", "image": _png(98, 70, 11)},
        {"id": 3, "messages": [{"role": "user", "content": [
            {"type": "image", "image": pictures["rotated.jpg"].read_bytes()},
            {"type": "text", "text": "Which way up?"}]}]},
        {"id": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "Only "},
                                                             {"type": "text", "text": "text."}]}]},
        {"id": 5, "prompt": "Broken.", "image": b"\x89PNG\r\n\x1a\n not really"},
    ]
    path = tmp_path_factory.mktemp("vl-parquet") / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    # the oracle's view: the same rows, a text-only content as its joined text
    oracle = {r["id"]: dict(r) for r in rows}
    oracle[4]["messages"] = [{"role": "user", "content": "Only text."}]
    oracle[3]["messages"] = _user(_image(pictures["rotated.jpg"].read_bytes()),
                                  _text("Which way up?"))
    return path, oracle


def test_parquet_image_bytes_are_read_and_not_repeated(parquet_rows, vl_model, hf_vl,
                                                       ray_session, tmp_path):
    path, oracle = parquet_rows
    run_batch_job(path, tmp_path / "out", model=str(vl_model), **JOB)
    table = ds.dataset(tmp_path / "out").to_table()
    assert "image" not in table.column_names  # bytes: not copied into every part
    assert "prompt" in table.column_names and "messages" in table.column_names
    got = table.to_pylist()
    bad = [r for r in got if r["id"] == 5]
    assert bad[0]["finish_reason"] == "error" and "does not decode" in bad[0]["error"]
    _assert_rows_equal_oracle([r for r in got if r["id"] != 5], oracle, hf_vl)


def test_ray_data_processor_answers_the_same_rows(parquet_rows, vl_model, hf_vl, ray_session):
    from ray_jobs.data_processor import build_processor

    path, oracle = parquet_rows
    process = build_processor(str(vl_model), concurrency=1, num_gpus=0, batch_size=8,
                              kv_cache_bytes=KV_BYTES, max_tokens=NEW, ignore_eos=True)
    got = process(ray_session.data.read_parquet(str(path))).take_all()
    assert sorted(r["id"] for r in got) == list(range(6))
    by_id = {r["id"]: r for r in got}
    assert by_id[5]["finish_reason"] == "error" and "does not decode" in by_id[5]["error"]
    assert by_id[0]["image"] == oracle[0]["image"]  # Ray Data: the input columns unchanged
    _assert_rows_equal_oracle([r for r in got if r["id"] != 5], oracle, hf_vl)


# --- OpenAI Batch API request files with image parts ---------------------------------------


def test_openai_request_file_with_image_parts(vl_model, hf_vl, pictures, ray_session,
                                              tmp_path):
    chat = "/v1/chat/completions"

    def req(custom_id, messages, **body):
        return {"custom_id": custom_id, "method": "POST", "url": chat,
                "body": {"model": "qwen2.5-vl", "messages": messages, "max_tokens": NEW,
                         "temperature": 0, "ignore_eos": True, **body}}

    image = {"type": "image_url", "image_url": {"url": _url(_png(84, 56, 21)), "detail": "auto"}}
    by_path = {"type": "image_url", "image_url": {"url": str(pictures["b.png"])}}
    lines = [req("img", [{"role": "user", "content": [image, _text("Caption it.")]}]),
             req("text", [{"role": "user", "content": "Just text."}]),
             req("two", [{"role": "user", "content": [_text("Both: "), by_path, image]}]),
             req("high", [{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": str(pictures["a.png"]),
                                                     "detail": "high"}}]}])]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch_job(path, tmp_path / "out", model=str(vl_model), **JOB)
    output = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out" / "output.jsonl")
                                             .read_text().splitlines())}
    errors = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert list(output) == ["img", "text", "two"]
    plain = {"img": _user(_image(base64.b64decode(image["image_url"]["url"].split(",")[1])),
                          _text("Caption it.")),
             "text": [{"role": "user", "content": "Just text."}],
             "two": _user(_text("Both: "), _image(str(pictures["b.png"])),
                          _image(base64.b64decode(image["image_url"]["url"].split(",")[1])))}
    texts = set()
    tok = hf_vl[1]
    for custom_id, messages in plain.items():
        want, num_prompt = _hf_answer(hf_vl, {"messages": messages})
        body = output[custom_id]["response"]["body"]
        text = tok.decode(want, skip_special_tokens=True)
        assert body["choices"][0]["message"]["content"] == text, custom_id
        assert body["usage"]["prompt_tokens"] == num_prompt, custom_id
        texts.add(text)
    assert len(texts) == 3
    assert [e["custom_id"] for e in errors] == ["high"]
    assert "'detail'" in errors[0]["response"]["body"]["error"]["message"]


# --- reading and preparing rows, no Ray ----------------------------------------------------


def test_a_text_model_makes_image_rows_error_rows(tiny_job_model, pictures):
    from nanoserve.weights.tokenizer import Tokenizer
    from ray_jobs.input.files import InputChunk
    from ray_jobs.preparation.prepare import RowPreparer, plan_columns

    batch = pa.RecordBatch.from_pylist([
        {"prompt": "With a picture.", "image": str(pictures["a.png"])},
        {"prompt": "Without.", "image": None}])
    tok = Tokenizer.from_path(tiny_job_model)
    preparer = RowPreparer(plan_columns(batch.schema), tok, 256, 49152, {"max_tokens": 4})
    rows = preparer.prepare(InputChunk(batch, None), 0)
    assert "the model takes none" in rows[0].error
    assert rows[1].error is None and rows[1].prompt_token_ids == tuple(tok.encode("Without."))


def test_image_column_types(tmp_path):
    from nanoserve.errors import InputError
    from ray_jobs.preparation.prepare import plan_columns

    for typ, copied in [(pa.string(), True), (pa.list_(pa.string()), True),
                        (pa.binary(), False), (pa.list_(pa.large_binary()), False),
                        (pa.struct([("bytes", pa.binary()), ("path", pa.string())]), False)]:
        plan = plan_columns(pa.schema([("prompt", pa.string()), ("image", typ)]))
        assert plan.image_column == "image"
        assert ("image" in [f.name for f in plan.passthrough_fields()]) == copied, typ
    with pytest.raises(InputError, match="column 'image' holds each row's images"):
        plan_columns(pa.schema([("prompt", pa.string()), ("image", pa.int64())]))
    assert plan_columns(pa.schema([("prompt", pa.string()), ("image", pa.null())])).image_column \
        is None


def test_the_driver_makes_error_rows_without_reading_images(vl_model, pictures, tmp_path):
    """The driver's walk for rows it makes error rows of (a task that raised, a row that
    killed its worker) does not read their images: a missing file does not show."""
    from ray_jobs.input.io import scan_input
    from ray_jobs.input.shards import InputSpec, iter_shards, read_shard
    from ray_jobs.input.storage import OutputDir
    from ray_jobs.preparation.prepare import load_model_meta, plan_columns
    from ray_jobs.preparation.row_images import ModelImages
    from ray_jobs.tasks.generate import GenerateTask
    from ray_jobs.workers.tasks import JobSpec, ShardRunner

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x", "image": str(tmp_path / "none.png")}) + "\n")
    info = scan_input(path)
    plan = plan_columns(info.schema)
    config, tok = load_model_meta(vl_model)
    spec = JobSpec("generate", InputSpec.of(info, 64), plan, plan.output_schema(),
                   OutputDir.open(tmp_path / "out"), (), {"defaults": {"max_tokens": 4}})
    task = GenerateTask(plan, spec.task_options, tok, config,
                        images=ModelImages.of(config, vl_model))
    (shard,) = iter_shards(info)
    out = ShardRunner(spec, task).run(shard, write=False, error="the worker died")
    assert out.table.column("error").to_pylist() == ["the worker died"]
    (chunk,) = read_shard(spec.input, shard)  # where the row runs, its image is read
    assert task.preparer.prepare(chunk, 0)[0].error.startswith("cannot read image")
