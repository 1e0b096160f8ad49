"""The batch job on a real multi-node Ray cluster (ray.cluster_utils.Cluster on this
machine; worker nodes with their own logical GPUs, run on the CPU): a job spread over two
nodes, a node lost mid-job (also the one holding the most batches), a node added mid-job,
a node lost while its worker loads the model (at the start, and a joining worker's), a job
that waits for its first GPU node. Also where the output may go (`placement`).

The cluster and its jobs run in one process of their own (tests/multinode_cluster.py, one
cluster for all scenarios, nodes added and removed between them); each test reads what its
scenario left. Oracle: every row of every job exactly once, each equal to `LLM.generate` on
its prompt alone (same model files, greedy), the prompt tokenized here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from nanoserve.errors import NanoserveError
from nanoserve.testing import assert_rows_match_engine
from ray_jobs.cli import main as batch_main
from ray_jobs.workers.options import WorkerRange, parse_num_workers

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("multinode_cluster.py")
MAX_TOKENS = 3  # as in the script
SCRIPT_LIMIT_S = 900


@pytest.fixture(scope="module")
def scenarios(tiny_job_model, tmp_path_factory):
    """Run every scenario once, on one cluster; returns the results folder."""
    results = tmp_path_factory.mktemp("multinode")
    log = results / "cluster.log"
    with open(log, "w") as out:
        # Its own session: on a timeout the script and every Ray process it started go.
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tiny_job_model), str(results)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)},
                                start_new_session=True)
        try:
            proc.wait(timeout=SCRIPT_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-6000:]
    return results


def result(results: Path, name: str) -> dict:
    path = results / name / "result.json"
    assert path.exists(), f"scenario {name} did not run"
    record = json.loads(path.read_text())
    return record


def finished(results: Path, name: str) -> dict:
    record = result(results, name)
    assert "error" not in record, record.get("traceback", record.get("error"))
    return record


def assert_every_row_once_and_right(llm, results: Path, name: str) -> None:
    prompts = [json.loads(line)["prompt"]
               for line in (results / name / "in.jsonl").read_text().splitlines()]
    rows = ds.dataset(results / name / "out").to_table().to_pylist()
    assert_rows_match_engine(llm, prompts, rows, MAX_TOKENS)


def test_a_job_spreads_over_two_worker_nodes(scenarios, tiny_llm):
    record = finished(scenarios, "spread")
    workers = record["summary"]["workers"]
    assert len(workers) == 2
    assert {w["node_id"] for w in workers} == set(record["nodes"].values())
    assert all(w["spans"] >= 1 for w in workers)
    assert record["summary"]["nodes_lost"] == []
    assert_every_row_once_and_right(tiny_llm, scenarios, "spread")


def _assert_node_lost(record, lost_workers):
    removed = record["removed"]
    node = removed["node_id"]
    summary = record["summary"]
    assert sorted(removed["workers_there"]) == lost_workers
    (line,) = summary["nodes_lost"]
    assert line.startswith(f"node {node[:12]} (127.0.0.1, worker")
    assert f"nodes lost: 1 ({line})" in summary["format"]
    logged = [ln for ln in record["stderr"] if f"node {node[:12]}" in ln and "was lost" in ln]
    assert len(logged) == len(lost_workers), record["stderr"]
    assert summary["error_rows"] == 0
    by_index = {w["index"]: w for w in summary["workers"]}
    for i in lost_workers:
        assert by_index[i]["node_id"] == node
    survivors = [w for w in summary["workers"] if w["node_id"] != node]
    assert survivors and all(w["spans"] >= 1 for w in survivors)


def test_a_node_lost_mid_job_its_batches_run_again_elsewhere(scenarios, tiny_llm):
    """Both workers hold two batches when one worker's node is killed (raylet and
    workers): its two batches run again on the other node's worker; the job finishes; the
    summary and a log line name the node."""
    record = finished(scenarios, "node_lost")
    assert record["removed"]["in_flight"] == {"0": 2, "1": 2}
    _assert_node_lost(record, [int(i) for i in record["removed"]["workers_there"]])
    assert len(record["removed"]["workers_there"]) == 1
    assert_every_row_once_and_right(tiny_llm, scenarios, "node_lost")


def test_losing_the_node_with_the_most_batches_in_flight(scenarios, tiny_llm):
    """A two-GPU node (two workers, four batches in flight) and a one-GPU node (two
    batches): the two-GPU node is killed; all six held batches end, four of them lost with
    the node, and run again on the one worker left."""
    record = finished(scenarios, "busiest_node_lost")
    removed = record["removed"]
    assert removed["node_id"] == record["nodes"]["c"]
    assert sorted(removed["in_flight"].values()) == [2, 2, 2]
    _assert_node_lost(record, sorted(removed["workers_there"]))
    assert len(removed["workers_there"]) == 2
    assert_every_row_once_and_right(tiny_llm, scenarios, "busiest_node_lost")


def test_a_node_added_mid_job_is_used(scenarios, tiny_llm):
    """`--num-workers 1-2` on a cluster with one GPU node: the job starts one worker; a
    second GPU node joins while the first batches run; a worker starts there, joins the
    pool and is given batches."""
    record = finished(scenarios, "node_added")
    workers = record["summary"]["workers"]
    assert len(workers) == 2
    assert workers[0]["node_id"] == record["nodes"]["first"]
    assert workers[1]["node_id"] == record["nodes"]["d"]
    assert workers[1]["spans"] >= 1
    assert any(re.match(r"nanoserve: worker 1 joined on node " + record["nodes"]["d"][:12], ln)
               for ln in record["stderr"]), record["stderr"]
    assert_every_row_once_and_right(tiny_llm, scenarios, "node_added")


def _assert_one_load_death(record, who: str) -> int:
    """The one line saying `who` died while loading and is replaced; its worker index."""
    assert "remover_error" not in record, record["remover_error"]
    assert "removed" in record, "no node was removed while a worker loaded"
    died = [re.match(rf"nanoserve: {who} died while loading the model \((.*)\); replacing "
                     rf"it \(restart 1 of at most 8\)$", ln) for ln in record["stderr"]]
    died = [m for m in died if m]
    assert len(died) == 1, record["stderr"]
    assert died[0].group(2) in ("its node has died", "its worker process has died"), died[0]
    return int(died[0].group(1))


def test_a_node_lost_while_its_worker_loads_the_model(scenarios, tiny_llm):
    """Two one-GPU nodes, both workers held in their constructor; one node is killed. That
    worker is replaced, with one line (the replacement waits for a GPU and holds nothing
    up); the job runs on the other node's worker: every row once, equal to the engine."""
    record = finished(scenarios, "node_lost_while_loading")
    index = _assert_one_load_death(record, r"worker (\d)")
    summary = record["summary"]
    assert summary["error_rows"] == 0 and summary["rows"] == 8
    workers = summary["workers"]
    assert len(workers) == 2
    assert workers[index]["restarts"] == 1 and workers[index]["spans"] == 0
    (other,) = [w for w in workers if w["index"] != index]
    assert other["node_id"] in record["nodes"].values()
    assert other["node_id"] != record["removed"]["node_id"]
    assert other["spans"] == 4
    assert "recovered: 1 worker restart(s)" in summary["format"]
    assert not any(ln.startswith("error") or "could not load" in ln for ln in record["stderr"])
    assert_every_row_once_and_right(tiny_llm, scenarios, "node_lost_while_loading")


