"""ray_jobs.output.manifest: fresh, resumed and refused output folders; identities by content."""

from __future__ import annotations

import hashlib
import json
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import ray_jobs.output.manifest as manifest_mod
from nanoserve.errors import InputError
from ray_jobs.output.manifest import (
    MANIFEST_NAME,
    SUCCESS_NAME,
    Manifest,
    file_fingerprint,
    input_identity,
    mark_complete,
    open_output_dir,
    part_name,
    reopen_shards_with_errors,
    settings_differences,
)

SETTINGS = {"model": {"files": [{"name": "m.gguf", "size": 3, "sha256": "ab"}], "dtype": "auto"},
            "sampling": {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]}}


def write_part(folder, batch_id):
    pq.write_table(pa.table({"id": [batch_id]}), folder / part_name(batch_id))


def write_result_part(folder, batch_id, errors):
    pq.write_table(pa.table({"id": list(range(len(errors))),
                             "error": pa.array(errors, type=pa.string())}),
                   folder / part_name(batch_id))


def test_retry_errors_reopens_exactly_the_parts_with_error_rows(tmp_path):
    out = tmp_path / "out"
    m = open_output_dir(out, SETTINGS, overwrite=False)
    write_result_part(out, 0, [None, None])  # clean: kept
    write_result_part(out, 1, [None, "too long", None])  # recorded, one error row
    write_result_part(out, 2, ["bad"])  # renamed into place, never recorded
    m.record(0, 2)
    m.record(1, 3)
    mark_complete(out, m)  # (removes unrecorded parts: put part 2 back, as if a later run)
    write_result_part(out, 2, ["bad"])

    assert reopen_shards_with_errors(out, m) == {1, 2}
    assert (m.done, m.rows_done, m.complete) == ({0}, 2, False)
    assert not (out / SUCCESS_NAME).exists()
    assert Manifest.load(out).to_json() == m.to_json()  # saved
    assert (out / part_name(1)).exists()  # kept until a new part replaces it
    assert reopen_shards_with_errors(out, m) == {1, 2}  # nothing recorded changes twice
    assert (m.done, m.rows_done) == ({0}, 2)


def test_retry_errors_leaves_a_clean_complete_folder_alone(tmp_path):
    out = tmp_path / "out"
    m = open_output_dir(out, SETTINGS, overwrite=False)
    write_result_part(out, 0, [None])
    m.record(0, 1)
    mark_complete(out, m)
    assert reopen_shards_with_errors(out, m) == set()
    assert m.complete and (out / SUCCESS_NAME).exists()


def test_fresh_folder_gets_a_manifest(tmp_path):
    out = tmp_path / "out"
    m = open_output_dir(out, SETTINGS, overwrite=False)
    assert m.done == set() and not m.complete
    saved = json.loads((out / MANIFEST_NAME).read_text())
    assert saved["settings"] == SETTINGS and saved["done_batches"] == []


def test_resume_keeps_done_batches_and_drops_unrecorded_parts(tmp_path):
    m = open_output_dir(tmp_path, SETTINGS, overwrite=False)
    for i in (0, 1, 2, 5):
        write_part(tmp_path, i)
        m.record(i, 10)
    m.save(tmp_path)
    write_part(tmp_path, 6)  # written, but the run stopped before recording it
    (tmp_path / f".{part_name(7)}.tmp-123").write_bytes(b"half")  # an interrupted write
    again = open_output_dir(tmp_path, SETTINGS, overwrite=False)
    assert again.done == {0, 1, 2, 5} and again.rows_done == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        MANIFEST_NAME, *(part_name(i) for i in (0, 1, 2, 5))]
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["done_batches"] == [[0, 2], [5, 5]]


def test_other_settings_are_refused_naming_what_differs(tmp_path):
    open_output_dir(tmp_path, SETTINGS, overwrite=False)
    other = {**SETTINGS, "sampling": {**SETTINGS["sampling"], "temperature": 0.7}}
    with pytest.raises(InputError, match=r"sampling\.temperature differ"):
        open_output_dir(tmp_path, other, overwrite=False)


def test_an_earlier_versions_window_setting_still_resumes(tmp_path):
    """A manifest that records the static engine's sort window (`batching.window_rows`, a
    setting that never changed the output rows, since removed) resumes under the job's
    settings without it; another batch size is still refused."""
    settings = {**SETTINGS, "batching": {"batch_size": 64, "max_batch_tokens": None}}
    old = {**settings, "batching": {**settings["batching"], "window_rows": 512}}
    m = open_output_dir(tmp_path, old, overwrite=False)
    write_part(tmp_path, 0)
    m.record(0, 1)
    m.save(tmp_path)
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["settings"] == old
    again = open_output_dir(tmp_path, settings, overwrite=False)
    assert again.done == {0} and again.settings == settings
    other = {**settings, "batching": {**settings["batching"], "batch_size": 32}}
    with pytest.raises(InputError, match=r"batching\.batch_size differ"):
        open_output_dir(tmp_path, other, overwrite=False)


