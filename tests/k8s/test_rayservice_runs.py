"""The RayService's Serve config really runs: serveConfigV2, taken out of the rendered base manifest,
is deployed on a local Ray cluster the way KubeRay deploys it (what the dashboard's Serve REST handler
does: serve_start, then deploy_apps of the parsed config) and answers completions over HTTP."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import httpx
import pytest
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from conftest import free_port
from metrale.cluster.params import SamplingParams
from metrale.deploy.k8s import serve_config
from metrale.deploy.kustomize import render
from metrale.deploy.llm import LLM

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
IMAGE_ROOT = "/opt/metrale"    # where k8s/Dockerfile puts the repository
PROMPT = "def fib(n):\n"


def manifest_config() -> dict:
    service = next(r.body for r in render(REPO / "k8s" / "base") if r.body["kind"] == "RayService")
    return serve_config(service)


def local_config(config: dict) -> dict:
    """The config with only what holds in the image or on a GPU node replaced: paths under IMAGE_ROOT
    point into this checkout (the bundled demo model), and the workers take no GPU and run on the CPU
    (gpus_per_worker: 0, device: cpu), since CI has no GPU. Everything else is the manifest's."""
    config = copy.deepcopy(config)
    for app in config["applications"]:
        args = app["args"]
        for key, value in args.items():
            if isinstance(value, str) and value.startswith(IMAGE_ROOT + "/"):
                args[key] = str(REPO / value.removeprefix(IMAGE_ROOT + "/"))
        args.update(gpus_per_worker=0, device="cpu")
    return config


@pytest.fixture(scope="module")
def endpoint(ray_cluster):
    config = local_config(manifest_config())
    # KubeRay's pods serve on port 8000; this machine's tests take a free port
    port = free_port()
    schema = ServeDeploySchema.model_validate(
        {**config, "http_options": {"host": "127.0.0.1", "port": port}})
    client = serve_start(http_options=schema.http_options.model_dump(),
                         proxy_location=schema.proxy_location)
    client.deploy_apps(schema)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 200:
                break
            status = f"{health.status_code} {health.text}"
        except httpx.TransportError as e:
            status = repr(e)
        assert time.time() < deadline, f"/health never answered 200: {status}"
        time.sleep(0.5)
    yield url, config["applications"][0]["args"]
    serve.shutdown()


def test_only_image_paths_and_the_device_are_overridden():
    original = manifest_config()
    local = local_config(original)
    assert [a["import_path"] for a in local["applications"]] == ["metrale.deploy.serve:build_app"]
    before, after = original["applications"][0]["args"], local["applications"][0]["args"]
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed == {"model", "gpus_per_worker", "device"}
    assert before["model"] == f"{IMAGE_ROOT}/deploy/demo/target"
    assert Path(after["model"], "config.json").is_file()


def test_the_manifest_config_answers_a_completion(endpoint):
    url, args = endpoint
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [args["served_model_name"]]
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": args["served_model_name"], "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    # the same greedy text as metrale's engine in this process, with the manifest's proposer
    llm = LLM(args["model"], device="cpu", speculative_method=args["speculative_method"],
              num_drafts=args["num_drafts"])
    want = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out["choices"][0]["text"] == want.text
    assert out["usage"]["completion_tokens"] == 16
