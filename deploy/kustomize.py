"""Renders a kustomization as `kubectl kustomize` does, for the subset metrale's overlays use: `resources`,
JSON 6902 `patches` and `images`."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

# libyaml's loader reads the multi-megabyte CRDs in a second; the pure-Python one takes far longer
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images"}


class RenderError(ValueError):
    """A kustomization this renderer cannot render; the message names the file and entry."""


@dataclass
class Resource:
    origin: str          # "FILE, document N": where the resource was written
    body: dict

    @property
    def label(self) -> str:
        meta = self.body.get("metadata") if isinstance(self.body.get("metadata"), dict) else {}
        return f"{self.origin} ({self.body.get('kind', '?')} {meta.get('name', '?')})"


def kustomization_file(directory: Path) -> Path | None:
    return next((directory / n for n in KUSTOMIZATION_FILES if (directory / n).is_file()), None)


def read_yaml(path: Path) -> list:
    """The YAML documents of one file."""
    try:
        return list(yaml.load_all(path.read_text(), Loader=Loader))
    except OSError as e:
        raise RenderError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise RenderError(f"{path}: not valid YAML ({e})") from None


def load_documents(path: Path) -> list[Resource]:
    """The documents of one file (empty documents skipped, as kubectl skips them)."""
    docs = read_yaml(path)
    return [Resource(f"{path}, document {i}", doc) for i, doc in enumerate(docs, 1) if doc is not None]


def render(directory: Path) -> list[Resource]:
    """The resources the kustomization in `directory` builds, patched, with their images set."""
    kfile = kustomization_file(directory)
    if kfile is None:
        raise RenderError(f"{directory}: no kustomization.yaml")
    spec = (read_yaml(kfile) or [None])[0] or {}
    if not isinstance(spec, dict):
        raise RenderError(f"{kfile}: expected a mapping")
    unsupported = sorted(set(spec) - SUPPORTED)
    if unsupported:
        raise RenderError(f"{kfile}: {', '.join(unsupported)}: not supported by metrale's renderer "
                          f"(it renders {', '.join(sorted(SUPPORTED - {'apiVersion', 'kind'}))}); "
                          "check such a kustomization with `kubectl kustomize DIR | metrale k8s "
                          "validate -`")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = Path(os.path.normpath(directory / entry))
        if path.is_dir():
            resources += render(path)
        elif path.is_file():
            resources += load_documents(path)
        else:
            raise RenderError(f"{kfile}: resources: {entry} does not exist")
    for i, patch in enumerate(spec.get("patches", [])):
        apply_patch(resources, patch, directory, f"{kfile}: patches[{i}]")
    for image in spec.get("images", []):
        for r in resources:
            set_image(r.body, image)
    return resources


def apply_patch(resources: list[Resource], patch: dict, directory: Path, where: str) -> None:
    if set(patch) - {"path", "patch", "target"}:
        raise RenderError(f"{where}: {', '.join(sorted(set(patch) - {'path', 'patch', 'target'}))}: "
                          "not supported by metrale's renderer")
    if "path" in patch:
        ops = (read_yaml(directory / patch["path"]) or [None])[0]
    else:
        try:
            ops = yaml.load(patch.get("patch", ""), Loader=Loader)
        except yaml.YAMLError as e:
            raise RenderError(f"{where}: not valid YAML ({e})") from None
    if not isinstance(ops, list):
        # strategic merge needs each list's merge key, which kustomize guesses for custom resources
        raise RenderError(f"{where}: only JSON 6902 patches (a list of operations) are supported")
    if "target" not in patch:
        raise RenderError(f"{where}: a JSON 6902 patch needs a target")
    matched = [r for r in resources if selects(patch["target"], r.body)]
    if not matched:
        raise RenderError(f"{where}: target {patch['target']} matches no resource")
    for r in matched:
        for n, op in enumerate(ops):
            try:
                apply_operation(r.body, op)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise RenderError(f"{where}: operation {n} ({op.get('op')} {op.get('path')}) on "
                                  f"{r.label}: {e}") from None


def selects(target: dict, body: dict) -> bool:
    group, _, version = body.get("apiVersion", "").rpartition("/")
    actual = {"group": group, "version": version, "kind": body.get("kind", ""),
              "name": body.get("metadata", {}).get("name", ""),
              "namespace": body.get("metadata", {}).get("namespace", "")}
    unknown = set(target) - set(actual)
    if unknown:
        raise RenderError(f"target: {', '.join(sorted(unknown))}: not supported by metrale's renderer")
    # kustomize matches each selector field as an anchored regular expression
    return all(re.fullmatch(str(want), actual[key]) for key, want in target.items())


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError("a JSON pointer starts with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def apply_operation(doc: dict, op: dict) -> None:
    """One RFC 6902 operation (add, remove, replace, test) on `doc`, in place."""
    *parents, last = _pointer(op["path"])
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    kind = op["op"]
    if isinstance(node, list):
        index = len(node) if (kind == "add" and last == "-") else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
            return
        node[index]   # raises IndexError for a missing element
    elif kind in ("remove", "replace", "test") and last not in node:
        raise KeyError(last)
    else:
        index = last
    if kind in ("add", "replace"):
        node[index] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[index]
    elif kind == "test":
        if node[index] != op["value"]:
            raise ValueError(f"test failed: the value is {node[index]!r}")
    else:
        raise ValueError(f"unsupported operation {kind!r} (add, remove, replace, test)")


def _split_image(image: str) -> tuple[str, str]:
    """'registry:5000/name:tag@sha256:...' -> ('registry:5000/name', ':tag@sha256:...')."""
    name, at, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon:] + at + digest
    return name, at + digest


def set_image(node, image: dict) -> None:
    """kustomize's `images` for custom resources: every container (or init container) anywhere in the
    object whose image name is `image['name']` gets the new name, tag or digest."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    name, suffix = _split_image(str(container.get("image", "")))
                    if name == image["name"]:
                        if "digest" in image:
                            suffix = "@" + image["digest"]
                        elif "newTag" in image:
                            suffix = ":" + str(image["newTag"])
                        container["image"] = image.get("newName", name) + suffix
            set_image(value, image)
    elif isinstance(node, list):
        for item in node:
            set_image(item, image)
