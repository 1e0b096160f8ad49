"""Shared pytest fixtures. Each section belongs to one area of the engine; keep sections apart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# --- weights / model store: the real default model and its transformers oracle -------------


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """The default model's GGUF file, fetched into the user's cache (`$NANOSERVE_CACHE` or
    ~/.cache/nanoserve) at most once per machine."""
    from nanoserve.weights.model_store import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' `LlamaForCausalLM` loaded from the same GGUF file (float32, eval mode):
    the oracle for weights, logits and greedy tokens. Loaded once per session (~15 s)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        smollm2_gguf_path.parent,
        gguf_file=smollm2_gguf_path.name,
        dtype=torch.float32,
        local_files_only=True,
    )
    return model.eval()


# --- end of weights / model store fixtures ---------------------------------------------------


# --- engine: a tiny random Llama, saved and loaded through the real checkpoint path ---------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random LlamaForCausalLM (GQA ratio 3, untied) saved by transformers."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny-llama")
    HFLlama(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from nanoserve.model.model import build_model
    from nanoserve.weights.weights import load_checkpoint

    config, sd = load_checkpoint(tiny_model_dir)
    return build_model(config, sd)


# --- end of engine fixtures ------------------------------------------------------------------


# --- batch job (ray_jobs): one local Ray and the engine the job is checked against ----------


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray shared by the batch-job tests, started the way the job starts its own:
    on 127.0.0.1 only, no dashboard, token authentication off, session files in a private
    temp dir (see `ray_jobs.dispatch.local_ray.start_local_ray`). Shut down at the end."""
    import shutil

    import ray

    from ray_jobs.dispatch.local_ray import start_local_ray

    temp_dir = start_local_ray(num_cpus=2)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf_path):
    """The default model as `nanoserve.llm.LLM` on the CPU (float32), loaded once: the oracle
    the batch job's rows are compared with, one prompt at a time."""
    from nanoserve.llm import LLM

    return LLM(model=str(smollm2_gguf_path), device="cpu")


@pytest.fixture
def private_ray_env():
    """The environment of a job run in a child process (`nanoserve batch` or a script) that
    starts its own private local Ray: this checkout first on PYTHONPATH, no usage stats, no
    RAY_ADDRESS to join, and TMPDIR a fresh folder of a short name (Ray's socket paths stay
    < 108 chars; its session folders go there), removed at the end."""
    import shutil
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="ns-t-")
    env = {**os.environ, "TMPDIR": ray_tmp, "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    try:
        yield env
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


# --- end of batch job fixtures ---------------------------------------------------------------


# --- object storage: a real S3 API server ----------------------------------------------------

S3_SECRET = "nanoserve-test-secret-7f3a91"  # the server's secret key: never in any output


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1 (a free port), and the AWS environment pointing at
    it (secret key `S3_SECRET`); a boto3 client for the tests' own checks. Stopped and the
    environment restored at the end."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "nanoserve-test-key", "AWS_SECRET_ACCESS_KEY": S3_SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    client = boto3.client("s3")
    try:
        yield client
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


# --- end of object storage fixtures ----------------------------------------------------------


# --- job-level errors: found before Ray starts -----------------------------------------------


class RaySessionReached(AssertionError):
    """A job got as far as joining or starting Ray."""


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if the job joins or starts Ray (where its workers would start)."""
    from ray_jobs.dispatch.local_ray import RaySession

    def refuse(*args, **kwargs):
        raise RaySessionReached("a job-level error must be found before Ray is started")

    monkeypatch.setattr(RaySession, "__enter__", refuse)


# --- a tiny random Llama with the default model's tokenizer (fast batch jobs) ----------------


@pytest.fixture(scope="session")
def tiny_job_model(tmp_path_factory, smollm2_gguf_path):
    from nanoserve.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-job-model"), smollm2_gguf_path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_job_model):
    """The oracle: the same model files as `nanoserve.llm.LLM` in this process."""
    from nanoserve.llm import LLM

    return LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=32 << 20)
