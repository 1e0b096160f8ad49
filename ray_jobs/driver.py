"""The batch job's driver: read, tokenize, batch, dispatch to Ray workers, collect, write.

    summary = run_batch_job("prompts.jsonl", "out/", max_tokens=64)

Order of work (every job-level check comes before any model loads on a worker):
1. scan the input (files, schema, row count) and plan its columns;
2. resolve the model and load its tokenizer and config on the driver (cheap: no weights);
3. open the output folder: fresh, or resume an earlier run with equal settings;
4. start (or join) Ray and one `BatchWorker` actor per GPU (one CPU worker without GPUs);
5. stream the rows: tokenize a chunk at a time, cut them into batches (`batching`), send
   each batch's token ids to the least-loaded worker (at most `max_in_flight_per_worker`
   batches queued per worker), and write each finished batch as one Parquet part at once;
6. when every batch is written, mark the folder complete (`_SUCCESS`).

Memory stays flat: the driver holds one input chunk, one batching window, and the rows of
the batches in flight. Output rows are grouped by batch (sorted by prompt length within a
window), not in input order: join on `id`.

Failure handling lives in two places: `_submit` (the one place a batch is sent) and
`_collect_one` (the one place a finished or failed batch is handled). Actors restart
(`max_restarts`) and Ray retries their tasks (`max_task_retries`); a batch whose worker
still died is sent again to another worker, up to `MAX_BATCH_ATTEMPTS` times.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve.errors import ModelError, NanoserveError
from nanoserve.model_store import DEFAULT_MODEL, resolve_model
from ray_jobs.batching import Batch, BatchLimits, make_batches
from ray_jobs.io import DEFAULT_CHUNK_ROWS, InputInfo, iter_chunks, scan_input, write_part_atomic
from ray_jobs.manifest import (
    Manifest,
    input_identity,
    mark_complete,
    model_identity,
    open_output_dir,
    part_name,
)
from ray_jobs.prepare import ColumnPlan, PreparedRow, RowPreparer, load_model_meta, plan_columns
from ray_jobs.worker import (
    PREFILL_SLOTS_KEY,
    PREFILL_TOKENS_KEY,
    BatchWorker,
    GenerationRequest,
    error_row,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_BATCH_ATTEMPTS = 3  # sends of one batch to workers that died, before the job gives up


@dataclass(frozen=True)
class JobOptions:
    """The job's options (the CLI's flags). Sampling fields are the defaults that per-row
    columns override."""

    model: str = DEFAULT_MODEL
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    num_workers: int | None = None  # None: one per GPU of the cluster, 1 without GPUs
    batch_size: int = 64  # rows per batch
    max_batch_tokens: int | None = None  # rows x max(prompt + max_tokens) per batch
    window_batches: int = 8  # batches' worth of rows sorted by length together
    prompt_column: str | None = None
    id_column: str | None = None
    address: str | None = None  # Ray address; None: RAY_ADDRESS, a running cluster, or local
    overwrite: bool = False
    kv_cache_fraction: float = 0.5  # of a GPU's free memory, for the KV pool
    chunk_rows: int = DEFAULT_CHUNK_ROWS  # rows read and tokenized at a time
    max_in_flight_per_worker: int = 2
    max_restarts: int = 3  # per actor
    max_task_retries: int = 3  # per batch, on a restarted actor
    progress: bool = True  # a tqdm bar on stderr

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if self.dtype not in DTYPES:
            raise NanoserveError(f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPES)}")
        if self.num_workers is not None and self.num_workers < 1:
            raise NanoserveError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise NanoserveError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")

    def sampling_defaults(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop, "ignore_eos": self.ignore_eos}


@dataclass(frozen=True)
class WorkerReport:
    index: int
    gpu_ids: tuple
    device: str
    host: str
    batches: int  # batches this worker generated in this run
    rows: int


@dataclass(frozen=True)
class JobSummary:
    """What one run did. Counts cover this run; `rows_resumed` rows were written by earlier
    runs into the same folder."""

    output_dir: str
    rows: int
    error_rows: int
    rows_resumed: int
    input_tokens: int
    output_tokens: int
    wall_time_s: float
    output_tokens_per_s: float
    padding_waste: float  # padding / padded prefill rectangle, summed over batches
    num_batches: int
    workers: tuple[WorkerReport, ...] = ()

    def format(self) -> str:
        lines = [
            f"rows: {self.rows} ({self.error_rows} error rows)"
            + (f", {self.rows_resumed} done by an earlier run" if self.rows_resumed else ""),
            f"tokens: {self.input_tokens} input, {self.output_tokens} output",
            f"wall time: {self.wall_time_s:.1f} s, {self.output_tokens_per_s:.1f} output tokens/s",
            f"padding waste: {self.padding_waste:.1%} of the padded prefill",
            f"batches: {self.num_batches} on {len(self.workers)} worker(s); output: {self.output_dir}",
        ]
        return "\n".join(lines)


def run_batch_job(input: str | Path, output_dir: str | Path, **options: Any) -> JobSummary:
    """Run the batch job of `nanoserve batch INPUT -o OUTPUT_DIR`; see the module docstring.
    Job-level problems raise `NanoserveError` (InputError, ModelError) before any worker
    starts; row-level problems become `error` rows."""
    start = time.perf_counter()
    opts = JobOptions(**options)
    info = scan_input(input, opts.chunk_rows)
    plan = plan_columns(info.schema, opts.prompt_column, opts.id_column)
    limits = BatchLimits(opts.batch_size, opts.max_batch_tokens,
                         opts.window_batches * opts.batch_size)
    model_path = resolve_model(opts.model)
    config, tokenizer = load_model_meta(model_path)
    preparer = RowPreparer(plan, tokenizer, config.max_position_embeddings, config.vocab_size,
                           opts.sampling_defaults())
    settings = _job_settings(opts, info, model_path, limits)
    folder = Path(output_dir)
    manifest = open_output_dir(folder, settings, opts.overwrite)
    if manifest.complete:
        return JobSummary(str(folder), 0, 0, manifest.rows_done, 0, 0,
                          time.perf_counter() - start, 0.0, 0.0, 0)
    with _RaySession(opts.address):
        pool = _WorkerPool.start(opts)
        try:
            run = _JobRun(opts, plan, folder, manifest, pool, info.num_rows)
            run.execute(make_batches(_prepared_rows(info, preparer, opts.chunk_rows), limits))
        finally:
            pool.shutdown()
    mark_complete(folder, manifest)
    return run.summary(time.perf_counter() - start)


def _job_settings(opts: JobOptions, info: InputInfo, model_path: Path,
                  limits: BatchLimits) -> dict[str, Any]:
    """What the manifest compares on resume: everything that changes the output rows."""
    sampling = opts.sampling_defaults()
    sampling["stop"] = list(sampling["stop"])
    return {
        "model": {"files": model_identity(model_path), "dtype": opts.dtype},
        "input": {"files": input_identity(info.root, info.files), "num_rows": info.num_rows},
        "sampling": sampling,
        "batching": {"batch_size": limits.batch_size, "max_batch_tokens": limits.max_batch_tokens,
                     "window_rows": limits.window_rows},
        "columns": {"prompt_column": opts.prompt_column, "id_column": opts.id_column},
    }


def _prepared_rows(info: InputInfo, preparer: RowPreparer, chunk_rows: int) -> Iterator[PreparedRow]:
    position = 0
    for chunk in iter_chunks(info, chunk_rows):
        yield from preparer.prepare(chunk, position)
        position += chunk.batch.num_rows


class _RaySession:
    """Join the Ray cluster the job should use, or start a private local one.

    Order: an already initialized Ray (kept as it is); `address` (or RAY_ADDRESS); a running
    cluster started with `ray start` on this machine; else a private local Ray
    (`start_local_ray`). `address="local"` always starts the private local Ray."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.owned = False
        self.temp_dir: str | None = None

    def __enter__(self) -> _RaySession:
        import ray

        if ray.is_initialized():
            return self
        address = self.address or os.environ.get("RAY_ADDRESS") or None
        if address is None and _running_cluster_address() is not None:
            address = "auto"
        if address not in (None, "local"):
            try:
                ray.init(address=address, logging_level=logging.WARNING)
                self.owned = True
                return self
            except ConnectionError as e:
                if self.address or os.environ.get("RAY_ADDRESS"):
                    raise NanoserveError(f"cannot connect to Ray at {address}: {e}") from None
                print(f"nanoserve: no running Ray cluster ({e}); starting a local one",
                      file=sys.stderr)
        self.temp_dir = start_local_ray()
        self.owned = True
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        if self.owned:
            ray.shutdown()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray on 127.0.0.1 only


