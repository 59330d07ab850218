"""Peak memory and time of the loss head's forward + backward: model.chunked_cross_entropy against the plain head it
replaced (full fp32 logits of the padded vocabulary, sliced to the real one, then F.cross_entropy). Each run is a
fresh subprocess, so its peak RSS minus the RSS before the forward is the head's own; the two alternate.

    python bench/bench_loss_head.py                      # B=8, T=1024, vocab 50257 padded to 50304, n_embd 768
    python bench/bench_loss_head.py --rounds 3 --batch-size 4
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import chunked_cross_entropy  # noqa: E402

VOCAB, PADDED = 50257, 50304


def plain_head(x, weight, targets):
    """model.py's head before the chunked one: logits over the padded rows, a strided slice, fp32 cross-entropy."""
    logits = (x @ weight.t())[..., :VOCAB]
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


def measure(head, rows, n_embd):
    """(peak RSS growth in bytes, seconds) of one forward + backward, in this process."""
    torch.manual_seed(0)
    x = torch.randn(rows, n_embd, requires_grad=True)
    weight = (0.02 * torch.randn(PADDED, n_embd)).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (rows,))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    start = time.perf_counter()
    loss = plain_head(x, weight, targets) if head == "plain" else chunked_cross_entropy(x, weight[:VOCAB], targets)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak - baseline, seconds, loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = args.batch_size * args.seq_len
    if args.child:
        print(json.dumps(measure(args.child, rows, args.n_embd)))
        return
    results = {"plain": [], "chunked": []}
    for _ in range(args.rounds):
        for head in results:
            out = subprocess.run([sys.executable, __file__, "--child", head, "--batch-size", str(args.batch_size),
                                  "--seq-len", str(args.seq_len), "--n-embd", str(args.n_embd)],
                                 check=True, capture_output=True, text=True).stdout
            results[head].append(json.loads(out.strip().splitlines()[-1]))
    print(f"loss head fwd+bwd, {rows} rows x n_embd {args.n_embd}, vocab {VOCAB} (weight padded to {PADDED}), fp32, "
          f"{args.rounds} fresh processes each")
    summary = {}
    for head, runs in results.items():
        memory, seconds = min(r[0] for r in runs), statistics.median(r[1] for r in runs)
        summary[head] = memory, seconds
        print(f"  {head:8s} peak RSS over baseline {memory / 2**30:6.2f} GiB, {seconds:6.2f} s, loss {runs[0][2]:.6f}")
    print(f"chunked/plain peak memory ratio {summary['chunked'][0] / summary['plain'][0]:.3f}x, "
          f"time ratio {summary['chunked'][1] / summary['plain'][1]:.2f}x")


if __name__ == "__main__":
    main()
