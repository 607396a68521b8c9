"""Hello, distributed: every process learns its rank, the ranks add up their numbers with one
all-reduce, and each prints the sum it received. (Options: the course's common ones, --help;
it uses --device, --backend and --timeout.)

    python chapters/ch01_overview/hello.py                                    # a world of one
    torchrun --standalone --nproc_per_node=2 chapters/ch01_overview/hello.py  # 2 processes
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

from common.config import RunConfig as Config
from common.config import build_parser


def main(cfg: Config) -> int:
    rank = int(os.environ.get("RANK", 0))  # torchrun sets these for every process it starts
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the process's number on its machine
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this machine
    use_cuda = torch.cuda.device_count() >= local_world if cfg.device == "auto" else cfg.device == "cuda"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    backend = ("nccl" if use_cuda else "gloo") if cfg.backend == "auto" else cfg.backend
    if use_cuda:
        torch.cuda.set_device(device)  # BEFORE init: until set, "the current device" is GPU 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # no torchrun: a world of one, which
    os.environ.setdefault("MASTER_PORT", "0")  # hosts the group's store on any free port
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout))  # never hang forever
    try:
        total = torch.tensor([rank], device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # every rank gets 0 + 1 + ... + (world_size-1)
        expected = world_size * (world_size - 1) // 2
        ok = total.item() == expected
        print(f"rank {rank} of {world_size} ({device}, {backend}): sum of ranks {total.item()}, "
              f"world_size*(world_size-1)/2 = {expected}: {'ok' if ok else 'WRONG'}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()  # in `finally`: even after an error, leave the group


if __name__ == "__main__":
    sys.exit(main(Config(**vars(build_parser(Config, description=__doc__).parse_args()))))