def start_local_ray(num_cpus: int | None = None, num_gpus: int | None = None) -> str:
    """Start a private single-machine Ray in this process and return its temp dir (the
    caller removes it after `ray.shutdown()`).

    Every Ray process listens on 127.0.0.1 only: Ray's single-machine mode
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, inherited by the processes it starts) keeps it from
    swapping 127.0.0.1 for the machine's network address. So token authentication can be
    off (RAY_AUTH_MODE=disabled unless set), and nothing is written under ~/.ray or /tmp/ray.
    No dashboard."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault(SINGLE_MACHINE_ENV, "0")
    import ray
    import ray._private.ray_constants as ray_constants

    # Read once when ray is imported, which may have been before the line above.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ[SINGLE_MACHINE_ENV].lower() in ("1", "true")
    temp_dir = tempfile.mkdtemp(prefix="ns-ray-")  # short: socket paths stay < 108 chars
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
             _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir,
             logging_level=logging.WARNING)
    return temp_dir


def _running_cluster_address() -> str | None:
    """The address `ray start` left on this machine for `ray.init(address='auto')`, if any."""
    from ray._private.services import find_bootstrap_address

    try:
        return find_bootstrap_address(None)
    except Exception:  # an unreadable bootstrap file means no usable cluster
        return None


class _RayBatchWorker(BatchWorker):
    """The actor form of `BatchWorker`: a model that fails to load is reported by `info()`
    as a message (a clean job-level error) rather than as a crashed actor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.load_error: str | None = None
        try:
            super().__init__(*args, **kwargs)
        except NanoserveError as e:
            self.load_error = str(e)

    def info(self) -> dict[str, Any]:
        if self.load_error is not None:
            return {"load_error": self.load_error}
        return super().info()


