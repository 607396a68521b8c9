"""Chapter 23's Kubernetes manifests, read: their pods, the commands in them, broken copies.

The objects in k8s/ are data; this module reads them and names what the other modules check:
- `load_manifests` reads every YAML document; `pod_templates` finds the pods of a PyTorchJob, a
  Volcano Job or a batch/v1 Job; `is_custom` tells a custom resource, whose schema in schemas/
  `schema_from_crd` cut from the operator's CRD (`CRD_SOURCES`), from a core object.
- `broken_variants` makes the negative controls: copies with one error each, which
  validation.py's `validate_object` must reject.
- `course_commands` finds every command in the manifests that starts a course script, with the
  world sizes it runs at, and `validate_command` parses and validates its options.
- The names a PyTorchJob must use and the training operator's defaults (`PYTORCH_*`), which
  validation.py and launchers.py read too.

PyYAML is imported where it is used.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

CHAPTER = Path(__file__).resolve().parent
REPO = CHAPTER.parents[1]
K8S = CHAPTER / "k8s"
SCHEMAS = CHAPTER / "schemas"
# Where the schemas in schemas/ come from (schema_from_crd cut them from these CRD files).
CRD_SOURCES = {
    "pytorchjob.schema.json": ("kubeflow/training-operator", "v1.9.0",
                               "6f74c7f6b2ed6c27aabd82d0a316b23f0646059c",
                               "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"),
    "volcano-job.schema.json": ("volcano-sh/volcano", "v1.15.1",
                                "0a56ed331897f5455916a44d3075671376d731d6",
                                "config/crd/volcano/bases/batch.volcano.sh_jobs.yaml"),
}
# Kubeflow training-operator v1.9.0, pkg/apis/kubeflow.org/v1/pytorch_types.go: the container the
# operator configures, the port it reads MASTER_PORT from, and that port's default.
PYTORCH_CONTAINER, PYTORCH_PORT_NAME, PYTORCH_DEFAULT_PORT = "pytorch", "pytorchjob-port", 23456
# The replica restart policy the defaulter sets (PyTorchJobDefaultRestartPolicy) and the ones whose
# container restarts PastBackoffLimit counts (v1.9.0 pkg/core/job.go).
PYTORCH_DEFAULT_RESTART, RESTARTS_IN_PLACE = "OnFailure", ("OnFailure", "Always", "ExitCode")
CUSTOM = {("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.schema.json",
          ("batch.volcano.sh/v1alpha1", "Job"): "volcano-job.schema.json"}
SCRIPT_RE = re.compile(r"chapters/(ch\d\d_\w+)/(\w+)\.py")


# --- reading manifests ----------------------------------------------------------------------------

def load_manifests(folder: Path = K8S) -> list[tuple[str, dict]]:
    """(file name, object) for every YAML document in the folder, in file order."""
    import yaml  # PyYAML (a dependency of kubernetes-validate)

    out = []
    for path in sorted(folder.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def is_custom(obj: dict) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in CUSTOM


def pod_templates(obj: dict) -> list[tuple[str, dict, int]]:
    """(role, pod template, replicas) of a PyTorchJob, Volcano Job or batch/v1 Job."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if obj.get("apiVersion") == "kubeflow.org/v1" and kind == "PyTorchJob":
        return [(role, r.get("template") or {}, r.get("replicas", 1))
                for role, r in (spec.get("pytorchReplicaSpecs") or {}).items()]
    if obj.get("apiVersion") == "batch.volcano.sh/v1alpha1" and kind == "Job":
        return [(t.get("name"), t.get("template") or {}, t.get("replicas", 1))
                for t in spec.get("tasks") or []]
    if obj.get("apiVersion") == "batch/v1" and kind == "Job":
        return [("pod", spec.get("template") or {}, spec.get("completions", 1))]
    return []


# --- the custom resources' schemas, cut from the operators' CRDs ----------------------------------