def test_a_joining_workers_node_lost_while_it_loads(scenarios, tiny_llm):
    """`--num-workers 1-2`: a GPU node joins mid-job and its node is killed while the
    worker started there loads the model. That worker is replaced (a slot of its own, one
    line); the job completes on the first worker: every row once, equal to the engine."""
    record = finished(scenarios, "joiner_lost_while_loading")
    assert record["removed"]["node_id"] == record["nodes"]["joined"]
    index = _assert_one_load_death(record, r"a joining worker \(worker (\d)\)")
    summary = record["summary"]
    assert summary["error_rows"] == 0 and summary["rows"] == 8
    workers = summary["workers"]
    assert index == 1 and len(workers) == 2
    assert workers[0]["node_id"] == record["nodes"]["first"] and workers[0]["spans"] == 4
    assert workers[1]["restarts"] == 1 and workers[1]["spans"] == 0
    assert_every_row_once_and_right(tiny_llm, scenarios, "joiner_lost_while_loading")


def test_no_gpu_node_waits_then_fails_with_a_message(scenarios):
    """`auto` on a cluster without a GPU: it says it waits, waits the stated timeout, then
    stops with one message; nothing ran on the CPU, nothing was written."""
    record = result(scenarios, "no_gpu_timeout")
    assert record["error"].startswith("NanoserveError: --num-workers auto: the cluster had 0 "
                                      "GPU(s), fewer than 1, after waiting 3 s")
    assert any("waiting up to 3 s for GPU nodes to join" in ln for ln in record["stderr"])
    assert not list((scenarios / "no_gpu_timeout" / "out").glob("part-*"))


def test_a_gpu_node_that_joins_while_the_job_waits_runs_it(scenarios, tiny_llm):
    record = finished(scenarios, "gpu_joins_while_waiting")
    assert any("waiting up to 300 s" in ln for ln in record["stderr"])
    (worker,) = record["summary"]["workers"]
    assert worker["node_id"] == record["nodes"]["e"] and worker["gpu_ids"]
    assert_every_row_once_and_right(tiny_llm, scenarios, "gpu_joins_while_waiting")


# --- --num-workers and the output folder: checked before Ray (no cluster needed) ----------


@pytest.mark.parametrize("value, want", [
    (None, None), (3, WorkerRange(3, 3, False)), ("2", WorkerRange(2, 2, False)),
    ("auto", WorkerRange(1, None, True)), ("1-4", WorkerRange(1, 4, True)),
    ("2-", WorkerRange(2, None, True)),
])
def test_num_workers_values(value, want):
    assert parse_num_workers(value) == want


@pytest.mark.parametrize("value", ["0", "3-1", "0-2", "many", "1-2-3"])
def test_bad_num_workers_is_refused(value):
    with pytest.raises(NanoserveError, match="num_workers"):
        parse_num_workers(value)


def test_output_inside_rays_job_working_dir_is_refused_before_work(tmp_path, capsys, no_ray,
                                                                   monkeypatch):
    """Under `ray job submit --working-dir .` a relative `-o out` lands in Ray's unpacked
    copy of the working dir, deleted after the job: refused before Ray, nothing created."""
    work = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    work.mkdir(parents=True)
    (work / "in.jsonl").write_text('{"prompt": "hi"}\n')
    monkeypatch.chdir(work)
    rc = batch_main(["in.jsonl", "-o", "out", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: output folder out is ") and "Ray deletes" in err[0]
    assert not (work / "out").exists()


def test_output_that_cannot_be_created_where_the_driver_runs_is_refused(tmp_path, capsys,
                                                                        no_ray):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "afile").write_text("")
    rc = batch_main([str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "afile" / "out"),
                     "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert re.match(r"error: output folder .*afile/out cannot be written from .*, where the "
                    r"driver runs and writes every part: .*afile is not a folder", err[0]), err
