"""Peak memory and time of one training forward + backward with model.GPT's activation_checkpointing on and off.
Each run is a fresh subprocess; peak RSS minus the RSS before the forward is what the step itself needed. A small
vocabulary keeps the blocks' activations, which checkpointing drops, the bulk of the memory.

    python bench/bench_activation_checkpointing.py
    python bench/bench_activation_checkpointing.py --n-layer 12 --n-embd 768 --seq-len 1024 --batch-size 4
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402


def measure(args, checkpointing):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.seq_len, vocab_size=512, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd))
    model.activation_checkpointing = checkpointing
    idx = torch.randint(0, 512, (args.batch_size, args.seq_len))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    start = time.perf_counter()
    model(idx, idx)[1].backward()
    seconds = time.perf_counter() - start
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child == "on")))
        return
    # large blocks straight from mmap and back to the system when freed, so RSS follows the live tensors (glibc
    # otherwise raises its mmap threshold after the first frees and keeps freed activations in the heap)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    results = {}
    for mode in ("off", "on", "off", "on"):  # alternate; keep each mode's smallest peak and fastest time
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", mode], check=True, env=env,
                             capture_output=True, text=True).stdout
        memory, seconds = json.loads(out.strip().splitlines()[-1])
        best = results.get(mode, (memory, seconds))
        results[mode] = min(best[0], memory), min(best[1], seconds)
    print(f"GPT {args.n_layer}x{args.n_embd}, B={args.batch_size} T={args.seq_len}, fp32 fwd+bwd, 2 fresh processes each")
    for mode, (memory, seconds) in results.items():
        print(f"  checkpointing {mode:3s}: peak RSS over baseline {memory / 2**20:7.0f} MiB, {seconds:.2f} s")
    print(f"checkpointing on/off peak memory ratio {results['on'][0] / results['off'][0]:.2f}x, "
          f"time ratio {results['on'][1] / results['off'][1]:.2f}x")


if __name__ == "__main__":
    main()
