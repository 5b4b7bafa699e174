"""metrale's KubeRay manifests validate strictly against KubeRay v1.7.0's CRDs (../shared/k8s-crds, beside
the checkout), and the validator refuses what the API server, Ray Serve or metrale would refuse."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from metrale.deploy.cli import main
from metrale.deploy.k8s import CRDs, serve_config, validate, validate_paths
from metrale.deploy.kustomize import RenderError, Resource, render

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO.parent / "shared" / "k8s-crds"
KUSTOMIZATIONS = ["k8s/base", "k8s/overlays/gpu", "k8s/overlays/cpu-demo"]
IMAGE_ROOT = "/opt/metrale"    # where k8s/Dockerfile puts the repository

needs_crds = pytest.mark.skipif(not CRDS.is_dir(), reason=f"the KubeRay CRDs are not at {CRDS} "
                                "(CI has shared/k8s-crds beside the checkout)")


@pytest.fixture(scope="module")
def crds() -> CRDs:
    return CRDs.load(CRDS)


def rendered(kind: str, where: str = "k8s/base") -> dict:
    return next(r.body for r in render(REPO / where) if r.body["kind"] == kind)


def problems(crds: CRDs, body: dict) -> list[str]:
    return validate(Resource("test.yaml, document 1", body), crds)


def worker_group(body: dict) -> dict:
    return body["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def with_serve_config(body: dict, change) -> dict:
    config = serve_config(body)
    change(config)
    body["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    return body


def args(config: dict) -> dict:
    return config["applications"][0]["args"]


@needs_crds
@pytest.mark.parametrize("where", KUSTOMIZATIONS)
def test_our_manifests_validate(crds, where):
    resources, found = validate_paths([str(REPO / where)], crds)
    assert found == []
    assert sorted(r.body["kind"] for r in resources) == ["RayJob", "RayService"]


@pytest.mark.parametrize("where", ["k8s/base", "k8s/overlays/gpu"])
def test_rayservice_has_the_shape_kuberay_serves(where):
    """A head without GPUs, an autoscaled GPU worker group with equal GPU limits and requests, the
    ports KubeRay's samples name, and worker readiness through metrale's /health."""
    cluster = rendered("RayService", where)["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert not any(k.endswith("gpu") for part in head["resources"].values() for k in part)
    assert {p["name"]: p["containerPort"] for p in head["ports"]} == {
        "gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
    group = cluster["workerGroupSpecs"][0]
    assert cluster["enableInTreeAutoscaling"] and 1 <= group["minReplicas"] <= group["maxReplicas"]
    worker = group["template"]["spec"]["containers"][0]
    gpus = {part: worker["resources"][part]["nvidia.com/gpu"] for part in ("limits", "requests")}
    assert gpus["limits"] == gpus["requests"] and int(gpus["limits"]) >= 1
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}
    assert {"name": "serve", "containerPort": 8000} in worker["ports"]


@needs_crds
def test_cli_validates_the_k8s_folder(capsys):
    assert main(["k8s", "validate", "--crds", str(CRDS), str(REPO / "k8s")]) == 0
    assert capsys.readouterr().out.strip() == "6 document(s), 0 problem(s)"


@needs_crds
def test_cli_names_file_document_and_path(crds, tmp_path, capsys):
    job, service = rendered("RayJob"), rendered("RayService")
    worker_group(service)["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([job, service]))
    assert main(["k8s", "validate", "--crds", str(CRDS), str(path)]) == 1
    out = capsys.readouterr().out
    assert (f"{path}, document 2 (RayService metrale): spec.rayClusterConfig.workerGroupSpecs[0]"
            ".template.spec.containers[0].imagePullPolicyy: unknown field (did you mean "
            "'imagePullPolicy'?)") in out
    assert "2 document(s), 1 problem(s)" in out
    assert main(["k8s", "validate", "--crds", str(tmp_path / "none"), str(path)]) == 2


@needs_crds
@pytest.mark.parametrize("change, expected", [
    (lambda b: worker_group(b).update(replicass=1),
     "workerGroupSpecs[0].replicass: unknown field (did you mean 'replicas'?)"),
    (lambda b: b["metadata"].update(lables={}), "metadata.lables: unknown field"),
    (lambda b: b["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
     .update(nodeSelectr={}), "headGroupSpec.template.spec.nodeSelectr: unknown field"),
    (lambda b: with_serve_config(b, lambda c: c["applications"][0].update(route_prefx="/")),
     "spec.serveConfigV2.applications[0].route_prefx: unknown field"),
])
def test_misspelt_fields_are_refused(crds, change, expected):
    body = rendered("RayService")
    change(body)
    found = problems(crds, body)
    assert len(found) == 1 and found[0].startswith("test.yaml, document 1 (RayService metrale): ")
    assert expected in found[0]


@needs_crds
@pytest.mark.parametrize("change, expected", [
    (lambda b: worker_group(b).update(replicas="two"),
     "workerGroupSpecs[0].replicas: 'two' is not of type 'integer'"),
    (lambda b: worker_group(b).update(maxReplicas=2**31), "maxReplicas: 2147483648 is not a 'int32'"),
    # rayStartParams are strings: `num-cpus: 0` is a classic slip
    (lambda b: b["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
        {"num-cpus": 0}), "headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'"),
    (lambda b: worker_group(b)["template"]["spec"]["containers"][0]["resources"]["limits"].update(
        {"nvidia.com/gpu": "one"}), "resources.limits['nvidia.com/gpu']: 'one' does not match"),
    (lambda b: worker_group(b)["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
     .update(port=True), "httpGet.port: True is neither an integer nor a string"),
    (lambda b: b["spec"].update(serveConfigV2={"applications": []}),
     "spec.serveConfigV2: {'applications': []} is not of type 'string'"),
])
def test_wrong_types_are_refused(crds, change, expected):
    body = rendered("RayService")
    change(body)
    found = problems(crds, body)
    assert len(found) == 1 and expected in found[0], found


@needs_crds
@pytest.mark.parametrize("change, expected", [
    (lambda c: args(c).update(num_draft=3), "applications[0].args: num_draft: Extra inputs are not "
     "permitted"),
    (lambda c: args(c).update(speculative_method="eagle"), "args: speculative_method: Input should "
     "be 'none', 'mtp', 'dflash', 'ngram' or 'self'"),
    (lambda c: args(c).update(gpus_per_worker=-1), "args: gpus_per_worker: Input should be greater "
     "than or equal to 0"),
    (lambda c: c["applications"][0].update(import_path="metrale.deploy.serv:build_app"),
     "applications[0].import_path: 'metrale.deploy.serv:build_app' does not import"),
    (lambda c: c["applications"][0].update(deployments=[{"name": "OpenAIServer",
                                                         "num_replica": 2}]),
     "applications[0].deployments[0].num_replica: unknown field"),
    (lambda c: c.update(http_option={}), "spec.serveConfigV2.http_option: unknown field"),
])
def test_invalid_serve_configs_are_refused(crds, change, expected):
    body = with_serve_config(rendered("RayService"), change)
    found = problems(crds, body)
    assert len(found) == 1 and expected in found[0], found


@needs_crds
def test_serve_config_that_is_not_yaml_is_refused(crds):
    body = rendered("RayService")
    body["spec"]["serveConfigV2"] = "applications: [\n"
    assert problems(crds, body) == ["test.yaml, document 1 (RayService metrale): spec.serveConfigV2: "
                                    "not valid YAML at line 2, column 1: expected the node content, "
                                    "but found '<stream end>'"]


@needs_crds
def test_required_fields_with_defaults_are_filled_in_as_the_api_server_does(crds):
    body = rendered("RayService")
    for field in ("minReplicas", "maxReplicas"):      # required, with a default
        del worker_group(body)[field]
    assert problems(crds, body) == []
    del worker_group(body)["groupName"]               # required, no default
    assert problems(crds, body) == ["test.yaml, document 1 (RayService metrale): "
                                    "spec.rayClusterConfig.workerGroupSpecs[0]: 'groupName' is a "
                                    "required property"]


@needs_crds
def test_a_config_the_cluster_cannot_hold_is_refused(crds):
    body = with_serve_config(rendered("RayService"), lambda c: args(c).update(replicas=5))
    assert problems(crds, body) == [
        "test.yaml, document 1 (RayService metrale): spec.serveConfigV2: application 'metrale' "
        "needs 5 worker(s) of 1 CPU / 1 GPU (replicas x workers_per_replica x tensor_parallel_size), "
        "but the cluster holds 4 at most (head: 1 pod(s) of 0 CPU / 0 GPU, gpu: 4 pod(s) of 4 CPU / "
        "1 GPU)"]
    split = with_serve_config(rendered("RayService"),
                              lambda c: args(c).update(replicas=2, tensor_parallel_size=2))
    assert problems(crds, split) == []
    split = with_serve_config(rendered("RayService"),
                              lambda c: args(c).update(replicas=3, tensor_parallel_size=2))
    assert "needs 6 worker(s)" in problems(crds, split)[0]
    body = with_serve_config(rendered("RayService"), lambda c: args(c).update(gpus_per_worker=2))
    assert "holds 0 at most" in problems(crds, body)[0]
    body = rendered("RayService")
    worker_group(body)["template"]["spec"]["containers"][0]["resources"]["requests"][
        "nvidia.com/gpu"] = "2"
    assert problems(crds, body) == [
        "test.yaml, document 1 (RayService metrale): spec.rayClusterConfig.workerGroupSpecs[0]"
        ".template.spec.containers[0].resources: nvidia.com/gpu request '2' must equal its limit '1'"]


@needs_crds
def test_rayjob_entrypoint_module_must_exist(crds):
    body = rendered("RayJob")
    body["spec"]["entrypoint"] = body["spec"]["entrypoint"].replace("deploy.batch", "deploy.bach")
    assert problems(crds, body) == ["test.yaml, document 1 (RayJob metrale-batch): spec.entrypoint: "
                                    "module 'metrale.deploy.bach' does not exist"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("where", KUSTOMIZATIONS)
def test_rendering_equals_kubectl_kustomize(where):
    out = subprocess.run(["kubectl", "kustomize", str(REPO / where)], capture_output=True,
                         text=True, check=True).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out)}
    ours = {(r.body["kind"], r.body["metadata"]["name"]): r.body for r in render(REPO / where)}
    assert ours == theirs


def test_renderer_patches_and_images(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "kustomization.yaml").write_text("resources: [pod.yaml]\n")
    (tmp_path / "base" / "pod.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "registry:5000/app:1", "args": ["a", "b"]}],
                 "initContainers": [{"name": "i", "image": "app"}, {"name": "j", "image": "other"}]}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["base"],
        "images": [{"name": "registry:5000/app", "newTag": "2"},
                   {"name": "app", "newName": "mirror/app", "digest": "sha256:ab"}],
        "patches": [{"target": {"kind": "Po.*"}, "patch": yaml.safe_dump([
            {"op": "test", "path": "/spec/containers/0/args/0", "value": "a"},
            {"op": "add", "path": "/spec/containers/0/args/-", "value": "c"},
            {"op": "remove", "path": "/spec/containers/0/args/0"},
            {"op": "replace", "path": "/metadata/name", "value": "q"},
            {"op": "add", "path": "/metadata/labels", "value": {"a/b": "x"}}])}]}))
    [pod] = render(tmp_path)
    assert pod.body["metadata"] == {"name": "q", "labels": {"a/b": "x"}}
    assert pod.body["spec"]["containers"] == [{"name": "c", "image": "registry:5000/app:2",
                                               "args": ["b", "c"]}]
    assert [c["image"] for c in pod.body["spec"]["initContainers"]] == ["mirror/app@sha256:ab",
                                                                       "other"]
    assert pod.origin == f"{tmp_path / 'base' / 'pod.yaml'}, document 1"


@pytest.mark.parametrize("kustomization, expected", [
    ({"resources": ["missing.yaml"]}, "resources: missing.yaml does not exist"),
    ({"namePrefix": "x-"}, "namePrefix: not supported by metrale's renderer"),
    ({"patches": [{"patch": "metadata: {name: x}\n", "target": {"kind": "Pod"}}]},
     "patches[0]: only JSON 6902 patches"),
    ({"resources": ["pod.yaml"], "patches": [{"target": {"kind": "Pod"}, "patch":
                                               "- {op: replace, path: /spec/nope, value: 1}"}]},
     "patches[0]: operation 0 (replace /spec/nope) on "),
    ({"resources": ["pod.yaml"], "patches": [{"path": "nope.yaml", "target": {"kind": "Pod"}}]},
     "nope.yaml: cannot read (No such file or directory)"),
])
def test_renderer_refuses_what_it_cannot_render(tmp_path, kustomization, expected):
    (tmp_path / "pod.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {}\n")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(RenderError, match=re.escape(expected)):
        render(tmp_path)


def test_dockerfile_matches_the_manifests():
    """What can be checked without building the image: the Ray version of the base image is the
    manifests' rayVersion, the repository lands at IMAGE_ROOT, and every path under IMAGE_ROOT that a
    manifest names (model, drafter, batch input) exists in the repository."""
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    ray_image = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py3\d+-gpu$", dockerfile,
                          re.M)
    assert ray_image and re.search(r"^FROM \$\{RAY_IMAGE\}$", dockerfile, re.M)
    assert re.search(rf"^COPY --chown=ray:users \. {IMAGE_ROOT}$", dockerfile, re.M)
    assert f"pip install --no-cache-dir -e {IMAGE_ROOT}" in dockerfile
    ignored = (REPO / "k8s" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)
    named = []
    for where in KUSTOMIZATIONS:
        for r in render(REPO / where):
            cluster = r.body["spec"].get("rayClusterConfig") or r.body["spec"]["rayClusterSpec"]
            assert cluster["rayVersion"] == ray_image.group(1), (where, r.label)
            text = r.body["spec"].get("serveConfigV2", "") + r.body["spec"].get("entrypoint", "")
            named += re.findall(rf"{IMAGE_ROOT}/(\S+)", text)
    assert {"deploy/demo/target", "k8s/demo-prompts.jsonl"} <= set(named)
    assert [p for p in named if not (REPO / p).exists()] == []