def schema_from_crd(crd: dict, source: str) -> dict:
    """A JSON schema (Draft 2020-12) from a CustomResourceDefinition's openAPIV3Schema (its
    storage version): descriptions dropped; every pod `template` replaced by {"type": "object"}
    (those are validated against Kubernetes' own PodTemplate schema instead); an object with
    `properties` and neither `additionalProperties` nor x-kubernetes-preserve-unknown-fields gets
    `additionalProperties: false`, as the API server's strict field validation (kubectl's
    default, --validate=strict) refuses unknown fields of a structural schema."""
    version = next(v for v in crd["spec"]["versions"] if v.get("storage", True))

    def convert(node, key=None):
        if isinstance(node, list):
            return [convert(v) for v in node]
        if not isinstance(node, dict):
            return node
        if key == "template" and "spec" in node.get("properties", {}):
            return {"type": "object"}
        out = {}
        for k, v in node.items():
            if k == "description":
                continue
            out[k] = ({pk: convert(pv, pk) for pk, pv in v.items()} if k == "properties"
                      else convert(v))
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out

    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": source,
            **convert(version["schema"]["openAPIV3Schema"])}


def write_schema_from_crd(crd_yaml: Path, name: str) -> Path:
    """Regenerate schemas/<name> from a CRD file checked out at the commit CRD_SOURCES names."""
    import yaml

    repo, tag, commit, path = CRD_SOURCES[name]
    source = (f"Cut by chapters/ch23_containers/manifests.py:schema_from_crd from {repo} {tag} "
              f"(commit {commit}), {path}. Pod templates are validated separately, against "
              "Kubernetes' PodTemplate schema.")
    out = SCHEMAS / name
    out.write_text(json.dumps(schema_from_crd(yaml.safe_load(Path(crd_yaml).read_text()), source),
                              indent=1, sort_keys=True) + "\n")
    return out


# --- negative controls: broken copies -------------------------------------------------------------

def broken_variants(obj: dict) -> list[tuple[str, dict]]:
    """Negative controls: the object with a required field removed, and with a wrong type, each
    of which a validator must reject (a custom resource's are broken in the part the CRD schema
    checks and in a pod template, which Kubernetes' schema checks); for a custom resource also
    the pitfalls the admission webhook and the lints catch: a PyTorchJob whose container is not
    named `pytorch` or whose port is not named `pytorchjob-port`, a (non-elastic) PyTorchJob whose
    `backoffLimit` equals its pod count (one fault reaches it), a Volcano Job whose pods restart in
    place (`restartPolicy: OnFailure`)."""
    out = []
    if obj.get("kind") == "PyTorchJob" and "elasticPolicy" not in obj["spec"]:
        b = copy.deepcopy(obj)
        pods = sum(r.get("replicas", 1) for r in b["spec"]["pytorchReplicaSpecs"].values())
        b["spec"].setdefault("runPolicy", {})["backoffLimit"] = pods
        out.append(("PyTorchJob backoffLimit = its pod count", b))
    if obj.get("kind") == "PyTorchJob":
        b = copy.deepcopy(obj)
        for rspec in b["spec"]["pytorchReplicaSpecs"].values():
            rspec["template"]["spec"]["containers"][0]["name"] = "trainer"
        out.append(("PyTorchJob container not named pytorch", b))
        b = copy.deepcopy(obj)
        for rspec in b["spec"]["pytorchReplicaSpecs"].values():
            for port in rspec["template"]["spec"]["containers"][0].get("ports", []):
                port.update(name="rendezvous", containerPort=29500)
        out.append(("PyTorchJob port not named pytorchjob-port", b))
    elif is_custom(obj):
        b = copy.deepcopy(obj)
        for t in b["spec"]["tasks"]:
            t["template"]["spec"]["restartPolicy"] = "OnFailure"
        out.append(("Volcano pods restarted in place (OnFailure)", b))
    if is_custom(obj):
        b = copy.deepcopy(obj)
        if obj["kind"] == "PyTorchJob":
            del b["spec"]["pytorchReplicaSpecs"]
        else:
            del b["spec"]["tasks"]
        out.append(("custom resource without its replica specs / tasks", b))
        b = copy.deepcopy(obj)
        first = (b["spec"].get("pytorchReplicaSpecs") or {}).get("Worker") or b["spec"].get("tasks", [{}])[0]
        first["replicas"] = "four"
        out.append(("replicas given as a string", b))
    templates = pod_templates(obj)
    if templates:
        b = copy.deepcopy(obj)
        _, template, _ = pod_templates(b)[0]
        del template["spec"]["containers"][0]["image"], template["spec"]["containers"][0]["name"]
        out.append(("a container without its name", b))
        b = copy.deepcopy(obj)
        _, template, _ = pod_templates(b)[0]
        template["spec"]["containers"][0]["command"] = "python train.py"  # a string, not a list
        out.append(("command given as a string", b))
    elif obj.get("kind") == "ResourceQuota":
        b = copy.deepcopy(obj)
        b["spec"]["hard"] = ["requests.nvidia.com/gpu", 8]
        out.append(("quota limits given as a list", b))
    elif obj.get("kind") == "Service":
        b = copy.deepcopy(obj)
        del b["spec"]["ports"][0]["port"]
        out.append(("a Service port without its number", b))
        b = copy.deepcopy(obj)
        b["spec"]["ports"][0]["port"] = "rendezvous"
        out.append(("a Service port given as a name", b))
    return out