def test_overwrite_replaces_an_earlier_output(tmp_path):
    m = open_output_dir(tmp_path, SETTINGS, overwrite=False)
    write_part(tmp_path, 0)
    m.record(0, 1)
    mark_complete(tmp_path, m)
    other = {**SETTINGS, "model": {**SETTINGS["model"], "dtype": "float32"}}
    fresh = open_output_dir(tmp_path, other, overwrite=True)
    assert fresh.done == set() and not fresh.complete
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]


def test_foreign_files_are_never_touched(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(InputError, match="did not write .*mine.txt"):
            open_output_dir(tmp_path, SETTINGS, overwrite=overwrite)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_parts_without_manifest_need_overwrite(tmp_path):
    write_part(tmp_path, 0)
    with pytest.raises(InputError, match="no _nanoserve_manifest.json"):
        open_output_dir(tmp_path, SETTINGS, overwrite=False)


def test_corrupt_manifest_is_an_input_error(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(InputError, match="not a readable nanoserve manifest"):
        open_output_dir(tmp_path, SETTINGS, overwrite=False)


def test_complete_marker_and_manifest_are_invisible_to_parquet_readers(tmp_path):
    m = open_output_dir(tmp_path, SETTINGS, overwrite=False)
    write_part(tmp_path, 0)
    write_part(tmp_path, 1)
    m.record(0, 1)
    m.record(1, 1)
    mark_complete(tmp_path, m)
    assert (tmp_path / SUCCESS_NAME).exists()
    assert Manifest.load(tmp_path).complete
    assert sorted(ds.dataset(tmp_path).to_table()["id"].to_pylist()) == [0, 1]


def test_manifest_round_trips(tmp_path):
    m = Manifest(SETTINGS, {3, 4, 9}, 30, False)
    m.save(tmp_path)
    back = Manifest.load(tmp_path)
    assert (back.settings, back.done, back.rows_done, back.complete) == (SETTINGS, {3, 4, 9}, 30, False)
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]  # no temporary left


def test_settings_differences_lists_dotted_keys():
    a = {"x": 1, "y": {"z": [1, 2], "w": None}}
    b = {"x": 1, "y": {"z": [1, 3]}, "v": 2}
    assert settings_differences(a, b) == ["v", "y.z"]


def test_fingerprint_is_content_not_mtime(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    data = os.urandom(5000)
    a.write_bytes(data)
    b.write_bytes(data)
    os.utime(b, (1, 1))
    fa, fb = file_fingerprint(a, "x"), file_fingerprint(b, "x")
    assert fa == fb == {"name": "x", "size": 5000, "sha256": hashlib.sha256(data).hexdigest()}


def test_large_files_hash_head_and_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_mod, "FULL_HASH_MAX_BYTES", 100)
    monkeypatch.setattr(manifest_mod, "SAMPLE_BYTES", 10)
    data = bytes(range(256))
    (tmp_path / "big").write_bytes(data)
    fp = file_fingerprint(tmp_path / "big")
    assert fp["sha256_head_tail"] == hashlib.sha256(data[:10] + data[-10:]).hexdigest()


def test_input_identity_names_files_relative_to_the_input(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    ident = input_identity(tmp_path, [tmp_path / "a.jsonl"])
    assert ident[0]["name"] == "a.jsonl"
    assert input_identity(tmp_path / "a.jsonl", [tmp_path / "a.jsonl"]) == ident


def test_a_part_is_adopted_only_with_the_files_committed_beside_it(tmp_path):
    """A part's footer names the bytes of the files written before it (an OpenAI job's
    fragments): adopted with exactly those; not when one is missing or holds another
    attempt's bytes (a retry killed between its fragments and its part), nor when the part
    names none (written without them)."""
    from ray_jobs.output.manifest import (
        BESIDE_DIGEST_KEY,
        PART_DIGEST_KEY,
        adopt_part,
        beside_digest,
    )

    out = tmp_path / "out"
    m = open_output_dir(out, SETTINGS, overwrite=False)
    beside = ("_output-00003.jsonl", "_errors-00003.jsonl")
    blobs = [b'{"custom_id": "a"}\n', b""]
    for name, data in zip(beside, blobs):
        (out / name).write_bytes(data)

    def write(meta):
        pq.write_table(pa.table({"id": [1, 2]}).replace_schema_metadata(meta),
                       out / part_name(3))

    write({PART_DIGEST_KEY: b"d3"})  # no digest of the files beside it
    assert not adopt_part(out, m, 3, "d3", beside=beside)
    write({PART_DIGEST_KEY: b"d3", BESIDE_DIGEST_KEY: beside_digest(blobs).encode()})
    (out / beside[0]).write_bytes(b'{"custom_id": "b"}\n')  # another attempt's lines
    assert not adopt_part(out, m, 3, "d3", beside=beside)
    (out / beside[0]).unlink()
    assert not adopt_part(out, m, 3, "d3", beside=beside)
    (out / beside[0]).write_bytes(blobs[0])
    assert not adopt_part(out, m, 3, "other", beside=beside)
    assert adopt_part(out, m, 3, "d3", beside=beside)
    assert (m.done, m.rows_done) == ({3}, 2)
    assert open_output_dir(out, SETTINGS, overwrite=False).done == {3}  # fragments are ours
