"""Launcher templates for three clouds, each checked offline against the schema of its request.

- SageMaker `CreateTrainingJob`: validated with botocore's own service model (the JSON model that
  ships inside the botocore package, the one every AWS SDK call is checked against).
- Vertex AI `CustomJob` and Alibaba PAI-DLC `CreateJob`: validated with a JSON Schema kept in
  `schemas/`, hand-written from each API's reference pages (a subset, strict about names and types).

Each template starts a course script; `template_command` pulls the command out of the request and
`check_command` proves that the script exists, that its options parse, and that `validate(cfg,
world)` accepts them at the world size the request asks for (nodes x --nproc_per_node);
`check_image` refuses an image that is not pinned (`:latest`); `check_grace` refuses a `--grace-s`
longer than torchrun's shutdown timeout (`--shutdown-timeout`, else PET_SHUTDOWN_TIMEOUT or
TORCH_ELASTIC_SHUTDOWN_TIMEOUT in the template's environment, else 30 s) or the platform's
documented SIGTERM-to-SIGKILL time, and a shutdown timeout that outlives the platform's;
`check_kept` refuses an --out (it holds the run id the checkpoints carry) or a local --ckpt-url
on a disk that a restarted job does not find again. Nothing here talks to a cloud: no
credentials, no network.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
from pathlib import Path

from common.config import build_parser

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEMPLATES = {"sagemaker": "sagemaker_create_training_job.json",
             "vertex": "vertex_custom_job.json",
             "pai": "pai_dlc_create_job.json"}
SCHEMAS = {"vertex": "vertex_custom_job.schema.json", "pai": "pai_dlc_create_job.schema.json"}
SCRIPT_RE = re.compile(r"chapters/(ch\d\d_\w+)/(\w+)\.py")


class TemplateError(ValueError):
    """A request or a command that a cloud or the course script would refuse."""


def load_template(cloud: str) -> dict:
    return json.loads((HERE / "templates" / TEMPLATES[cloud]).read_text())


def validate_request(cloud: str, request: dict) -> None:
    """Raise TemplateError if the request does not match its cloud's schema."""
    if cloud == "sagemaker":
        import botocore.session
        from botocore.exceptions import ParamValidationError
        from botocore.validate import validate_parameters
        model = botocore.session.get_session().get_service_model("sagemaker")
        shape = model.operation_model("CreateTrainingJob").input_shape
        try:
            validate_parameters(request, shape)
        except ParamValidationError as e:
            raise TemplateError(f"SageMaker CreateTrainingJob: {e}") from None
        return
    import jsonschema
    schema = json.loads((HERE / "schemas" / SCHEMAS[cloud]).read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(request), key=str)
    if errors:
        where = "/".join(map(str, errors[0].absolute_path)) or "(top)"
        raise TemplateError(f"{cloud}: {where}: {errors[0].message}")


IMAGE_TAG = "distributed-course:ch23"
"""The image chapter 23 builds (`docker build -f chapters/ch23_containers/Dockerfile -t
distributed-course:ch23 .`), pushed to each cloud's registry under the same name and tag."""


