"""Validation of KubeRay manifests: each document against its CRD's schema made strict (as
`kubeconform -strict` would), the Serve config inside a RayService against metrale's own config, and
whether the Ray cluster can hold the workers that config asks for."""

from __future__ import annotations

import copy
import difflib
import importlib
import importlib.util
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml
from pydantic import ValidationError

from metrale.deploy.config import ConfigError, MetraleConfig
from metrale.deploy.kustomize import (Loader, RenderError, Resource, kustomization_file,
                                      load_documents, render)

METRALE_APP = "metrale.deploy.serve:build_app"

# The CRDs leave `metadata` open (the API server checks ObjectMeta itself); this is what it accepts.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253,
                 "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": _STRING_MAP, "annotations": _STRING_MAP,
        "generateName": {"type": "string"}, "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
        # set by the server; `kubectl get -o yaml` output carries them and apply ignores them
        "uid": {"type": "string"}, "resourceVersion": {"type": "string"},
        "generation": {"type": "integer"}, "creationTimestamp": {"type": ["string", "null"]},
        "deletionTimestamp": {"type": "string"}, "deletionGracePeriodSeconds": {"type": "integer"},
        "managedFields": {"type": "array"}, "selfLink": {"type": "string"},
    },
}

FORMATS = jsonschema.FormatChecker()
FORMATS.checks("int32")(lambda v: not isinstance(v, int) or -2**31 <= v < 2**31)
FORMATS.checks("int64")(lambda v: not isinstance(v, int) or -2**63 <= v < 2**63)


class ManifestError(ValueError):
    """CRDs or manifests that cannot be read at all."""


