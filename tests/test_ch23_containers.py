"""Chapter 23: the Dockerfile lints and does what the lesson says; the manifests pass Kubernetes'
schemas (core objects, the custom resources' pod templates), the operators' CRD schemas and
webhooks and the course's lints (the rest), broken copies do not; every command in them starts a
course script with options valid at its world size; each launcher's environment (PyTorchJob,
elastic PyTorchJob, Volcano, indexed Job, Slurm) is read right by common's setup, and a wrong
mapping is caught. One real launch: the PyTorchJob's container command, run as two plain
processes with the operator's variables."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from chapters.ch23_containers import orchestration as o
from chapters.ch23_containers import train
from common.distributed import DistributedSetupError, choose_device_and_backend, read_launch_env

MANIFESTS = o.load_manifests()
BY_NAME = {obj["metadata"]["name"]: obj for _, obj in MANIFESTS}


def reading(env: dict) -> tuple:
    r = read_launch_env(env)
    return r["rank"], r["world_size"], r["local_rank"], r["local_world_size"], r["master_addr"], r["master_port"]


# --- the Dockerfile -----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_dockerfile_lints_clean_and_does_what_the_lesson_says(tmp_path):
    rc, findings = o.hadolint()
    assert rc == 0, findings
    facts = o.dockerfile_facts()
    assert facts["base"].startswith("pytorch/pytorch:") and "cuda" in facts["base"]
    assert "requirements.txt" in facts["copied"]
    assert any("pip install" in r and "requirements.txt" in r for r in facts["runs"])
    assert facts["user"] == "1001:1001" and o.dockerfile_problems(facts) == []
    # The base carries the pinned torch, for the pinned wheel's CUDA; PYTORCH_VERSION says so.
    pin = o.pinned_version("torch")
    assert pin == "2.14.1" and o.base_image_versions(facts["base"]) == {"torch": pin, "cuda": "13.0"}
    assert facts["env"]["PYTORCH_VERSION"] == pin and facts["env"]["PIP_BREAK_SYSTEM_PACKAGES"] == "1"
    # The CMD starts one rank per GPU: torchrun's "gpu" (torch.distributed.run), valid at the GPU
    # counts a node has; the script's options are valid there.
    assert facts["cmd"][:3] == ["torchrun", "--standalone", "--nproc_per_node=gpu"]
    for world in (1, 2, 4, 8):
        o.validate_command(facts["cmd"], world)
    # Negative controls: each promise broken once is caught; hadolint rejects an unpinned base.
    text = o.DOCKERFILE.read_text()
    base = "pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime"
    broken = {"latest": text.replace(base, "pytorch/pytorch:latest"),
              "old base": text.replace(base, "pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime"),
              "other cuda": text.replace(base, "pytorch/pytorch:2.14.1-cuda12.6-cudnn9-runtime"),
              "stale PYTORCH_VERSION": text.replace("PYTORCH_VERSION=2.14.1", "PYTORCH_VERSION=2.9.1"),
              "two ranks": text.replace("--nproc_per_node=gpu", "--nproc_per_node=2"),
              "root": text.replace("USER 1001:1001", "USER root"),
              "no user": text.replace("USER 1001:1001\n", ""),
              "no pins": text.replace("requirements.txt pyproject.toml", "pyproject.toml")
                             .replace("-r /tmp/pins.txt", "torch==2.14.1")}
    for name, variant in broken.items():
        path = tmp_path / f"Dockerfile.{name.replace(' ', '_')}"
        path.write_text(variant)
        assert variant != text and o.dockerfile_problems(o.dockerfile_facts(path)), name
    rc, findings = o.hadolint(tmp_path / "Dockerfile.latest")
    assert rc != 0 and "DL3007" in findings
    # A base whose tag does not name its torch and CUDA (NGC's) cannot be checked against the pin,
    # and torchrun started as `python -m torch.distributed.run` is still held to one rank per GPU.
    ngc = {**facts, "base": "nvcr.io/nvidia/pytorch:25.01-py3"}
    assert any(p.startswith("cannot read torch and CUDA") for p in o.dockerfile_problems(ngc))
    module = {**facts, "cmd": ["python", "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", "chapters/ch23_containers/train.py"]}
    assert o.dockerfile_problems(module) == ["the command starts 2 ranks, not one per GPU (--nproc_per_node=gpu)"]
    spaced = {**module, "cmd": [w.replace("=2", "") for w in module["cmd"]]}
    spaced["cmd"].insert(spaced["cmd"].index("--nproc_per_node") + 1, "gpu")
    assert o.dockerfile_problems(spaced) == []  # the same module, one rank per GPU: accepted


@pytest.mark.timeout(30)
def test_pinned_torch_cuda_and_the_driver_it_needs():
    """torch.version.cuda of the pinned wheel is 13.0 (read live where this environment is the
    pinned CUDA build); CUDA 13.x needs driver branch 580 (NVIDIA's CUDA Compatibility guide,
    "Minor Version Compatibility", Table 1: 13.x >= 580, 12.x >= 525, 11.x >= 450), which the
    Dockerfile and the lesson state."""
    import torch

    if torch.__version__.split("+")[0] == o.pinned_version("torch") and torch.version.cuda:
        assert torch.version.cuda == o.PINNED_TORCH_CUDA, torch.version.cuda
    assert (o.min_driver("13.0"), o.min_driver("12.8"), o.min_driver("11.8")) == (580, 525, 450)
    need = o.min_driver(o.PINNED_TORCH_CUDA)
    assert f"driver >= {need}" in o.DOCKERFILE.read_text()
    readme = (o.CHAPTER / "README.md").read_text()
    assert f"branch {need} and later" in readme and "580.65.06" in readme
    # What the image's CMD prints where CUDA is unusable (no GPU here; a driver too old there):
    # torchrun's --nproc_per_node=gpu stops with torch's own message, which the lesson quotes.
    from torch.distributed.run import determine_local_world_size

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^Cuda is not available.$"):
            determine_local_world_size("gpu")
    assert "ValueError: Cuda is not available." in readme
    assert "The NVIDIA driver on your system is too old" in readme


# --- the manifests ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_manifests_pass_both_validators_and_broken_copies_fail():
    kinds = sorted(f"{obj['apiVersion']}/{obj['kind']}" for _, obj in MANIFESTS)
    assert kinds == ["batch.volcano.sh/v1alpha1/Job", "batch/v1/Job", "kubeflow.org/v1/PyTorchJob",
                     "kubeflow.org/v1/PyTorchJob", "v1/Namespace", "v1/ResourceQuota", "v1/Service"]
    for fname, obj in MANIFESTS:
        assert o.validate_object(obj) == [], fname
    for fname, obj in MANIFESTS:
        for what, broken in o.broken_variants(obj):
            assert o.validate_object(broken), f"{fname}: {what} passed"
    # Each check on its own: the CRD schema catches a PyTorchJob without replica specs and a
    # string for replicas; Kubernetes' schema the pod template's errors; the webhook a container
    # not named pytorch; the lint a port not named pytorchjob-port.
    job = BY_NAME["ch23-ddp"]
    variants = dict(o.broken_variants(job))
    schema = o.json.loads((o.SCHEMAS / "pytorchjob.schema.json").read_text())
    assert o._schema_errors(job, schema) == []
    for what in ("custom resource without its replica specs / tasks", "replicas given as a string"):
        assert o._schema_errors(variants[what], schema), what
    for what in ("a container without its name", "command given as a string"):
        assert not o._schema_errors(variants[what], schema)  # the CRD schema leaves pods alone
        assert any("pod template" in e for e in o.validate_object(variants[what])), what
    assert [e.split(":")[0] for e in o.validate_object(variants["PyTorchJob container not named pytorch"])] \
        == ["admission webhook", "admission webhook"]  # Master and Worker
    assert all(e.startswith("lint:") for e in o.validate_object(variants["PyTorchJob port not named pytorchjob-port"]))
    # The GPU, shared-memory and quota promises.
    for _, obj in MANIFESTS:
        for role, template, _ in o.pod_templates(obj):
            c = template["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, role
            shm = [v for v in template["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            assert shm and {"name": shm[0]["name"], "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert BY_NAME["ch23-gang"]["spec"]["minAvailable"] == 4
    assert BY_NAME["course-quota"]["spec"]["hard"]["requests.nvidia.com/gpu"] == "8"


@pytest.mark.timeout(30)
def test_schemas_are_cut_from_the_operators_crds():
    """The schemas in schemas/ are the operators' CRD schemas (source and commit recorded),
    strict about unknown fields; schema_from_crd does what its docstring says."""
    for name, (repo, tag, commit, path) in o.CRD_SOURCES.items():
        schema = o.json.loads((o.SCHEMAS / name).read_text())
        assert all(x in schema["$comment"] for x in (repo, tag, commit, path)), name
        assert schema["additionalProperties"] is False and schema["properties"]["spec"]["additionalProperties"] is False
    ptj = o.json.loads((o.SCHEMAS / "pytorchjob.schema.json").read_text())
    assert ptj["properties"]["spec"]["required"] == ["pytorchReplicaSpecs"]  # as the CRD says
    # strict: a misspelt field is refused (the API server's strict field validation), the
    # correct one passes
    job = copy.deepcopy(BY_NAME["ch23-ddp"])
    assert o._schema_errors(job, ptj) == []
    job["spec"]["nprocsPerNode"] = job["spec"].pop("nprocPerNode")
    assert any("nprocsPerNode" in e for e in o._schema_errors(job, ptj))
    crd = {"spec": {"versions": [{"name": "v1", "storage": True, "schema": {"openAPIV3Schema": {
        "type": "object", "description": "x", "properties": {"spec": {"type": "object", "properties": {
            "template": {"type": "object", "properties": {"spec": {"type": "object"}}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                     "properties": {"a": {"type": "string"}}},
            "n": {"type": "integer", "description": "y"}}}}}}}]}}
    cut = o.schema_from_crd(crd, "src")
    spec = cut["properties"]["spec"]
    assert cut["$comment"] == "src" and "description" not in cut and "description" not in spec["properties"]["n"]
    assert spec["properties"]["template"] == {"type": "object"} and spec["additionalProperties"] is False
    assert "additionalProperties" not in spec["properties"]["free"]


@pytest.mark.timeout(30)
def test_pytorchjob_container_and_port_names():
    """The operator configures the container named pytorch (its webhook refuses a replica
    without one) and reads MASTER_PORT from its port named pytorchjob-port, adding 23456 when
    there is none: a port named otherwise is silently replaced (training-operator v1.9.0)."""
    job = BY_NAME["ch23-ddp"]
    assert o.pytorchjob_admission_errors(job) == [] and o.lint_errors(job) == []
    renamed = dict(o.broken_variants(job))["PyTorchJob container not named pytorch"]
    errors = o.pytorchjob_admission_errors(renamed)
    assert errors == [f"spec.pytorchReplicaSpecs[{r}].template.spec.containers: must have at least one "
                      "container with name pytorch" for r in ("Master", "Worker")]
    other_port = dict(o.broken_variants(job))["PyTorchJob port not named pytorchjob-port"]
    assert o.pytorchjob_admission_errors(other_port) == []  # the operator accepts it ...
    assert len(o.lint_errors(other_port)) == 2  # ... the lint does not
    declared = other_port["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["ports"]
    assert declared == [{"name": "rendezvous", "containerPort": 29500}]
    assert {e["MASTER_PORT"] for _, e in o.pytorchjob_pods(other_port)} == {"23456"}  # not 29500
    # The other rules of the webhook, each on its own
    two_masters = copy.deepcopy(job)
    two_masters["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    assert o.pytorchjob_admission_errors(two_masters) == ["spec.pytorchReplicaSpecs[Master].replicas: must be 1"]
    chief = copy.deepcopy(job)
    chief["spec"]["pytorchReplicaSpecs"]["Chief"] = chief["spec"]["pytorchReplicaSpecs"].pop("Master")
    assert any("Unsupported value" in e for e in o.pytorchjob_admission_errors(chief))
    elastic = copy.deepcopy(BY_NAME["ch23-elastic"])
    assert o.pytorchjob_admission_errors(elastic) == []
    elastic["spec"]["pytorchReplicaSpecs"]["Master"] = elastic["spec"]["pytorchReplicaSpecs"].pop("Worker")
    assert any("elastic policy" in e for e in o.pytorchjob_admission_errors(elastic))


@pytest.mark.timeout(30)
def test_pytorchjob_backoff_limit_survives_whole_job_restarts():
    """The operator sums every pod's container restarts and fails the job at runPolicy.backoffLimit
    (training-operator v1.9.0 PastBackoffLimit, transcribed in past_backoff_limit). One crashed
    rank of the 4-pod job restarts all 4 containers at least once (its peers' collectives fail;
    a restarted worker can fail again, costing more): the manifest's limit, 13, lets the world
    re-form after up to 3 faults of 4 restarts each (the fewest a fault costs) and fails the job
    at the 4th; 3, the old value, and 4, the pod count, end it at the first fault, and the lint
    refuses both."""
    job = BY_NAME["ch23-ddp"]
    pods = [h for h, _ in o.pytorchjob_pods(job)]
    one_fault = {h: 1 for h in pods}  # rank 0's crash, then its 3 peers' restarts
    assert job["spec"]["runPolicy"]["backoffLimit"] == 13 and o.lint_errors(job) == []
    for faults, failed in ((1, False), (3, False), (4, True)):
        assert o.past_backoff_limit(job, {h: faults for h in pods}) is failed, faults
    assert not o.past_backoff_limit(job, {pods[0]: 3})  # one pod alone, 3 times: not yet
    for limit in (3, 4):  # controls: the first fault fails the job, and the lint says so
        low = copy.deepcopy(job)
        low["spec"]["runPolicy"]["backoffLimit"] = limit
        assert o.past_backoff_limit(low, one_fault)
        assert [e.split(" ")[0] for e in o.lint_errors(low)] == ["runPolicy.backoffLimit"], limit
    edge = dict(o.broken_variants(job))["PyTorchJob backoffLimit = its pod count"]
    assert edge["spec"]["runPolicy"]["backoffLimit"] == 4 and o.validate_object(edge)
    five = copy.deepcopy(job)
    five["spec"]["runPolicy"]["backoffLimit"] = 5  # survives one fault of 4 restarts: accepted
    assert not o.past_backoff_limit(five, one_fault) and o.lint_errors(five) == []
    # Never is not counted (its pods fail instead); unset never fails; 0 fails at any restart
    never = copy.deepcopy(low)
    for r in never["spec"]["pytorchReplicaSpecs"].values():
        r["restartPolicy"] = "Never"
    assert not o.past_backoff_limit(never, one_fault) and o.lint_errors(never) == []
    unset = copy.deepcopy(job)
    del unset["spec"]["runPolicy"]["backoffLimit"]
    assert not o.past_backoff_limit(unset, {h: 99 for h in pods}) and o.lint_errors(unset) == []
    zero = copy.deepcopy(job)
    zero["spec"]["runPolicy"]["backoffLimit"] = 0
    assert o.past_backoff_limit(zero, {pods[3]: 1}) and o.lint_errors(zero)
    # The elastic job restarts its workers inside torchrun, not its containers: not linted.
    assert "PyTorchJob backoffLimit = its pod count" not in dict(o.broken_variants(BY_NAME["ch23-elastic"]))


@pytest.mark.timeout(30)
def test_volcano_pods_fail_so_that_job_policies_act():
    """restartPolicy Never on every task of a Volcano Job with a PodFailed policy; the lint
    refuses OnFailure (and the pod default, Always), and only where such a policy exists."""
    job = BY_NAME["ch23-gang"]
    assert {t["name"]: t["template"]["spec"]["restartPolicy"] for t in job["spec"]["tasks"]} \
        == {"master": "Never", "worker": "Never"}
    assert [p["event"] for p in job["spec"]["policies"]] == ["PodEvicted", "PodFailed"]
    assert o.volcano_admission_errors(job) == [] and o.lint_errors(job) == []
    on_failure = dict(o.broken_variants(job))["Volcano pods restarted in place (OnFailure)"]
    assert [e.split(":")[0] for e in o.lint_errors(on_failure)] == ["task master", "task worker"]
    default = copy.deepcopy(job)
    for t in default["spec"]["tasks"]:
        del t["template"]["spec"]["restartPolicy"]  # the pod default: Always
    assert len(o.lint_errors(default)) == 2
    no_policy = copy.deepcopy(on_failure)
    no_policy["spec"]["policies"] = [{"event": "PodEvicted", "action": "RestartJob"}]
    assert o.lint_errors(no_policy) == []  # eviction deletes the pod: OnFailure does not hide it
    # Volcano's webhook rules (transcribed): tasks, task names, minAvailable, events, plugins
    for change, words in ((lambda j: j["spec"].update(tasks=[]), "No task"),
                          (lambda j: j["spec"].update(minAvailable=5), "minAvailable"),
                          (lambda j: j["spec"]["tasks"][1].update(name="master"), "duplicated task"),
                          (lambda j: j["spec"]["policies"].append({"event": "PodFailed", "action": "AbortJob"}),
                           "duplicate event"),
                          (lambda j: j["spec"]["plugins"].update(pytoch=[]), "unable to find job plugin")):
        bad = copy.deepcopy(job)
        change(bad)
        assert any(words in e for e in o.volcano_admission_errors(bad)), words


@pytest.mark.timeout(60)
def test_check_jsonschema_cli_agrees(tmp_path):
    """The command the lesson shows: check-jsonschema with the Volcano CRD's schema in schemas/"""
    exe = str(o.Path(sys.executable).parent / "check-jsonschema")
    schema = str(o.SCHEMAS / "volcano-job.schema.json")
    ok = subprocess.run([exe, "--schemafile", schema, str(o.K8S / "volcano-job.yaml")],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((o.K8S / "volcano-job.yaml").read_text().replace("minAvailable: 4", "minAvailable: four"))
    fail = subprocess.run([exe, "--schemafile", schema, str(bad)], capture_output=True, text=True, timeout=60)
    assert fail.returncode == 1 and "minAvailable" in fail.stdout


@pytest.mark.timeout(60)
def test_every_manifest_command_starts_a_course_script_with_valid_options():
    commands = o.course_commands(MANIFESTS)
    assert len(commands) == 6
    worlds = {where.split(":")[1]: w for where, _, w in commands}
    assert worlds == {"ch23-ddp/Master": [4], "ch23-ddp/Worker": [4], "ch23-elastic/Worker": [2, 3, 4],
                      "ch23-gang/master": [4], "ch23-gang/worker": [4], "ch23-indexed/pod": [4]}
    for _, argv, ws in commands:
        for w in ws:
            o.validate_command(argv, w)
    # Negative controls: an option the script lacks, a batch the world cannot split.
    argv = commands[0][1]
    with pytest.raises(SystemExit):
        o.validate_command([*argv, "--no-such-option"], 4)
    with pytest.raises(ValueError, match="global"):
        o.validate_command([*argv, "--global-batch-size", "10"], 4)
    with pytest.raises(ValueError, match="does not exist"):
        o.validate_command(["python", "chapters/ch23_containers/trian.py"], 4)


# --- each launcher's environment, read by common's setup ----------------------------------------

@pytest.mark.timeout(60)
def test_pytorchjob_environment():
    pods = o.pytorchjob_pods(BY_NAME["ch23-ddp"])
    assert [h for h, _ in pods] == ["ch23-ddp-master-0", *(f"ch23-ddp-worker-{i}" for i in range(3))]
    assert pods[1][1] == {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": "ch23-ddp-master-0", "MASTER_PORT": "23456",
                          "PET_MASTER_ADDR": "ch23-ddp-master-0", "PET_MASTER_PORT": "23456",
                          "WORLD_SIZE": "4", "RANK": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
                          "PET_NNODES": "4"}
    want = [(r, 4, 0, 1, "ch23-ddp-master-0", 23456) for r in range(4)]
    assert [reading(env) for _, env in pods] == want
    assert o.check_world(pods) == []
    # One GPU per pod: the pod's process takes cuda:0. Read as before this chapter (no LOCAL_*
    # meant "every rank on this node"), the pod would look like 4 processes sharing one GPU.
    r = read_launch_env(pods[2][1])
    assert choose_device_and_backend(r["local_rank"], r["local_world_size"], gpu_count=1, env={})[0].index == 0
    with pytest.raises(DistributedSetupError, match="4 processes on this node but 1 GPU"):
        choose_device_and_backend(r["local_rank"], r["world_size"], gpu_count=1, env={})
    # Negative control: a mapping that forgets the operator's worker offset (rank = index).
    wrong = [(h, {**env, "RANK": h.rsplit("-", 1)[1]}) for h, env in pods]
    assert any("ranks read" in p for p in o.check_world(wrong))


@pytest.mark.timeout(60)
def test_elastic_pytorchjob_environment_is_torchruns_defaults(monkeypatch):
    from torch.distributed.run import parse_args

    job = BY_NAME["ch23-elastic"]
    pods = o.pytorchjob_pods(job)
    env = pods[1][1]
    # nprocPerNode defaults to "auto" (pytorch_defaults.go), which envvar.go hands on as it is.
    assert env == {"PYTHONUNBUFFERED": "1", "PET_RDZV_ENDPOINT": "ch23-elastic-worker-0:23456",
                   "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:4", "PET_MAX_RESTARTS": "10",
                   "PET_NPROC_PER_NODE": "auto"}
    argv = o.course_commands([("x", job)])[0][1]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = parse_args(argv[1:])  # torch's own torchrun parser, PET_* as its defaults
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_backend, args.max_restarts, args.nproc_per_node) \
        == ("2:4", "ch23-elastic-worker-0:23456", "c10d", 10, "1")
    # The manifest's --nproc-per-node=1 is needed: without it torchrun takes the operator's "auto"
    # (one process per GPU, or per CPU core on a node without one).
    assert parse_args([w for w in argv[1:] if not w.startswith("--nproc")]).nproc_per_node == "auto"
    for k in env:  # negative control: without the operator's variables torchrun is one node
        monkeypatch.delenv(k)
    assert (parse_args(argv[1:]).nnodes, parse_args(argv[1:]).rdzv_backend) == ("1:1", "static")


