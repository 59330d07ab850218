"""Peak memory and time of the loss head's forward + backward: model.chunked_cross_entropy (the GEMMs over the padded
weight, the padded columns masked) against nanoGPT's plain head (full fp32 logits over all 50304 rows, then
F.cross_entropy), both eager and both under torch.compile. Each measurement is a fresh subprocess that runs the head
once to warm up (and compile), then resets its peak resident memory and times a second run; the four kinds take turns
round by round, and the median time and smallest peak of each are compared (and the median of the per-round time
ratios, steadier on a shared machine).

    python bench/bench_loss_head.py                      # B=8, T=1024, vocab 50257 padded to 50304, n_embd 768
    python bench/bench_loss_head.py --rounds 5 --batch-size 4
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import chunked_cross_entropy  # noqa: E402

VOCAB, PADDED = 50257, 50304
KINDS = ("nanoGPT eager", "ours eager", "nanoGPT compiled", "ours compiled")


def nanogpt_head(x, weight, targets):
    """nanoGPT's model.py with targets: logits = lm_head(x), then cross-entropy over every row of the weight."""
    return F.cross_entropy(x @ weight.t(), targets, ignore_index=-1)


def memory_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(kind, rows, n_embd):
    """(peak resident memory above the baseline in bytes, seconds, loss) of the second forward + backward."""
    torch.manual_seed(0)
    x = torch.randn(rows, n_embd, requires_grad=True)
    weight = (0.02 * torch.randn(PADDED, n_embd)).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (rows,))
    compiled = kind.endswith("compiled")
    if kind.startswith("ours"):
        def head(x, weight, targets):
            return chunked_cross_entropy(x, weight, targets, vocab_size=VOCAB, compiled=compiled)
    else:
        head = torch.compile(nanogpt_head) if compiled else nanogpt_head
    head(x, weight, targets).backward()  # warm-up: compiles, and first touches of the math libraries
    x.grad = weight.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the peak (VmHWM) from the resident size now
    baseline = memory_kib("VmRSS")
    start = time.perf_counter()
    loss = head(x, weight, targets)
    loss.backward()
    seconds = time.perf_counter() - start
    return (memory_kib("VmHWM") - baseline) * 1024, seconds, loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = args.batch_size * args.seq_len
    if args.child:
        print(json.dumps(measure(args.child, rows, args.n_embd)))
        return
    # large blocks straight from mmap and back to the system when freed, so RSS follows the live tensors
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    results = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--child", kind, "--batch-size", str(args.batch_size),
                                  "--seq-len", str(args.seq_len), "--n-embd", str(args.n_embd)],
                                 check=True, capture_output=True, text=True, env=env).stdout
            results[kind].append(json.loads(out.strip().splitlines()[-1]))
    print(f"loss head fwd+bwd, {rows} rows x n_embd {args.n_embd}, weight {PADDED} rows (ours: vocab {VOCAB}), fp32, "
          f"torch {torch.__version__}, {args.rounds} rounds of fresh processes")
    summary = {}
    for kind, runs in results.items():
        summary[kind] = min(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"  {kind:17s} peak RSS over baseline {summary[kind][0] / 2**30:6.2f} GiB, {summary[kind][1]:6.2f} s "
              f"(median), loss {runs[0][2]:.6f}")
    for mode in ("eager", "compiled"):
        ours, theirs = summary[f"ours {mode}"], summary[f"nanoGPT {mode}"]
        # each round ran the two back to back: the median of their per-round ratios is the steadier figure
        paired = statistics.median(a[1] / b[1] for a, b in zip(results[f"ours {mode}"], results[f"nanoGPT {mode}"]))
        print(f"{mode:8s} ours/nanoGPT: peak memory {ours[0] / theirs[0]:.3f}x, time {ours[1] / theirs[1]:.2f}x "
              f"(median of the per-round ratios {paired:.2f}x)")


if __name__ == "__main__":
    main()