@dataclass
class _Worker:
    handle: Any
    info: dict[str, Any]
    in_flight: int = 0
    batches: int = 0
    rows: int = 0
    alive: bool = True


class _WorkerPool:
    """The job's actors: one per GPU (num_gpus=1), or CPU actors (num_cpus=1) when the
    cluster has no GPUs. Started once; `start` returns when every model is loaded."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    @classmethod
    def start(cls, opts: JobOptions) -> _WorkerPool:
        import ray

        resources = ray.cluster_resources()
        num_gpus = int(resources.get("GPU", 0))
        count = opts.num_workers or max(1, num_gpus)
        if num_gpus:
            actor_options: dict[str, Any] = {"num_gpus": 1}
            num_threads = None
        else:
            actor_options = {"num_cpus": 1}
            num_threads = max(1, int(resources.get("CPU", 1)) // count)
        actor_cls = ray.remote(_RayBatchWorker).options(
            max_restarts=opts.max_restarts, max_task_retries=opts.max_task_retries,
            **actor_options)
        slots = num_gpus or int(resources.get("CPU", 0))
        if count > slots:
            print(f"nanoserve: {count} workers asked for, the cluster has room for {slots} now; "
                  f"the others wait until the cluster grows", file=sys.stderr)
        if opts.progress:
            where = f"{num_gpus} GPU(s)" if num_gpus else "CPU"
            print(f"nanoserve: starting {count} worker(s) on {where}, loading {opts.model}",
                  file=sys.stderr)
        handles = [actor_cls.remote(opts.model, dtype=opts.dtype,
                                    kv_cache_fraction=opts.kv_cache_fraction,
                                    num_threads=num_threads) for _ in range(count)]
        try:
            infos = ray.get([h.info.remote() for h in handles])
        except ray.exceptions.RayActorError as e:
            cls(_workers(handles, [{}] * len(handles))).shutdown()
            raise ModelError(f"a worker could not start: {_first_line(str(e))}") from None
        failed = [i["load_error"] for i in infos if "load_error" in i]
        if failed:
            cls(_workers(handles, infos)).shutdown()
            raise ModelError(f"the workers could not load the model: {failed[0]}")
        return cls(_workers(handles, infos))

    def pick(self, avoid: int | None = None) -> int:
        """The live worker with the fewest batches in flight (ties: lowest index), preferring
        any other than `avoid`. NanoserveError when none is alive."""
        alive = [i for i, w in enumerate(self.workers) if w.alive]
        if not alive:
            raise NanoserveError("every worker died; the job stopped (rerun it to resume)")
        others = [i for i in alive if i != avoid] or alive
        return min(others, key=lambda i: (self.workers[i].in_flight, i))

    def reports(self) -> tuple[WorkerReport, ...]:
        return tuple(WorkerReport(i, tuple(w.info.get("gpu_ids", ())), w.info.get("device", "?"),
                                  w.info.get("host", "?"), w.batches, w.rows)
                     for i, w in enumerate(self.workers))

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w.handle, no_restart=True)


def _workers(handles: list[Any], infos: list[dict[str, Any]]) -> list[_Worker]:
    return [_Worker(h, i) for h, i in zip(handles, infos)]


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else text


@dataclass
class _InFlight:
    batch: Batch
    worker: int
    attempt: int


class _JobRun:
    """One pass over the batches: submit, collect, write, record. See the module docstring."""

    def __init__(self, opts: JobOptions, plan: ColumnPlan, folder: Path, manifest: Manifest,
                 pool: _WorkerPool, total_rows: int) -> None:
        from tqdm import tqdm

        self.opts = opts
        self.schema = plan.output_schema()
        self.input_fields = [f for f in plan.input_schema if f.name != "id"]
        self.folder = folder
        self.manifest = manifest
        self.pool = pool
        self.in_flight: dict[Any, _InFlight] = {}
        self.rows = self.error_rows = self.rows_resumed = self.num_batches = 0
        self.input_tokens = self.output_tokens = 0
        self.padded_slots = self.padded_real = 0
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total_rows, unit="row", file=sys.stderr, disable=not opts.progress,
                        dynamic_ncols=True, desc="nanoserve batch")

    def execute(self, batches: Iterator[Batch]) -> None:
        try:
            for batch in batches:
                if batch.batch_id in self.manifest.done:
                    self.rows_resumed += len(batch.rows)
                    self.bar.update(len(batch.rows))
                elif batch.is_error:
                    self._write(batch, [error_row(r.error) for r in batch.rows], None, None)
                else:
                    while self.in_flight and len(self.in_flight) >= \
                            self.opts.max_in_flight_per_worker * self._num_alive():
                        self._collect_one()
                    self._submit(batch, attempt=0)
            while self.in_flight:
                self._collect_one()
        finally:
            self.bar.close()

    def _num_alive(self) -> int:
        return sum(w.alive for w in self.pool.workers)

    def _submit(self, batch: Batch, attempt: int, avoid: int | None = None) -> None:
        """The one place a batch is sent to a worker."""
        index = self.pool.pick(avoid)
        worker = self.pool.workers[index]
        requests = [GenerationRequest(r.prompt_token_ids, r.params) for r in batch.rows]
        ref = worker.handle.run_batch.remote(requests)
        worker.in_flight += 1
        self.in_flight[ref] = _InFlight(batch, index, attempt)

    def _collect_one(self) -> None:
        """The one place a finished or failed batch is handled: wait for any batch in flight,
        then write it, turn it into error rows, or send it again."""
        import ray

        ready, _ = ray.wait(list(self.in_flight), num_returns=1)
        item = self.in_flight.pop(ready[0])
        worker = self.pool.workers[item.worker]
        worker.in_flight -= 1
        try:
            table = ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            if isinstance(e, ray.exceptions.ActorDiedError):
                worker.alive = False
            if item.attempt + 1 >= MAX_BATCH_ATTEMPTS:
                raise NanoserveError(
                    f"batch {item.batch.batch_id} failed {MAX_BATCH_ATTEMPTS} times on dying "
                    f"workers ({_first_line(str(e))}); rerun the job to resume"
                ) from None
            self._submit(item.batch, item.attempt + 1, avoid=item.worker)
            return
        except ray.exceptions.RayTaskError as e:  # the batch itself made the worker raise
            message = f"generation failed: {_first_line(str(e.cause or e))}"
            self._write(item.batch, [error_row(message, r.num_prompt_tokens)
                                     for r in item.batch.rows], item.worker, None)
            return
        self._write(item.batch, table.to_pylist(), item.worker, table.schema.metadata)

    def _write(self, batch: Batch, results: list[dict[str, Any]], worker: int | None,
               metadata: dict[bytes, bytes] | None) -> None:
        table = self._assemble(batch, results)
        write_part_atomic(table, self.folder / part_name(batch.batch_id))
        self.manifest.record(batch.batch_id, len(batch.rows))
        self.manifest.save(self.folder)
        self._count(batch, results, worker, metadata)

    def _assemble(self, batch: Batch, results: list[dict[str, Any]]) -> pa.Table:
        """`id`, the input columns, then the results: one output row per batch row."""
        rows = batch.rows
        arrays = [pa.array([r.id for r in rows], type=self.schema.field("id").type)]
        arrays += [pa.array([r.values[f.name] for r in rows], type=f.type)
                   for f in self.input_fields]
        result_fields = list(self.schema)[len(arrays):]
        arrays += [pa.array([res[f.name] for res in results], type=f.type) for f in result_fields]
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def _count(self, batch: Batch, results: list[dict[str, Any]], worker: int | None,
               metadata: dict[bytes, bytes] | None) -> None:
        n = len(batch.rows)
        self.rows += n
        self.num_batches += 1
        self.error_rows += sum(res["finish_reason"] == "error" for res in results)
        self.input_tokens += sum(res["num_input_tokens"] or 0 for res in results)
        self.output_tokens += sum(res["num_generated_tokens"] or 0 for res in results)
        if worker is not None:
            w = self.pool.workers[worker]
            w.batches += 1
            w.rows += n
            if metadata and PREFILL_SLOTS_KEY in metadata and int(metadata[PREFILL_SLOTS_KEY]):
                self.padded_slots += int(metadata[PREFILL_SLOTS_KEY])
                self.padded_real += int(metadata[PREFILL_TOKENS_KEY])
            elif not batch.is_error:
                self.padded_slots += batch.padded_prompt_tokens
                self.padded_real += batch.num_prompt_tokens
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(n)
        self.bar.set_postfix_str(f"{self.output_tokens / elapsed:.1f} out tok/s", refresh=False)

    def summary(self, wall_time_s: float) -> JobSummary:
        waste = 1 - self.padded_real / self.padded_slots if self.padded_slots else 0.0
        return JobSummary(
            output_dir=str(self.folder), rows=self.rows, error_rows=self.error_rows,
            rows_resumed=self.rows_resumed, input_tokens=self.input_tokens,
            output_tokens=self.output_tokens, wall_time_s=wall_time_s,
            output_tokens_per_s=self.output_tokens / wall_time_s if wall_time_s > 0 else 0.0,
            padding_waste=waste, num_batches=self.num_batches, workers=self.pool.reports(),
        )


__all__ = ["JobOptions", "JobSummary", "WorkerReport", "run_batch_job", "start_local_ray"]