@pytest.mark.timeout(60)
def test_volcano_environment():
    pods = o.volcano_pods(BY_NAME["ch23-gang"])
    env = pods[2][1]  # worker 1
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VC_TASK_INDEX",
                                "VK_TASK_INDEX", "VC_MASTER_NUM", "VC_WORKER_NUM")} == {
        "RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "ch23-gang-master-0.ch23-gang",
        "MASTER_PORT": "23456", "VC_TASK_INDEX": "1", "VK_TASK_INDEX": "1", "VC_MASTER_NUM": "1",
        "VC_WORKER_NUM": "3"}
    assert env["VC_WORKER_HOSTS"].split(",")[0] == "ch23-gang-worker-0.ch23-gang"
    want = [(r, 4, 0, 1, "ch23-gang-master-0.ch23-gang", 23456) for r in range(4)]
    assert [reading(e) for _, e in pods] == want and o.check_world(pods) == []
    wrong = [(h, {**e, "RANK": e["VC_TASK_INDEX"]}) for h, e in pods]  # the task index is not the rank
    assert any("ranks read [0, 0, 1, 2]" in p for p in o.check_world(wrong))
    # A third task (say a TensorBoard pod) is not in the world: volcano v1.12 on counts the
    # master and worker tasks only (commit ae092898e); the svc plugin still lists its hosts.
    job = copy.deepcopy(BY_NAME["ch23-gang"])
    job["spec"]["tasks"].append({**copy.deepcopy(job["spec"]["tasks"][0]), "name": "board", "replicas": 1})
    env = o.volcano_env(job, "worker", 0)
    assert (env["WORLD_SIZE"], env["VC_BOARD_NUM"]) == ("4", "1")


