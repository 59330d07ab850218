"""Muon's optimizer step on FSDP2-sharded GPT-2 matrices, 2 gloo ranks on the CPU: the collectives of one step and the
step time, for torch.optim.Muon on the sharded DTensors (before) and muon.ShardedMuon (after), against AdamW's step on
the same sharded matrices.

    python bench/bench_muon_sharded.py                            # 4 blocks at n_embd 768: 16 matrices
    python bench/bench_muon_sharded.py --n-layer 12 --rounds 1    # GPT-2 124M's 48 matrices

The blocks' matrices of model.py's GPT (c_attn, c_proj, c_fc, mlp.c_proj, as train_gpt2.build_optimizer gives them to
Muon), each block sharded with fully_shard as the trainer shards it, with random gradients sharded likewise. The
collectives are counted by torch's CommDebugMode. Each round times one step of each optimizer, taking turns (so that
other work on the machine slows all three alike), from a barrier to a barrier: the slowest rank's time. The figures
are medians over the rounds, after one untimed warm-up step each."""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import GPT, GPTConfig  # noqa: E402
from muon import ShardedMuon  # noqa: E402


def sharded_matrices(args):
    """The blocks' matrices of a GPT sharded over the ranks by FSDP2, each with a random sharded gradient."""
    config = GPTConfig(block_size=64, vocab_size=64, padded_vocab_size=None, n_layer=args.n_layer,
                       n_head=args.n_embd // 64, n_embd=args.n_embd)
    with torch.device("meta"):
        model = GPT(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(dist.get_rank())
    matrices = [p for p in model.transformer.h.parameters() if p.dim() == 2]
    for p in matrices:
        with torch.no_grad():
            p.to_local().normal_(std=0.02, generator=generator)
        grad = torch.randn(p.to_local().shape, generator=generator)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return matrices


def timed_step(optimizer):
    dist.barrier()
    start = time.perf_counter()
    optimizer.step()
    dist.barrier()
    return time.perf_counter() - start


def collectives(optimizer):
    with CommDebugMode() as comm:
        optimizer.step()
    return comm.get_total_counts()


def rank_main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    torch.manual_seed(0)
    matrices = sharded_matrices(args)
    # Muon as train_gpt2.build_optimizer makes it, one group per matrix; AdamW at its defaults there.
    groups = [dict(params=[p]) for p in matrices]
    muon = dict(lr=0.01, momentum=0.95, nesterov=False, adjust_lr_fn="original")
    optimizers = {"AdamW": torch.optim.AdamW(matrices, lr=1e-3, weight_decay=0.1),
                  "torch.optim.Muon": torch.optim.Muon(groups, **muon),
                  "ShardedMuon": ShardedMuon([dict(params=[p]) for p in matrices], **muon)}
    counts = {name: collectives(optimizer) for name, optimizer in optimizers.items()}  # the warm-up step too
    seconds = {name: [] for name in optimizers}
    for _ in range(args.rounds):
        for name, optimizer in optimizers.items():
            seconds[name].append(timed_step(optimizer))
    if dist.get_rank() == 0:
        shapes = sorted({tuple(p.shape) for p in matrices})
        print(f"{len(matrices)} matrices ({args.n_layer} blocks at n_embd {args.n_embd}: "
              f"{', '.join(f'{r} x {c}' for r, c in shapes)}), {dist.get_world_size()} gloo ranks, "
              f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) a rank")
        adamw = statistics.median(seconds["AdamW"])
        for name in optimizers:
            median = statistics.median(seconds[name])
            print(f"{name:>16}: {counts[name]:4d} collectives a step ({counts[name] / len(matrices):.2f} a "
                  f"matrix); step {median * 1000:8.1f} ms, {median / adamw:6.2f}x AdamW's "
                  f"(median of {args.rounds})")
        before, after = (statistics.median(seconds[name]) for name in ("torch.optim.Muon", "ShardedMuon"))
        print(f"ShardedMuon / torch.optim.Muon: {counts['ShardedMuon']} / {counts['torch.optim.Muon']} "
              f"collectives, step time {after / before:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each optimizer, taking turns")
    args = parser.parse_args()
    if "RANK" in os.environ:  # a rank of the launch below
        return rank_main(args)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
              os.path.abspath(__file__), *sys.argv[1:]]
    sys.exit(subprocess.run(launch).returncode)


if __name__ == "__main__":
    main()
