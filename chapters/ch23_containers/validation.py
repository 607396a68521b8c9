"""Chapter 23's validators: would the cluster accept a Kubernetes object, and would the job work?

`validate_object` checks an object offline, no cluster needed: core objects (Job, Service,
ResourceQuota) against Kubernetes' own schemas (`kubernetes-validate`); custom resources
(PyTorchJob, Volcano Job) with their pod templates against Kubernetes' PodTemplate schema, the
rest against the operator's own CRD schema (schemas/, cut by manifests.py's `schema_from_crd`),
then through the operator's admission checks (`admission_errors`, transcribed from its webhook)
and the course's lints of settings the operator accepts but that break the job (`lint_errors`: a
Volcano pod restarted in place, a PyTorchJob port under another name, a PyTorchJob backoff limit
that its first fault reaches; `past_backoff_limit` transcribes the operator's rule behind the
last one).

kubernetes-validate and jsonschema are imported where they are used.
"""

from __future__ import annotations

import json
import re

from chapters.ch23_containers.manifests import (
    CUSTOM,
    PYTORCH_CONTAINER,
    PYTORCH_DEFAULT_PORT,
    PYTORCH_DEFAULT_RESTART,
    PYTORCH_PORT_NAME,
    RESTARTS_IN_PLACE,
    SCHEMAS,
    is_custom,
    pod_templates,
)

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships


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


# --- Kubernetes' schemas and the CRDs' ------------------------------------------------------------

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


# --- the operators' admission webhooks, transcribed -----------------------------------------------

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


# --- the course's lints: accepted by the operator, broken as a job --------------------------------

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
