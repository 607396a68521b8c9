"""Chapter 23's launchers: the environment each hands a pod or task, and whether it makes one world.

`pytorchjob_env`, `volcano_env`, `indexed_job_pods`, `slurm_env` give the environment each
launcher hands a pod or task, written from the operators' own code (Kubeflow training-operator
`pkg/controller.v1/pytorch/envvar.go`, `master.go`, `elastic.go`; Volcano
`pkg/controllers/job/plugins/{distributed-framework/pytorch,svc,env}`; the Kubernetes Job
controller; Slurm's srun; `enroot_pytorch_hook`, enroot's hook for pyxis containers). The
`*_pods` functions list every pod of a job with its environment. `check_world` then asks whether
a reader of those variables (`common.distributed.read_launch_env`) gives every pod a distinct
rank of one world that agrees on where rank 0 is.
"""

from __future__ import annotations

from chapters.ch23_containers.manifests import (
    PYTORCH_CONTAINER,
    PYTORCH_DEFAULT_PORT,
    PYTORCH_PORT_NAME,
)

# --- Kubernetes: PyTorchJob, Volcano Job, indexed Job ---------------------------------------------

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


# --- Slurm: srun, and enroot's hook inside a pyxis container --------------------------------------

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


# --- one world? -----------------------------------------------------------------------------------

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