@dataclass(frozen=True)
class CRDs:
    """The schema of every served version of some CustomResourceDefinitions, by (apiVersion, kind)."""
    schemas: dict[tuple[str, str], dict]
    validators: dict = field(default_factory=dict)

    @classmethod
    def load(cls, where: str | Path) -> "CRDs":
        """From a YAML file of CRDs or a folder of such files."""
        where = Path(where)
        if not where.exists():
            raise ManifestError(f"{where}: no such file or folder of CRDs")
        schemas = {}
        files = sorted(where.iterdir()) if where.is_dir() else [where]
        for path in files:
            if path.suffix not in (".yaml", ".yml", ".json"):
                continue
            try:
                docs = [d or {} for d in yaml.load_all(path.read_text(), Loader=Loader)]
            except yaml.YAMLError as e:
                raise ManifestError(f"{path}: not valid YAML ({e})") from None
            for doc in docs:
                # `kubectl get crd A B -o yaml` writes a List of them
                for crd in doc.get("items", []) if doc.get("kind") == "List" else [doc]:
                    if crd.get("kind") != "CustomResourceDefinition":
                        continue
                    spec = crd["spec"]
                    for v in spec["versions"]:
                        if v.get("served", True):
                            key = (f"{spec['group']}/{v['name']}", spec["names"]["kind"])
                            schemas[key] = v["schema"]["openAPIV3Schema"]
        if not schemas:
            raise ManifestError(f"{where}: no CustomResourceDefinition found")
        return cls(schemas)

    def validator(self, api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
        key = (api_version, kind)
        if key not in self.validators and key in self.schemas:
            schema = strict(self.schemas[key])
            schema["properties"]["metadata"] = OBJECT_META
            self.validators[key] = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
        return self.validators.get(key)


def strict(schema: dict) -> dict:
    """The structural schema as JSON Schema that refuses whatever the API server would drop or refuse."""
    out = {k: v for k, v in schema.items() if k not in ("properties", "items", "additionalProperties")}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False   # the API server prunes unknown fields silently
    for key in ("items", "additionalProperties"):
        if key in schema:
            out[key] = strict(schema[key]) if isinstance(schema[key], dict) else schema[key]
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [strict(s) for s in schema[key]]
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and isinstance(schema.get("type"), str):
        out["type"] = [schema["type"], "null"]
    return out


def with_defaults(schema: dict, value):
    """`value` as the API server sees it before validating: missing properties that have a default
    are filled in, so a required field with a default is never missing."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key, sub in properties.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                with_defaults(sub, value[key])
        if isinstance(schema.get("additionalProperties"), dict):
            for key in value.keys() - properties.keys():
                with_defaults(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            with_defaults(schema["items"], item)
    return value


def json_path(parts) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", p):
            out += f".{p}" if out else p
        else:
            out += f"[{p!r}]"
    return out or "(document)"


def schema_problems(validator: jsonschema.Draft202012Validator, body: dict) -> list[str]:
    problems = []
    for error in sorted(validator.iter_errors(body), key=lambda e: list(map(str, e.absolute_path))):
        path = list(error.absolute_path)
        if error.validator == "additionalProperties" and error.validator_value is False:
            known = list(error.schema.get("properties", {}))
            for name in sorted(set(error.instance) - set(known)):
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{json_path(path + [name])}: unknown field{hint}")
        elif error.validator == "anyOf" and error.schema.get("x-kubernetes-int-or-string"):
            problems.append(f"{json_path(path)}: {error.instance!r} is neither an integer nor a string")
        else:
            problems.append(f"{json_path(path)}: {error.message}")
    return problems


# -- what is inside the manifests ------------------------------------------------------------------

def serve_config(body: dict) -> dict:
    """The Serve config (serveConfigV2, a YAML string) of a RayService, parsed."""
    try:
        config = yaml.safe_load(body["spec"]["serveConfigV2"])
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ManifestError(f"spec.serveConfigV2: not valid YAML{at}: "
                            f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(config, dict):
        raise ManifestError("spec.serveConfigV2: expected a Serve config (a mapping with applications)")
    return config


def resolve(import_path: str):
    """What Ray Serve imports for an application: `module:attr` or `module.attr`."""
    module, _, attr = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def serve_problems(config: dict) -> tuple[list[str], list[tuple[str, MetraleConfig]]]:
    """Problems of a Serve config (fields Ray Serve does not know, values its schema refuses, import
    paths that do not import, metrale args that MetraleConfig refuses), and the config of each metrale
    application that has none."""
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema
    where = "spec.serveConfigV2"
    problems = [f"{where}.{k}: unknown field"
                for k in sorted(config.keys() - ServeDeploySchema.model_fields.keys())]
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        return problems + [f"{where}.{json_path(err['loc'])}: {err['msg']}" for err in e.errors()], []
    apps = []
    for i, app in enumerate(config["applications"]):
        at = f"{where}.applications[{i}]"
        problems += [f"{at}.{k}: unknown field"
                     for k in sorted(app.keys() - ServeApplicationSchema.model_fields.keys())]
        for j, deployment in enumerate(app.get("deployments") or []):
            problems += [f"{at}.deployments[{j}].{k}: unknown field"
                         for k in sorted(deployment.keys() - DeploymentSchema.model_fields.keys())]
        try:
            builder = resolve(app["import_path"])
        except (ImportError, AttributeError, ValueError) as e:
            problems.append(f"{at}.import_path: {app['import_path']!r} does not import ({e})")
            continue
        if builder is resolve(METRALE_APP):
            try:
                apps.append((app["name"], MetraleConfig.validated(app.get("args") or {}, f"{at}.args")))
            except ConfigError as e:
                problems.append(str(e))
    return problems, apps


def quantity(value) -> float:
    """A Kubernetes CPU or GPU quantity ('500m', '2', 2) as a number."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def pod_resources(group: dict) -> tuple[float, float]:
    """(CPUs, GPUs) Ray sees on a pod of the group: rayStartParams first, else the Ray container's
    limits (then requests), as KubeRay derives them."""
    params = group.get("rayStartParams") or {}
    res = group["template"]["spec"]["containers"][0].get("resources") or {}
    amounts = {**(res.get("requests") or {}), **(res.get("limits") or {})}
    cpus = params.get("num-cpus", amounts.get("cpu", 0))
    gpus = params.get("num-gpus", next((v for k, v in amounts.items() if k.endswith("gpu")), 0))
    return quantity(cpus), quantity(gpus)


def capacity_problems(cluster: dict, config: MetraleConfig, app: str) -> list[str]:
    """Whether the cluster, scaled to its largest, can place every worker of the application."""
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    groups = [("head", cluster["headGroupSpec"], 1)] + [
        (g["groupName"], g, (g["maxReplicas"] if autoscaling else g["replicas"]) * g["numOfHosts"])
        for g in cluster.get("workerGroupSpecs") or []]
    shapes = [(name, pods, *pod_resources(g)) for name, g, pods in groups]
    gpus = (config.gpus_per_worker if config.gpus_per_worker is not None
            else float(any(g for *_, g in shapes)))     # MetraleConfig's default: 1 if there are GPUs
    cpus = config.cpus_per_worker
    per_pod = [(pods, min(math.floor(c / cpus + 1e-9),
                          math.floor(g / gpus + 1e-9) if gpus else math.inf))
               for _, pods, c, g in shapes]
    fits = sum(pods * n for pods, n in per_pod)
    need = config.replicas * config.workers_per_replica * config.tensor_parallel_size
    if fits >= need:
        return []
    pods = ", ".join(f"{name}: {n} pod(s) of {c:g} CPU / {g:g} GPU" for name, n, c, g in shapes)
    return [f"spec.serveConfigV2: application {app!r} needs {need} worker(s) of {cpus:g} CPU / "
            f"{gpus:g} GPU (replicas x workers_per_replica x tensor_parallel_size), but the cluster holds {fits} at most "
            f"({pods})"]


def gpu_request_problems(cluster: dict, at: str) -> list[str]:
    """Kubernetes refuses pods whose extended resources (GPUs) have requests unequal to limits."""
    problems = []
    groups = [("headGroupSpec", cluster["headGroupSpec"])] + [
        (f"workerGroupSpecs[{i}]", g) for i, g in enumerate(cluster.get("workerGroupSpecs") or [])]
    for name, group in groups:
        for c, container in enumerate(group["template"]["spec"]["containers"]):
            res = container.get("resources") or {}
            limits, requests = res.get("limits") or {}, res.get("requests") or {}
            for key in sorted(k for k in requests if k.endswith("gpu")):
                if str(requests[key]) != str(limits.get(key)):
                    problems.append(f"{at}.{name}.template.spec.containers[{c}].resources: "
                                    f"{key} request {requests[key]!r} must equal its limit "
                                    f"{limits.get(key)!r}")
    return problems


def rayservice_problems(body: dict) -> list[str]:
    cluster = body["spec"]["rayClusterConfig"]
    try:
        problems, apps = serve_problems(serve_config(body))
    except ManifestError as e:
        return [str(e)]
    for name, config in apps:
        problems += capacity_problems(cluster, config, name)
    return problems + gpu_request_problems(cluster, "spec.rayClusterConfig")


def rayjob_problems(spec: dict) -> list[str]:
    problems = []
    argv = shlex.split(spec.get("entrypoint", ""))
    if len(argv) > 2 and os.path.basename(argv[0]).startswith("python") and argv[1] == "-m" \
            and importlib.util.find_spec(argv[2]) is None:
        problems.append(f"spec.entrypoint: module {argv[2]!r} does not exist")
    if spec.get("rayClusterSpec"):
        problems += gpu_request_problems(spec["rayClusterSpec"], "spec.rayClusterSpec")
    return problems


def validate(resource: Resource, crds: CRDs) -> list[str]:
    """Every problem of one manifest document, each prefixed with where it is."""
    body = resource.body
    if not isinstance(body, dict) or "apiVersion" not in body or "kind" not in body:
        return [f"{resource.label}: not a Kubernetes object (no apiVersion and kind)"]
    validator = crds.validator(body["apiVersion"], body["kind"])
    if validator is None:
        return [f"{resource.label}: no CRD in the CRD folder serves {body['apiVersion']} "
                f"{body['kind']}"]
    body = with_defaults(validator.schema, copy.deepcopy(body))
    problems = schema_problems(validator, body)
    # the checks below read the spec, so they need the schema's shape
    if not problems and body["kind"] == "RayService":
        problems = rayservice_problems(body)
    elif not problems and body["kind"] == "RayJob":
        problems = rayjob_problems(body["spec"])
    return [f"{resource.label}: {p}" for p in problems]


def load(path: str) -> list[Resource]:
    """The documents a command-line argument names: '-' (stdin), a file, a kustomization folder
    (rendered), or a folder whose kustomizations and YAML files are taken recursively."""
    if path == "-":
        return [Resource(f"<stdin>, document {i}", d)
                for i, d in enumerate(yaml.load_all(sys.stdin.read(), Loader=Loader), 1) if d]
    p = Path(path)
    if p.is_file():
        return load_documents(p)
    if not p.is_dir():
        raise ManifestError(f"{path}: no such file or folder")
    if kustomization_file(p):
        return [Resource(f"{p} (kustomize) <- {r.origin}", r.body) for r in render(p)]
    found = []
    for child in sorted(p.iterdir()):
        if child.is_dir() or child.suffix in (".yaml", ".yml"):
            found += load(str(child))
    return found


def validate_paths(paths: list[str], crds: CRDs) -> tuple[list[Resource], list[str]]:
    """The documents found and every problem in them (files that fail to render or parse included)."""
    resources, problems = [], []
    for path in paths:
        try:
            found = load(path)
        except (RenderError, ManifestError) as e:
            problems.append(str(e))
            continue
        for resource in found:
            resources.append(resource)
            problems += validate(resource, crds)
    return resources, problems
