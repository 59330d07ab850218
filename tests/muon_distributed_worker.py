"""One launch of tests/test_muon_distributed.py, under torchrun (gloo, CPU):

    muon_distributed_worker.py ROOT

A small MLP whose matrices shard unevenly on 2 ranks (27 rows), hold no row on rank 1 (1 row) or
are tall or wide, sharded with FSDP2, trains with ShardedMuon; every rank also trains the same MLP
whole in its own process with torch.optim.Muon, on the whole batch, as the oracle. Rank 0 prints
one line `RESULT <json>` per finding."""
import copy
import datetime
import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
from muon import ShardedMuon  # noqa: E402

WIDTHS = (24, 40, 27, 64, 1)  # weights 40 x 24 (tall), 27 x 40, 64 x 27, 1 x 64 (wide)
BATCH = 8
STEPS = 5


def report(**result):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def mlp():
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def muon_groups(model):
    """One group per matrix, as train_gpt2.build_optimizer makes them: each its own lr and weight
    decay, and both of torch's lr adjustments."""
    return [dict(params=[p], lr=0.02 * (1 + i), weight_decay=0.1 * (i % 2),
                 adjust_lr_fn=("original", "match_rms_adamw")[i % 2])
            for i, p in enumerate(model.parameters())]


def loss_of(model, step, rows):
    """The mean squared output on `rows` of step's batch (every rank draws the same batch)."""
    batch = torch.randn(BATCH, WIDTHS[0], generator=torch.Generator().manual_seed(step))
    return model(batch[rows]).pow(2).mean()


def collectives(optimizer, model):
    """The collectives of one optimizer step, by CommDebugMode."""
    loss_of(model, 100, slice(None)).backward()
    with CommDebugMode() as comm:
        optimizer.step()
    optimizer.zero_grad()
    return comm.get_total_counts()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole = mlp()
    sharded = copy.deepcopy(whole)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    oracle = torch.optim.Muon(muon_groups(whole), momentum=0.95, nesterov=False)
    optimizer = ShardedMuon(muon_groups(sharded), momentum=0.95, nesterov=False)
    # Each rank takes its share of the batch; FSDP2 averages the gradients, as the whole batch's.
    share = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for step in range(STEPS):
        loss_of(whole, step, slice(None)).backward()
        oracle.step()
        oracle.zero_grad()
        loss_of(sharded, step, share).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = [(a.detach(), b.full_tensor()) for a, b in zip(whole.parameters(), sharded.parameters())]
    buffers = [(oracle.state[a]["momentum_buffer"], optimizer.state[b]["momentum_buffer"])
               for a, b in zip(whole.parameters(), sharded.parameters())]
    report(check="steps", ranks=world_size,
           moved=min((a - b).abs().max().item() for a, b in zip(whole.parameters(), mlp().parameters())),
           params=max((a - b).abs().max().item() for a, b in params),
           momentum=max((a - b.full_tensor()).abs().max().item() for a, b in buffers),
           momentum_sharded=all(b.placements == (Shard(0),) for _, b in buffers))
    # The collectives of one step: ShardedMuon's at 5 and at 10 Newton-Schulz iterations, and
    # torch.optim.Muon's on the same sharded matrices but the last (torch 2.13's Muon stops on a
    # 1-row matrix sharded over 2 ranks: its add_ of a replicated update to the rows fails).
    counts = dict(sharded_5=collectives(optimizer, sharded))
    counts["sharded_10"] = collectives(ShardedMuon(sharded.parameters(), ns_steps=10), sharded)
    counts["torch_5_of_3"] = collectives(torch.optim.Muon(list(sharded.parameters())[:-1]), sharded)
    report(check="collectives", ranks=world_size, matrices=len(WIDTHS) - 1, **counts)
    # FSDP modules sit in reference cycles that keep the process group alive past
    # destroy_process_group: free them, and leave together (model_distributed_worker.py).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
