"""cluster.yaml passes Ray's own cluster-launcher validation and describes GPU workers that
install this package and fetch the default model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


@pytest.fixture(scope="module")
def raw_config():
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_ray_validates_the_prepared_config(raw_config):
    config = prepare_config(copy.deepcopy(raw_config))  # Ray's defaults for the provider merged in
    validate_config(config)  # raises on any schema or consistency problem
    assert config["provider"]["type"] == "aws"


def test_ray_rejects_a_broken_copy(raw_config):
    # The check above is a real one: a misspelt key fails it.
    broken = copy.deepcopy(raw_config)
    broken["available_node_types"]["gpu_l40s"]["min_wrokers"] = 1
    with pytest.raises(Exception, match="min_wrokers"):
        validate_config(prepare_config(broken))


def test_gpu_worker_types_and_head(raw_config):
    types = raw_config["available_node_types"]
    head = raw_config["head_node_type"]
    assert head in types and types[head]["resources"].get("GPU", 0) == 0
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu_types, "no GPU worker node type"
    assert sum(t.get("min_workers", 0) for t in gpu_types.values()) >= 1  # GPUs from the start
    for t in gpu_types.values():
        assert t["max_workers"] >= t.get("min_workers", 0)


def test_every_node_installs_the_package_and_fetches_the_model(raw_config):
    setup = raw_config["setup_commands"]
    assert any("pip install" in c and "~/nanoserve" in c for c in setup)
    assert any(c.strip().startswith("nanoserve fetch-model") for c in setup)
    assert raw_config["file_mounts"]["~/nanoserve"] == "."
