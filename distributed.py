"""
The process group and the two collectives the rest of the project needs. Every helper also works without a process
group (one process), so callers never branch on it.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_distributed(device_choice="auto", timeout_s=900):
    """(rank, world_size, device). Under torchrun a process group is created: NCCL on GPUs, gloo on CPU."""
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("config: device is 'cuda' but torch sees no CUDA GPU")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=device if use_cuda else None)
    return rank, world_size, device


def rank_and_world_size():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag):
    """Whether `flag` is true on any rank (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return bool(flag)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor(float(bool(flag)), device=device)
    dist.all_reduce(total)
    return total.item() > 0