@pytest.mark.timeout(60)
def test_indexed_job_environment():
    pods = o.indexed_job_pods(BY_NAME["ch23-indexed"])
    assert [h for h, _ in pods] == [f"ch23-indexed-{i}.ch23-indexed" for i in range(4)]
    want = [(r, 4, 0, 1, "ch23-indexed-0.ch23-indexed", 29500) for r in range(4)]
    assert [reading(e) for _, e in pods] == want and o.check_world(pods) == []
    # Negative control: the manifest without WORLD_SIZE: every pod reads a world of one.
    wrong = [(h, {k: v for k, v in e.items() if k != "WORLD_SIZE"}) for h, e in pods]
    assert o.check_world(wrong)


@pytest.mark.timeout(60)
def test_slurm_environment():
    pods = o.slurm_pods(nodes=2, tasks_per_node=4)
    assert pods[5][1]["SLURM_JOB_NODELIST"] == "gpu[01-02]" and pods[5][1]["SLURM_TASKS_PER_NODE"] == "4(x2)"
    want = [(p, 8, p % 4, 4, "gpu01", 20000 + 4242) for p in range(8)]
    assert [reading(e) for _, e in pods] == want and o.check_world(pods) == []
    wrong = [(h, {**e, "SLURM_PROCID": e["SLURM_LOCALID"]}) for h, e in pods]  # rank = local id
    assert o.check_world(wrong)
    wrong = [(h, {k: v for k, v in e.items() if k != "SLURM_LOCALID"}) for h, e in pods]
    assert any("same local rank" in p for p in o.check_world(wrong))


