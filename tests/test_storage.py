"""The batch job on object storage: a real S3 API server (moto's, on 127.0.0.1: the
`s3` fixture of tests/conftest.py) serves `s3://` input and output through pyarrow's own S3
client and boto3, with credentials and endpoint from the standard AWS environment
(`AWS_ENDPOINT_URL`).

Oracles: the same job on local files (the output rows must be equal, id for id, column for
column); the engine alone (`LLM.generate`) for rows written after a failure; the lock is
held to its contract by racing conditional writes against the server itself.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from conftest import S3_SECRET as SECRET  # must never appear in any output or message

from nanoserve.errors import InputError, NanoserveError
from nanoserve.testing import assert_rows_match_engine
from ray_jobs import run_batch_job
from ray_jobs.cli import main as batch_main
from ray_jobs.input.io import iter_chunks, scan_input
from ray_jobs.input.storage import (
    LOCK_NAME,
    LockHeld,
    ObjectLease,
    OutputDir,
    _S3Conditional,
    resolve,
)
from ray_jobs.output.manifest import MANIFEST_NAME, SUCCESS_NAME

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 2
LIMIT_S = 300


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3):
    name = f"nanoserve-test-{next(_buckets)}"
    s3.create_bucket(Bucket=name)
    return name


def put(s3, bucket, key, data: bytes):
    s3.put_object(Bucket=bucket, Key=key, Body=data)


def keys(s3, bucket, prefix=""):
    r = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", []))


def etags(s3, bucket, prefix):
    r = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for o in r.get("Contents", []) if "/part-" in o["Key"]}


def s3_rows(uri):
    loc = resolve(uri)
    return ds.dataset(loc.path, filesystem=loc.fs, format="parquet").to_table()


def prompts_of(n):
    return [f"Row {i} says: {'ab' * (i % 7)} {i * 13}" for i in range(n)]


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def job_options(tiny_job_model, **extra):
    return {"model": str(tiny_job_model), "max_tokens": MAX_TOKENS, "batch_size": 2,
            "kv_cache_bytes": 32 << 20, "progress": False, **extra}


def assert_rows_match_oracle(llm, prompts, rows):
    assert_rows_match_engine(llm, prompts, rows, MAX_TOKENS)


def sorted_by_id(table):
    return table.sort_by("id").to_pylist()


# --- end to end: s3 in, s3 out, equal to the local run ---------------------------------------


def test_s3_job_equals_the_local_run(s3, bucket, ray_session, tiny_job_model, tmp_path, capsys):
    """A partitioned input (a gzipped JSON Lines file under lang=en/, a Parquet file under
    lang=fr/, Spark's _SUCCESS and a hidden file that must be skipped) read from s3:// and
    written to s3://, against the same files on the local disk: equal rows, the same
    columns and types; no credential in the output, the manifest or the messages."""
    en = [{"id": i, "prompt": p} for i, p in enumerate(prompts_of(5))]
    fr = pa.table({"id": pa.array(range(5, 9), pa.int64()),
                   "prompt": pa.array(prompts_of(9)[5:], pa.large_string())})
    files = {"lang=en/part-0.jsonl.gz": gzip.compress(jsonl(en)),
             "lang=fr/part-0.parquet": _parquet_bytes(fr),
             "_SUCCESS": b"", "lang=fr/.part-0.parquet.crc": b"junk"}
    local_in = tmp_path / "in"
    for key, data in files.items():
        put(s3, bucket, f"prompts/{key}", data)
        (local_in / key).parent.mkdir(parents=True, exist_ok=True)
        (local_in / key).write_bytes(data)

    options = job_options(tiny_job_model)
    summary = run_batch_job(f"s3://{bucket}/prompts/", f"s3://{bucket}/out", **options)
    assert summary.rows == 9 and summary.error_rows == 0
    assert summary.output_dir == f"s3://{bucket}/out"
    run_batch_job(local_in, tmp_path / "out", **options)

    remote = s3_rows(f"s3://{bucket}/out")
    local = ds.dataset(tmp_path / "out", format="parquet").to_table()
    assert remote.schema == local.schema
    assert remote.schema.field("lang").type == pa.string()  # the hive key, passed through
    assert sorted_by_id(remote) == sorted_by_id(local)
    assert {r["lang"] for r in remote.to_pylist() if r["id"] < 5} == {"en"}
    out_keys = keys(s3, bucket, "out/")
    assert f"out/{SUCCESS_NAME}" in out_keys and f"out/{LOCK_NAME}" not in out_keys
    manifest = s3.get_object(Bucket=bucket, Key=f"out/{MANIFEST_NAME}")["Body"].read().decode()
    assert json.loads(manifest)["complete"] is True
    for key in out_keys:
        assert SECRET.encode() not in s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err

    # a rerun resumes (nothing to do); --overwrite with other settings replaces the output
    again = run_batch_job(f"s3://{bucket}/prompts/", f"s3://{bucket}/out", **options)
    assert (again.rows, again.rows_resumed) == (0, 9)
    with pytest.raises(InputError, match=r"other settings \(sampling.max_tokens differ\)"):
        run_batch_job(f"s3://{bucket}/prompts/", f"s3://{bucket}/out",
                      **{**options, "max_tokens": 1})
    fresh = run_batch_job(f"s3://{bucket}/prompts/", f"s3://{bucket}/out",
                          **{**options, "max_tokens": 1, "overwrite": True})
    assert fresh.rows == 9
    assert all(len(r["generated_token_ids"]) <= 1 for r in s3_rows(f"s3://{bucket}/out").to_pylist())


def _parquet_bytes(table):
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


# --- a driver SIGKILLed mid-job, resumed -------------------------------------------------------


def test_s3_driver_sigkilled_mid_job_resumes_with_nothing_lost_or_duplicated(
        s3, bucket, tiny_job_model, tiny_llm, tmp_path, request):
    """The real command, s3 in and out, SIGKILLed with its process group once parts are
    written; its lease object is left behind. The same command again takes the lease over
    at once (its owner is a dead process of this machine), keeps every part written before
    (same ETag), and ends with every row exactly once, equal to the engine's output."""
    prompts = prompts_of(60)
    put(s3, bucket, "in/prompts.jsonl.zst", _zstd(jsonl([{"prompt": p} for p in prompts])))
    ray_tmp = tempfile.mkdtemp(prefix="ns-t-")
    request.addfinalizer(lambda: shutil.rmtree(ray_tmp, ignore_errors=True))
    env = {**os.environ, "TMPDIR": ray_tmp, "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "nanoserve_cli", "batch", f"s3://{bucket}/in/",
               "-o", f"s3://{bucket}/out", "--model", str(tiny_job_model), "--batch-size", "2",
               "--max-tokens", str(MAX_TOKENS), "--address", "local", "--no-progress"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + LIMIT_S
            while len(etags(s3, bucket, "out/")) < 2:
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no part written in time"
                time.sleep(0.05)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    before = etags(s3, bucket, "out/")
    assert f"out/{LOCK_NAME}" in keys(s3, bucket, "out/")  # the dead driver's lease
    assert f"out/{SUCCESS_NAME}" not in keys(s3, bucket, "out/"), "the job ended before the kill"

    again = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=LIMIT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done by an earlier run" in again.stdout, again.stdout
    assert SECRET not in again.stdout + again.stderr
    after = etags(s3, bucket, "out/")
    recorded = json.loads(s3.get_object(Bucket=bucket, Key=f"out/{MANIFEST_NAME}")["Body"].read())
    for key, tag in before.items():
        if int(key.rsplit("-", 1)[1].split(".")[0]) in {
                i for a, b in recorded["done_batches"] for i in range(a, b + 1)}:
            assert after[key] == tag, f"{key} was rewritten"
    rows = s3_rows(f"s3://{bucket}/out").to_pylist()
    assert len(rows) == len(prompts)
    assert_rows_match_oracle(tiny_llm, prompts, rows)
    assert f"out/{LOCK_NAME}" not in keys(s3, bucket, "out/")


def _zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as f:
        f.write(data)
    return sink.getvalue().to_pybytes()


# --- a worker killed; error rows retried --------------------------------------------------------


def test_s3_worker_killed_then_retry_errors(s3, bucket, ray_session, tiny_job_model, tiny_llm,
                                           monkeypatch):
    """A row that kills its worker every time (the worker's testing hook) becomes an error
    row in the s3 output, every other row is answered; a rerun with --retry-errors once the
    cause is gone computes that batch again and replaces its part, keeping the others."""
    prompts = prompts_of(6)
    prompts[3] = "This POISON row kills its worker"
    put(s3, bucket, "in/p.jsonl", jsonl([{"prompt": p} for p in prompts]))
    src, out = f"s3://{bucket}/in/p.jsonl", f"s3://{bucket}/out"
    monkeypatch.setenv("NANOSERVE_FAULT_KILL_ON_TEXT", "POISON")
    first = run_batch_job(src, out, **job_options(tiny_job_model))
    assert first.rows == 6 and first.error_rows == 1 and first.worker_restarts >= 3
    rows = s3_rows(out).to_pylist()
    assert sorted(r["id"] for r in rows) == list(range(6))
    (bad,) = [r for r in rows if r["error"] is not None]
    assert bad["id"] == 3 and "the worker died while processing this row" in bad["error"]
    before = etags(s3, bucket, "out/")

    monkeypatch.delenv("NANOSERVE_FAULT_KILL_ON_TEXT")
    again = run_batch_job(src, out, **job_options(tiny_job_model, retry_errors=True))
    assert (again.rows, again.error_rows, again.rows_resumed) == (2, 0, 4)
    after = etags(s3, bucket, "out/")
    assert sum(before[k] != after[k] for k in before) == 1  # only the retried part changed
    assert_rows_match_oracle(tiny_llm, prompts, s3_rows(out).to_pylist())


def test_image_uris_are_read_from_the_store_by_the_workers(s3, bucket, ray_session, tmp_path):
    """Rows whose images are s3:// URIs (an `image` column, an image_url part): the workers
    read them with the job's credentials and endpoint; each row equals transformers'
    `generate` on the same image's bytes; a key that is not there is an error row naming it."""
    import io

    import numpy as np
    import torch
    from hf_oracle import qwen2_5_vl_generate
    from PIL import Image
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    from nanoserve.testing import save_tiny_qwen2_5_vl

    pictures = []
    for seed, (w, h) in enumerate([(84, 56), (56, 112)]):
        buf = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "PNG")
        pictures.append(buf.getvalue())
        put(s3, bucket, f"images/{seed}.png", buf.getvalue())
    rows = [{"id": 0, "prompt": "Describe.", "image": f"s3://{bucket}/images/0.png"},
            {"id": 1, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"s3://{bucket}/images/1.png"}},
                {"type": "text", "text": "And this?"}]}]},
            {"id": 2, "prompt": "Gone.", "image": f"s3://{bucket}/images/none.png"}]
    (tmp_path / "rows.jsonl").write_bytes(jsonl(rows))
    model = save_tiny_qwen2_5_vl(tmp_path / "vl", weight_scale=10.0)
    run_batch_job(tmp_path / "rows.jsonl", tmp_path / "out", model=str(model),
                  max_tokens=MAX_TOKENS + 4, ignore_eos=True, kv_cache_bytes=8 << 20,
                  progress=False)
    got = {r["id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    tok, proc = AutoTokenizer.from_pretrained(model), AutoImageProcessor.from_pretrained(model)
    for i, text in [(0, "Describe."), (1, "And this?")]:
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        want, num_prompt = qwen2_5_vl_generate(hf, tok, proc, ids["input_ids"],
                                               [Image.open(io.BytesIO(pictures[i]))],
                                               MAX_TOKENS + 4)
        assert got[i]["error"] is None and list(got[i]["generated_token_ids"]) == want
        assert got[i]["num_input_tokens"] == num_prompt
    assert got[0]["generated_token_ids"] != got[1]["generated_token_ids"]
    assert got[2]["error"].startswith(f"cannot read image s3://{bucket}/images/none.png")


# --- one clear line: missing bucket, bad credentials, a second job --------------------------


def test_missing_bucket_is_one_line(s3, bucket, no_ray, capsys):
    put(s3, bucket, "in.jsonl", jsonl([{"prompt": "hi"}]))
    for argv, want in [
        (["s3://no-such-bucket-x/in.jsonl", "-o", f"s3://{bucket}/out"],
         "error: s3://no-such-bucket-x/in.jsonl: the bucket 'no-such-bucket-x' does not exist"),
        ([f"s3://{bucket}/in.jsonl", "-o", "s3://no-such-bucket-y/out"],
         "error: s3://no-such-bucket-y/out: the bucket 'no-such-bucket-y' does not exist"),
    ]:
        assert batch_main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [want], err
    assert keys(s3, bucket, "out") == []


def test_bad_credentials_are_one_line(tmp_path):
    """A second S3 server that checks credentials (moto's IAM mode: no key is known): the
    job exits 2 with one line that says access was denied, and never prints the secret."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0", "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from moto.server import ThreadedMotoServer as T;"
         f"s=T(ip_address='127.0.0.1', port={port}, verbose=False); s.start(); "
         "print('up', flush=True); sys.stdin.read()"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        job_env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ACCESS_KEY_ID": "AKIAWRONGKEY",
                   "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                   "AWS_EC2_METADATA_DISABLED": "true"}
        r = subprocess.run([sys.executable, "-m", "nanoserve_cli", "batch",
                            "s3://some-bucket/in.jsonl", "-o", str(tmp_path / "out")],
                           env=job_env, capture_output=True, text=True, timeout=120)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(err) == 1 and err[0].startswith("error: s3://some-bucket/in.jsonl: access "
                                               "denied by the store"), err
    assert "Traceback" not in r.stderr and SECRET not in r.stdout + r.stderr


def test_second_job_on_one_prefix_is_refused(s3, bucket, tiny_job_model, no_ray, capsys):
    """A job holding s3://.../out (its lease, taken as the driver takes it): a second job on
    the same prefix is refused before it reads, writes or deletes anything there."""
    put(s3, bucket, "in.jsonl", jsonl([{"prompt": "hi"}]))
    put(s3, bucket, "out/part-00007.parquet", b"not ours to touch")
    lease = ObjectLease(OutputDir.open(f"s3://{bucket}/out"), lease_s=60)
    lease.acquire()
    try:
        rc = batch_main([f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out", "--model",
                         str(tiny_job_model), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: another nanoserve job (pid {os.getpid()} on "), err
        assert f"is writing to output s3://{bucket}/out" in err[0]
        assert keys(s3, bucket, "out/") == ["out/_nanoserve.lock", "out/part-00007.parquet"]
    finally:
        lease.release()
    assert keys(s3, bucket, "out/") == ["out/part-00007.parquet"]


# --- the lease itself, against the server's conditional writes ---------------------------------


def test_conditional_writes_let_exactly_one_of_two_racers_win(s3, bucket):
    """The primitive the lease stands on: of two creates, one wins; of two replaces of the
    same version read, one wins; a delete of a version no longer there changes nothing."""
    a = _S3Conditional(resolve(f"s3://{bucket}/out/{LOCK_NAME}"))
    b = _S3Conditional(resolve(f"s3://{bucket}/out/{LOCK_NAME}"))
    first = a.create(b"a")
    with pytest.raises(LockHeld):
        b.create(b"b")
    seen_a, seen_b = a.read(), b.read()
    assert seen_a == seen_b == first
    a.replace(seen_a, b"a2")
    with pytest.raises(LockHeld):
        b.replace(seen_b, b"b2")
    b.delete(seen_b)  # stale version: no effect
    assert a.read().body == b"a2"


def test_stale_lease_is_taken_over_and_its_old_holder_stops_writing(s3, bucket):
    """A lease past its expiry is taken over by the next job; the old holder, resuming
    (a paused process), sees it lost and refuses to write: it never overwrites the new
    holder's manifest or parts."""
    out_a, out_b = OutputDir.open(f"s3://{bucket}/out"), OutputDir.open(f"s3://{bucket}/out")
    a = ObjectLease(out_a, lease_s=60)
    a.acquire()
    a._stop.set()  # a paused holder: no more renewals
    a._thread.join()
    body = json.loads(a.version.body)
    body["expires"] = time.time() - 1  # what the store holds once its lease ran out
    a.version = a.backend.replace(a.version, json.dumps(body).encode())
    b = ObjectLease(out_b, lease_s=60)
    b.acquire()  # expired: taken over
    out_a.lease = a
    a.valid_until = 0.0  # its own clock says the lease must be renewed before a write
    with pytest.raises(NanoserveError, match="this job lost the lock"):
        out_a.write_bytes(MANIFEST_NAME, b"{}")
    assert not out_a.exists(MANIFEST_NAME)
    out_b.lease = b
    out_b.write_bytes(MANIFEST_NAME, b"{}")  # the new holder writes
    b.release()
    a.release()  # lost: leaves the lock object alone (there is none now either)
    assert keys(s3, bucket, "out/") == [f"out/{MANIFEST_NAME}"]


def test_fresh_lease_of_a_live_process_elsewhere_is_not_taken(s3, bucket):
    """A lease whose owner is on another machine (unknown if alive) and not expired holds."""
    out = OutputDir.open(f"s3://{bucket}/out")
    other = {"owner": "x", "host": "elsewhere", "boot_id": "other-boot", "pid": 1,
             "expires": time.time() + 600}
    put(s3, bucket, f"out/{LOCK_NAME}", json.dumps(other).encode())
    with pytest.raises(InputError, match=r"another nanoserve job \(pid 1 on elsewhere\)"):
        ObjectLease(out, lease_s=60).acquire()


# --- a filesystem pyarrow has no native client for: through fsspec -----------------------------


def test_fsspec_filesystem_input_and_lease():
    """`memory://` (fsspec's in-process filesystem; pyarrow has none): a gzipped JSON Lines
    tree reads as the same file on the local disk does, and the lease without conditional
    writes still refuses a second holder and is released."""
    import fsspec

    mem = fsspec.filesystem("memory")
    rows = [{"id": i, "prompt": f"row {i}"} for i in range(5)]
    with mem.open("/nanoserve-t/in/lang=en/a.jsonl.gz", "wb") as f:
        f.write(gzip.compress(jsonl(rows)))
    with mem.open("/nanoserve-t/in/_SUCCESS", "wb") as f:
        f.write(b"")
    info = scan_input("memory://nanoserve-t/in")
    assert [f.rel for f in info.files] == ["lang=en/a.jsonl.gz"]
    got = [r for c in iter_chunks(info) for r in c.batch.to_pylist()]
    assert got == [{**r, "lang": "en"} for r in rows]

    out = OutputDir.open("memory://nanoserve-t/out")
    first = ObjectLease(out, lease_s=60)
    first.acquire()
    with pytest.raises(InputError, match="another nanoserve job"):
        ObjectLease(OutputDir.open("memory://nanoserve-t/out"), lease_s=60).acquire()
    first.release()
    assert not out.exists(LOCK_NAME)
    mem.rm("/nanoserve-t", recursive=True)