# --- commands that start course scripts -----------------------------------------------------------

def _command_of(container: dict) -> list[str]:
    return [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]


def launch_worlds(obj: dict, argv: list[str]) -> list[int]:
    """The world sizes a command in this object runs at."""
    nproc = 1
    if "torchrun" in argv[0]:
        for i, w in enumerate(argv):
            if w.startswith(("--nproc-per-node", "--nproc_per_node")):
                nproc = int(w.split("=", 1)[1] if "=" in w else argv[i + 1])
    spec = obj["spec"]
    if obj["kind"] == "PyTorchJob":
        elastic = spec.get("elasticPolicy")
        if elastic:
            return [n * nproc for n in range(elastic["minReplicas"], elastic["maxReplicas"] + 1)]
        per_pod = int(spec.get("nprocPerNode", "1")) if spec.get("nprocPerNode", "1").isdigit() else 1
        return [sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values()) * per_pod]
    if obj["apiVersion"] == "batch.volcano.sh/v1alpha1":
        return [sum(t["replicas"] for t in spec["tasks"])]
    return [spec.get("completions", 1) * nproc]


def course_commands(manifests: list[tuple[str, dict]]) -> list[tuple[str, list[str], list[int]]]:
    """(where, argv, world sizes) of every container command that starts a course script."""
    out = []
    for fname, obj in manifests:
        for role, template, _ in pod_templates(obj):
            for c in template.get("spec", {}).get("containers", []):
                argv = _command_of(c)
                if any(SCRIPT_RE.fullmatch(w) for w in argv):
                    out.append((f"{fname}:{obj['metadata']['name']}/{role}", argv,
                                launch_worlds(obj, argv)))
    return out


def validate_command(argv: list[str], world: int) -> None:
    """Parse the script's options as the script will and validate them at `world` ranks:
    raises ValueError (or SystemExit from argparse) when the command would be refused."""
    from common.config import build_parser
    from tools.precheck import script_module

    i = next(i for i, w in enumerate(argv) if SCRIPT_RE.fullmatch(w))
    script = REPO / argv[i]
    if not script.is_file():
        raise ValueError(f"{argv[i]} does not exist")
    module = script_module(script)
    ns = build_parser(module.Config).parse_args(argv[i + 1:])
    module.validate(module.Config(**vars(ns)), world)