# --- one real launch ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(150)
def test_pytorchjob_pods_train_as_plain_processes(tmp_path):
    """The PyTorchJob's container command, `python .../train.py --steps 20`, in two processes
    with the operator's variables for a 1 Master + 1 Worker job: no torchrun, no LOCAL_*."""
    job = copy.deepcopy(BY_NAME["ch23-ddp"])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
    pods = o.pytorchjob_pods(job)
    argv = o.course_commands([("pytorchjob.yaml", job)])[0][1]
    codes, output, summary = o.run_pods(pods, argv, tmp_path, timeout=120)
    assert codes == [0, 0], output[-3000:]
    assert summary["world_size"] == 2 and summary["config"]["steps"] == 20
    checks = {c["name"]: c for c in summary["checks"]}
    assert all(c["ok"] for c in checks.values()), [c for c in checks.values() if not c["ok"]]
    assert checks["launch read: world problems"]["measured"] == 0
    assert checks["DDP == one process (max |dparam|)"]["measured"] <= 1e-12
    assert checks["broken manifests rejected"]["measured"] == checks["broken manifests rejected"]["expected"] > 0


@pytest.mark.timeout(30)
def test_live_world_check_can_fail():
    """train.py's live check on what the ranks read: a torchrun world of 2 passes; each kind of
    misreading is found."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    good = [("vm", read_launch_env(env)), ("vm", read_launch_env({**env, "RANK": "1", "LOCAL_RANK": "1"}))]
    assert train.world_problems(good) == []
    assert train.world_problems([good[0], good[0]]) == ["ranks [0, 0]"]
    assert train.world_problems([good[0], ("vm", {**good[1][1], "world_size": 3})]) == ["world sizes disagree"]
    assert train.world_problems([good[0], ("vm", {**good[1][1], "master_port": 1})]) \
        == ["rendezvous addresses disagree"]
    # LOCAL_RANK=1 read with a local world of 1 (LOCAL_WORLD_SIZE ignored)
    assert train.world_problems([good[0], ("vm", {**good[1][1], "local_world_size": 1})]) \
        == ["a local rank outside its local world"]


@pytest.mark.timeout(30)
def test_defaults_and_refusal():
    for w in (1, 2, 3, 4, 8, 16):
        train.validate(train.Config(), w)
    with pytest.raises(ValueError):
        train.validate(train.Config(global_batch_size=10), 4)


@pytest.mark.timeout(30)
def test_exercise_1_node_rank_is_not_process_rank(monkeypatch):
    from torch.distributed.run import parse_args

    job = copy.deepcopy(BY_NAME["ch23-ddp"])
    job["spec"]["nprocPerNode"] = "4"
    env = o.pytorchjob_env(job, "Worker", 2)
    assert (env["WORLD_SIZE"], env["RANK"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("16", "3", "3", "4")
    # What torchrun makes of it (its own parser, PET_* as defaults): node 3 of 4, 4 processes, the
    # Master's address (from PET_MASTER_*), so the static rendezvous gives ranks 12-15.
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = parse_args(["chapters/ch23_containers/train.py"])
    assert (args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr, args.master_port) \
        == ("4", 3, "4", "ch23-ddp-master-0", 23456)
    assert [args.node_rank * int(args.nproc_per_node) + r for r in range(4)] == [12, 13, 14, 15]
    monkeypatch.delenv("PET_MASTER_ADDR")  # without it torchrun would look for rank 0 on itself
    assert parse_args(["chapters/ch23_containers/train.py"]).master_addr == "127.0.0.1"


@pytest.mark.timeout(30)
def test_slurm_in_a_pyxis_container_with_enroots_pytorch_hook():
    """enroot's 50-slurm-pytorch.sh adds RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* but no
    LOCAL_WORLD_SIZE: the tasks per node must still come from Slurm."""
    pods = [(h, o.enroot_pytorch_hook(e)) for h, e in o.slurm_pods(nodes=2, tasks_per_node=4)]
    env = pods[5][1]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"],
            env["OMP_NUM_THREADS"]) == ("5", "1", "8", "gpu01", str(4242 % 4536 + 61000), "1")
    # enroot 3.x's port (before commit 29541a8): mod 16384 + 49152
    assert o.enroot_pytorch_hook(o.slurm_env(2, 4, 5), old_port=True)["MASTER_PORT"] == "53394"
    # One task per node: the hook leaves OMP_NUM_THREADS alone.
    assert "OMP_NUM_THREADS" not in o.enroot_pytorch_hook(o.slurm_env(2, 1, 1))
    assert "LOCAL_WORLD_SIZE" not in env
    want = [(p, 8, p % 4, 4, "gpu01", 65242) for p in range(8)]
    assert [reading(e) for _, e in pods] == want and o.check_world(pods) == []
    # One GPU bound to each task (--gpus-per-task=1): cuda:0; 4 per node: cuda:local rank.
    assert choose_device_and_backend(1, 4, gpu_count=1, env=env)[0].index == 0
    assert choose_device_and_backend(1, 4, gpu_count=4, env=env)[0].index == 1
    # Negative control: the local world taken as the whole world (8 ranks on a 4-GPU node) is
    # refused, which is what a missing LOCAL_WORLD_SIZE used to mean.
    with pytest.raises(DistributedSetupError, match="8 processes on this node but 4 GPU"):
        choose_device_and_backend(1, 8, gpu_count=4, env=env)
    # Without PYTORCH_VERSION in the image the hook adds nothing; srun's variables still work.
    bare = o.enroot_pytorch_hook(o.slurm_env(2, 4, 5), image_env={})
    assert "RANK" not in bare and reading(bare) == (5, 8, 1, 4, "gpu01", 24242)