def template_image(cloud: str, request: dict) -> str:
    if cloud == "sagemaker":
        return request["AlgorithmSpecification"]["TrainingImage"]
    if cloud == "vertex":
        return request["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["imageUri"]
    if cloud == "pai":
        return request["JobSpecs"][0]["Image"]
    raise KeyError(cloud)


def check_image(ref: str) -> None:
    """The image must be pinned: a digest (`@sha256:...`) or an explicit tag other than `latest`.
    `:latest` (or no tag, which means it) names whatever was pushed last: a restarted spot job
    can pull another image than the one it was preempted in, and resume a checkpoint with code
    that no longer matches it."""
    name = ref.rsplit("/", 1)[-1]
    if "@sha256:" in ref:
        return
    if ":" not in name or name.endswith(":latest"):
        raise TemplateError(f"image {ref!r} is not pinned: name a tag (not latest) or a digest")


def template_command(cloud: str, request: dict) -> tuple[list[str], int]:
    """(the command's words, the number of nodes the request starts)."""
    if cloud == "sagemaker":
        spec = request["AlgorithmSpecification"]
        words = [*spec.get("ContainerEntrypoint", []), *spec.get("ContainerArguments", [])]
        return words, int(request["ResourceConfig"]["InstanceCount"])
    if cloud == "vertex":
        pools = [p for p in request["jobSpec"]["workerPoolSpecs"] if p]
        c = pools[0]["containerSpec"]
        return [*c.get("command", []), *c.get("args", [])], sum(int(p["replicaCount"]) for p in pools)
    if cloud == "pai":
        return shlex.split(request["UserCommand"]), sum(s["PodCount"] for s in request["JobSpecs"])
    raise KeyError(cloud)


def _opt(words: list[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def check_command(words: list[str], nodes: int):
    """The script's Config, validated at world nodes x --nproc_per_node; TemplateError otherwise."""
    idx = next((i for i, w in enumerate(words) if SCRIPT_RE.fullmatch(w)), None)
    if idx is None:
        raise TemplateError(f"no course script (chapters/chNN_slug/name.py) in {' '.join(words)!r}")
    script = REPO / words[idx]
    if not script.is_file():
        raise TemplateError(f"{words[idx]} does not exist in the course")
    launcher, args = words[:idx], words[idx + 1:]
    if launcher and launcher[0] == "exec":  # a shell command line that replaces the shell
        launcher = launcher[1:]
    if launcher and launcher[0] == "torchrun":
        nproc = int(_opt(launcher, "--nproc_per_node") or _opt(launcher, "--nproc-per-node") or 1)
        nnodes = _opt(launcher, "--nnodes")
        if nnodes is not None and not nnodes.startswith("$") and int(nnodes) != nodes:
            raise TemplateError(f"--nnodes {nnodes} but the request starts {nodes} nodes")
        if nnodes is None and nodes > 1:
            raise TemplateError(f"the request starts {nodes} nodes but torchrun has no --nnodes")
    else:
        nproc = 1
    module = importlib.import_module(f"chapters.{script.parent.name}.{script.stem}")
    said = io.StringIO()  # argparse prints its refusal: keep it for the error, off the console
    try:
        with contextlib.redirect_stderr(said):
            ns = build_parser(module.Config).parse_args(args)
    except SystemExit:
        reason = said.getvalue().strip().splitlines()[-1:] or [""]
        raise TemplateError(f"{words[idx]} does not accept {' '.join(args)!r}: "
                            f"{reason[0]}") from None
    cfg = module.Config(**vars(ns))  # ValueError: an option's value is refused
    module.validate(cfg, nodes * nproc)
    return cfg, nodes * nproc


TORCHRUN_SHUTDOWN_S = 30
"""torchrun's shutdown timeout when neither the option nor the environment sets it (torch 2.14.1,
distributed/launcher/api.py): seconds between forwarding SIGTERM to the workers and SIGKILLing
them."""

TORCHRUN_SHUTDOWN_ENV = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
"""Where torchrun (torch 2.14.1) reads its shutdown timeout when `--shutdown-timeout` is not given,
in this order: PET_SHUTDOWN_TIMEOUT, the option's default (distributed/run.py, `action=env`,
argparse_util.py), then TORCH_ELASTIC_SHUTDOWN_TIMEOUT (launcher/api.py, LaunchConfig's
__post_init__), then 30 s."""


def template_env(cloud: str, request: dict) -> dict[str, str]:
    """The environment the request gives the container that runs the command: SageMaker's
    `Environment`, the first Vertex worker pool's `containerSpec.env` (the pool whose command
    `template_command` reads). The PAI-DLC schema here has no environment field (a PAI template
    could only set one in its shell command, which `check_command` would not take for torchrun).
    The image's own ENV counts too: chapter 23's Dockerfile sets neither shutdown variable
    (tested)."""
    if cloud == "sagemaker":
        return dict(request.get("Environment") or {})
    if cloud == "vertex":
        pools = [p for p in request["jobSpec"]["workerPoolSpecs"] if p]
        return {e["name"]: e["value"] for e in pools[0]["containerSpec"].get("env", [])}
    if cloud == "pai":
        return {}
    raise KeyError(cloud)


def torchrun_shutdown_s(words: list[str], env: dict[str, str]) -> tuple[float, str]:
    """torchrun's shutdown timeout for this command line and environment, and where it came
    from, in torchrun's own order (`TORCHRUN_SHUTDOWN_ENV`)."""
    given = _opt(words, "--shutdown-timeout") or _opt(words, "--shutdown_timeout")
    if given is not None:
        return float(given), "torchrun --shutdown-timeout"
    for name in TORCHRUN_SHUTDOWN_ENV:
        if env.get(name):
            return float(env[name]), f"{name} in the template's environment"
    return float(TORCHRUN_SHUTDOWN_S), "torchrun's default"

PLATFORM_STOP_S = {"sagemaker": 120}
"""Seconds from SIGTERM to SIGKILL where the platform documents them: SageMaker's StopTrainingJob
(and StoppingCondition) "sends the algorithm the SIGTERM signal, which delays job termination for
120 seconds" (SageMaker API reference). Vertex AI and PAI-DLC document no such number."""


def check_grace(cloud: str, words: list[str], cfg, env: dict[str, str] | None = None) -> float:
    """The ranks' real deadline after SIGTERM: torchrun's shutdown timeout (its option, else the
    template's environment `env`, else 30 s: `torchrun_shutdown_s`), and the platform's own
    where documented. torchrun must end before the platform kills it, and --grace-s (what the
    run times its save against) may not promise more than torchrun gives. Returns it."""
    limit = float("inf")
    if "torchrun" in words[:2]:
        limit, source = torchrun_shutdown_s(words, env or {})
        platform = PLATFORM_STOP_S.get(cloud)
        if platform is not None and limit > platform:
            raise TemplateError(f"torchrun's shutdown timeout {limit:g} s ({source}) outlives "
                                f"{cloud}'s {platform} s from SIGTERM to SIGKILL")
    limit = min(limit, PLATFORM_STOP_S.get(cloud, float("inf")))
    if getattr(cfg, "grace_s", None) is not None and cfg.grace_s > limit:
        raise TemplateError(f"--grace-s {cfg.grace_s:g} but the ranks are killed {limit:g} s "
                            f"after SIGTERM (torchrun's shutdown timeout, or the platform)")
    return limit


def kept_folders(cloud: str, request: dict) -> list[str]:
    """The folders whose files a restarted job finds again: SageMaker restores its checkpoint
    path (`CheckpointConfig.LocalPath`, default /opt/ml/checkpoints) from S3 on every instance;
    Vertex AI mounts Cloud Storage under /gcs/; PAI-DLC mounts each data source at its
    `MountPath`. Everything else is the container's own disk, gone with the machine."""
    if cloud == "sagemaker":
        return [request.get("CheckpointConfig", {}).get("LocalPath") or "/opt/ml/checkpoints"]
    if cloud == "vertex":
        return ["/gcs"]
    if cloud == "pai":
        return [d["MountPath"] for d in request.get("DataSources", []) if d.get("MountPath")]
    raise KeyError(cloud)


def check_kept(cloud: str, request: dict, cfg) -> None:
    """--out (it holds the run id that the checkpoints carry: a restart with another one is
    another run and refuses them) and a local --ckpt-url must survive the machine."""
    kept = [Path(f) for f in kept_folders(cloud, request)]
    for option, value in (("--out", cfg.out), ("--ckpt-url", cfg.ckpt_url)):
        if option == "--ckpt-url" and (not value or "://" in value and not value.startswith(
                "file://")):
            continue  # an object store's URL, or the default <out>/ckpt
        path = Path(value.removeprefix("file://"))
        if not value or not any(path == k or k in path.parents for k in kept):
            raise TemplateError(f"{option} {value or '(default)'} is not kept across a restart on "
                                f"{cloud} (kept: {', '.join(map(str, kept)) or 'nothing'})")


def check_template(cloud: str, request: dict | None = None):
    """Validate a template's request and its command: (Config, world size)."""
    request = load_template(cloud) if request is None else request
    validate_request(cloud, request)
    check_image(template_image(cloud, request))
    words, nodes = template_command(cloud, request)
    cfg, world = check_command(words, nodes)
    check_grace(cloud, words, cfg, template_env(cloud, request))
    check_kept(cloud, request, cfg)
    return cfg, world
