"""The one configuration model: YAML, flags over file, Serve config args, derived worker settings,
and the errors users see."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
import yaml
from ray import serve

from metrale.deploy import config as config_module
from metrale.deploy.config import ConfigError, MetraleConfig
from metrale.deploy.serve import build_app
from metrale.drafting.proposer import METHODS


def metrale(*args):
    return subprocess.run([sys.executable, "-m", "metrale.deploy.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_every_field_is_described_and_methods_match_the_registry():
    fields = MetraleConfig.model_fields
    assert all(f.description for f in fields.values()), \
        [name for name, f in fields.items() if not f.description]
    assert typing.get_args(fields["speculative_method"].annotation) == METHODS


def test_yaml_then_flags(tmp_path, checkpoint):
    path = tmp_path / "metrale.yaml"
    path.write_text(yaml.safe_dump({"model": str(checkpoint("qwen3")), "replicas": 2,
                                    "speculative_method": "ngram", "num_drafts": 4, "port": 9000}))
    config = MetraleConfig.from_yaml(path)
    assert (config.replicas, config.num_drafts, config.port) == (2, 4, 9000)
    assert config.host == "127.0.0.1"
    flags = config.with_overrides(port=9100, replicas=None, speculative_method="self")
    assert (flags.port, flags.replicas, flags.speculative_method) == (9100, 2, "self")
    worker = flags.worker_config()
    assert (worker.model, worker.max_drafts, worker.speculative_method) == \
        (str(checkpoint("qwen3")), 4, "self")
    assert flags.scheduler_config().adaptive_drafts
    assert not flags.with_overrides(adaptive_drafts=False).scheduler_config().adaptive_drafts


def test_gpu_kernel_settings_reach_the_worker(tmp_path, checkpoint):
    path = tmp_path / "gpu.yaml"
    path.write_text(f"model: {checkpoint('qwen3')}\nattention_backend: torch\ncuda_graphs: false\n")
    worker = MetraleConfig.from_yaml(path).worker_config()
    assert (worker.attention_backend, worker.cuda_graphs) == ("torch", False)
    worker = MetraleConfig.load(path, attention_backend="auto", cuda_graphs=True).worker_config()
    assert (worker.attention_backend, worker.cuda_graphs) == ("auto", True)
    with pytest.raises(ConfigError, match="attention_backend"):
        MetraleConfig.validated({"attention_backend": "flash"})


def test_steps_in_flight_reaches_the_scheduler_and_is_bounded(tmp_path, checkpoint):
    path = tmp_path / "pipe.yaml"
    path.write_text(f"model: {checkpoint('qwen3')}\nsteps_in_flight: 1\nplan_ahead: false\n")
    assert MetraleConfig.from_yaml(path).scheduler_config().steps_in_flight == 1
    assert MetraleConfig.from_yaml(path).scheduler_config().plan_ahead is False
    assert MetraleConfig().scheduler_config().plan_ahead is True
    assert MetraleConfig.load(path).with_overrides(steps_in_flight=None) \
        .scheduler_config().steps_in_flight == 1   # an unset flag keeps the file's value
    assert MetraleConfig().scheduler_config().steps_in_flight is None   # per worker device
    for bad in (0, 5):
        with pytest.raises(ConfigError, match="steps_in_flight"):
            MetraleConfig.validated({"steps_in_flight": bad})


def test_chain_rounds_reach_the_worker_config_and_are_bounded(tmp_path, checkpoint):
    path = tmp_path / "chain.yaml"
    path.write_text(f"model: {checkpoint('qwen3')}\nspeculative_method: ngram\nchain_rounds: 3\n")
    assert MetraleConfig.from_yaml(path).worker_config().chain_rounds == 3
    assert MetraleConfig(model=str(checkpoint("qwen3"))).worker_config().chain_rounds is None
    for bad in (-1, 65):
        with pytest.raises(ConfigError, match="chain_rounds"):
            MetraleConfig.validated({"chain_rounds": bad})


def test_decode_steps_reach_the_scheduler_and_are_bounded(tmp_path, checkpoint):
    path = tmp_path / "steps.yaml"
    path.write_text(f"model: {checkpoint('qwen3')}\ndecode_steps: 4\n")
    assert MetraleConfig.from_yaml(path).scheduler_config().decode_steps == 4
    assert MetraleConfig().scheduler_config().decode_steps is None   # per request and worker
    for bad in (0, 17):
        with pytest.raises(ConfigError, match="decode_steps"):
            MetraleConfig.validated({"decode_steps": bad})


def test_prefill_gather_reaches_the_scheduler_and_is_bounded(tmp_path, checkpoint):
    path = tmp_path / "gather.yaml"
    path.write_text(f"model: {checkpoint('qwen3')}\nprefill_gather: 4\n")
    assert MetraleConfig.from_yaml(path).scheduler_config().prefill_gather == 4.0
    assert MetraleConfig().scheduler_config().prefill_gather == 1.0
    for bad in (0.5, 65, "soon"):
        with pytest.raises(ConfigError, match="prefill_gather"):
            MetraleConfig.validated({"prefill_gather": bad})


def test_cluster_resources_decide_the_worker_device(checkpoint):
    config = MetraleConfig(model=str(checkpoint("qwen3")), workers_per_replica=2)
    on_cpu = config.replica_spec(cluster_gpus=0)
    assert (on_cpu.gpus_per_worker, on_cpu.worker.device, on_cpu.workers) == (0.0, "cpu", 2)
    assert on_cpu.bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]
    on_gpu = config.replica_spec(cluster_gpus=8)
    assert (on_gpu.gpus_per_worker, on_gpu.worker.device) == (1.0, "auto")
    assert on_gpu.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 2
    shared = config.with_overrides(gpus_per_worker=0.5).replica_spec(cluster_gpus=1)
    assert shared.bundles()[0]["GPU"] == 0.5


def test_tensor_parallel_ranks_take_a_bundle_each(checkpoint):
    config = MetraleConfig(model=str(checkpoint("qwen3")), workers_per_replica=2,
                           tensor_parallel_size=2)
    spec = config.replica_spec(cluster_gpus=8)
    assert (spec.workers, spec.ranks, spec.worker.tensor_parallel_size) == (2, 2, 2)
    assert spec.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert config.with_overrides(tensor_parallel_size=None).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        config.with_overrides(tensor_parallel_size=0)


@pytest.mark.parametrize("content, words", [
    ("replicas: 0\n", "replicas: Input should be greater than or equal to 1"),
    ("modle: x\n", "modle: Extra inputs are not permitted"),
    ("speculative_method: eagle\n", "speculative_method"),
    ("port: [1\n", "not valid YAML"),
    ("- model\n", "expected a mapping"),
])
def test_bad_files_name_the_file_and_the_field(tmp_path, content, words):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match="bad.yaml") as e:
        MetraleConfig.from_yaml(path)
    assert words in str(e.value)


def test_the_bundled_model_is_the_default():
    from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
    assert config_module.DEFAULT_MODEL == str(BUNDLED_MODEL) == MetraleConfig().model_path
    assert MetraleConfig(speculative_method="dflash").worker_config().drafter == str(BUNDLED_DFLASH)
    assert MetraleConfig(speculative_method="mtp").worker_config().drafter is None
    with pytest.raises(ConfigError, match="pass --model"):
        MetraleConfig(model=None).model_path


def test_direct_port_must_differ_from_the_proxy_port():
    assert MetraleConfig.load(None, direct_port=8001).direct_port == 8001
    assert MetraleConfig().direct_port is None
    with pytest.raises(ConfigError, match="direct_port must differ from port"):
        MetraleConfig.load(None, port=9000, direct_port=9000)
    with pytest.raises(ConfigError, match="direct_port"):
        MetraleConfig.validated({"direct_port": 0})


def test_serve_cli_reports_bad_config_and_checkpoint(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replicas: -1\n")
    r = metrale("serve", "--config", str(path))
    assert r.returncode == 2 and "c.yaml: replicas" in r.stderr
    r = metrale("serve", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such model directory" in r.stderr


def test_serve_config_args_build_the_application(checkpoint):
    """`serve run`/`serve deploy` pass the config file's `args` mapping to the builder."""
    app = build_app({"model": str(checkpoint("qwen3")), "replicas": 2, "max_pending_requests": 8})
    assert isinstance(app, serve.Application)
    with pytest.raises(ConfigError, match="Serve application args: replicas"):
        build_app({"model": str(checkpoint("qwen3")), "replicas": "many"})
