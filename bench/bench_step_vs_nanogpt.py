"""Training-step throughput (forward, backward, AdamW step) of model.GPT against nanoGPT's GPT (its model.py, from a
checkout of github.com/karpathy/nanoGPT given by --nanogpt or $NANOGPT_DIR; it is not shipped here) on the same
tokens from the same weights: 4 layers, 128 wide, 4 heads, T=64, B=8, vocabulary 50257 padded to 50304 (both multiply
by all 50304 rows; nanoGPT's loss counts them all, ours masks the 47 padded ones). Both compiled as their trainers
do: ours per block (block.compile(), as train_gpt2.py before FSDP2) with the loss head's chunks (compile_loss),
nanoGPT's whole model with torch.compile; --no-compile runs both eagerly. The two models alternate step by step, fp32
and bf16 autocast; the median of the timed steps is compared.

--memory measures peak memory instead (CPU): each side runs its warm-up and timed steps alone in a fresh subprocess,
which reports its peak RSS growth over a baseline taken after the imports and the model and optimizer are built,
before the first step (so it holds the gradients, AdamW's state, the activations and, compiled, the compiler's own
memory), and separately the peak growth within the timed steps over the RSS after warm-up (what a steady step adds).
The sides alternate for --rounds rounds; the medians are compared. RSS also counts freed memory glibc keeps (its
mmap threshold rises to the largest block freed, so later blocks that size come from the heap and stay): the run
figure moves by tens of MiB between rounds.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT --steps 20 --device cuda
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT --no-compile --dtypes fp32   # the eager CPU step
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT --memory    # peak RSS, each side in its own process
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --dtypes


def import_nanogpt(directory):
    """nanoGPT's model.py as a module, from a checkout (its GPT, GPTConfig and configure_optimizers are used)."""
    import importlib.util

    path = os.path.join(directory or "", "model.py")
    if not directory or not os.path.isfile(path):
        sys.exit(f"bench_step_vs_nanogpt.py: error: nanoGPT's model.py not found at {path!r}; clone "
                 f"https://github.com/karpathy/nanoGPT and pass --nanogpt DIR (or set NANOGPT_DIR)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(args):
    """nanoGPT's model with its own init, and ours loaded from its state dict (the same names and layout)."""
    torch.manual_seed(0)
    nanogpt = args.nanogpt_model
    theirs = nanogpt.GPT(nanogpt.GPTConfig(block_size=args.seq_len, vocab_size=50304, n_layer=4, n_head=4, n_embd=128,
                                           dropout=0.0, bias=True))
    ours = GPT(GPTConfig(block_size=args.seq_len, vocab_size=50257, padded_vocab_size=50304, n_layer=4, n_head=4,
                         n_embd=128))
    ours.load_state_dict(theirs.state_dict())
    theirs, ours = theirs.to(args.device), ours.to(args.device)
    if args.compile:
        for block in ours.transformer.h:
            block.compile()
        ours.compile_loss = True
    models = {"nanoGPT": torch.compile(theirs) if args.compile else theirs, "ours": ours}
    # the same optimizer for both: nanoGPT's configure_optimizers only reads named_parameters()
    optimizers = {name: nanogpt.GPT.configure_optimizers(m, 0.1, 6e-4, (0.9, 0.95), args.device)
                  for name, m in models.items()}
    return models, optimizers


def train_step(model, optimizer, idx, targets, dtype, device):
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return loss.item()


def step_seconds(models, optimizers, idx, targets, dtype, args):
    times, losses = {name: [] for name in models}, {}
    for i in range(args.warmup + args.steps):
        for name in models:
            start = time.perf_counter()
            losses[name] = train_step(models[name], optimizers[name], idx, targets, dtype, args.device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, losses


def rss_mib(field):
    """VmRSS (now) or VmHWM (the peak since start or the last reset_peak_rss) of this process, in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss():
    """Set VmHWM back to the current RSS (Linux: writing 5 to /proc/self/clear_refs), so it peaks from here on."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_memory_alone(side, idx, targets, dtype, args):
    """Run one side's warm-up and timed steps in this process (a fresh one); its peak RSS growth in MiB: over the
    whole run from before the first step, and within the timed steps over the RSS after warm-up."""
    models, optimizers = build(args)
    model, optimizer = models[side], optimizers[side]
    del models, optimizers  # the other side's model and optimizer go now, before the baseline
    gc.collect()
    reset_peak_rss()
    baseline = rss_mib("VmRSS")
    for _ in range(args.warmup):
        train_step(model, optimizer, idx, targets, dtype, args.device)
    warmup_peak = rss_mib("VmHWM")
    reset_peak_rss()
    after_warmup = rss_mib("VmRSS")
    for _ in range(args.steps):
        train_step(model, optimizer, idx, targets, dtype, args.device)
    steps_peak = rss_mib("VmHWM")
    return {"run": max(warmup_peak, steps_peak) - baseline, "step": steps_peak - after_warmup}


def peak_memory_in_subprocess(side, dtype_name, args):
    """This script re-run with --only SIDE for one dtype; the dict peak_memory_alone returned there."""
    command = [sys.executable, os.path.abspath(__file__), "--only", side, "--dtypes", dtype_name,
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--device", args.device, "--nanogpt", args.nanogpt]
    if not args.compile:
        command.append("--no-compile")
    if args.threads:
        command += ["--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bench_step_vs_nanogpt.py: error: the {side} {dtype_name} subprocess exited with "
                 f"{result.returncode}:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def compare_memory(args):
    """--memory: each side in fresh subprocesses, alternating for --rounds rounds; MiB medians, a line per dtype."""
    print(f"GPT 4x128, 4 heads, B={args.batch_size} T={args.seq_len}, vocab 50304, AdamW, {args.device}, "
          f"{'compiled' if args.compile else 'eager'}, {args.threads or 'default'} threads, {args.warmup} warm-up + "
          f"{args.steps} steps, each side alone in a fresh process, median of {args.rounds} alternating rounds; "
          f"peak RSS growth over the run (from before the first step) and within the timed steps (over the RSS "
          f"after warm-up)")
    for dtype_name in args.dtypes:
        rounds = {"ours": [], "nanoGPT": []}
        for _ in range(args.rounds):
            for side in rounds:
                rounds[side].append(peak_memory_in_subprocess(side, dtype_name, args))
        median = {side: {kind: statistics.median(r[kind] for r in runs) for kind in ("run", "step")}
                  for side, runs in rounds.items()}
        per_round = {side: ", ".join(f"{r['run']:.0f}" for r in runs) for side, runs in rounds.items()}
        label = "fp32" if dtype_name == "fp32" else "bf16 autocast"
        ours, theirs = median["ours"], median["nanoGPT"]
        print(f"{label:14s} run: ours {ours['run']:5.0f} MiB, nanoGPT {theirs['run']:5.0f} MiB, ours/nanoGPT "
              f"{ours['run'] / theirs['run']:.2f}x; step: ours {ours['step']:5.0f} MiB, "
              f"nanoGPT {theirs['step']:5.0f} MiB, ours/nanoGPT {ours['step'] / theirs['step']:.2f}x  "
              f"(run MiB per round: ours {per_round['ours']}; nanoGPT {per_round['nanoGPT']})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nanogpt", default=os.environ.get("NANOGPT_DIR"), help="a nanoGPT checkout")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="both models eager")
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"],
                        help="fp32 and/or bf16 autocast (bf16 is slow on CPUs without bf16 instructions)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--memory", action="store_true",
                        help="peak RSS growth instead of time, each side alone in fresh subprocesses (CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="--memory: alternating rounds of the two subprocesses")
    parser.add_argument("--only", choices=["ours", "nanoGPT"], help=argparse.SUPPRESS)  # a --memory subprocess
    args = parser.parse_args()
    if (args.memory or args.only) and args.device != "cpu":
        sys.exit("bench_step_vs_nanogpt.py: error: --memory measures host RSS, so CPU only (bench/gpu_h200.sh "
                 "reports GPU peak memory)")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.nanogpt_model = import_nanogpt(args.nanogpt)
    if args.memory:
        compare_memory(args)
        return
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), generator=generator).to(args.device)
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if args.only:  # one side of --memory, in its own process: one JSON line for the parent
        dtype = DTYPES[args.dtypes[0]]
        print(json.dumps(peak_memory_alone(args.only, idx, targets, dtype, args)))
        return
    print(f"GPT 4x128, 4 heads, B={args.batch_size} T={args.seq_len}, vocab 50304, AdamW, {args.device}, "
          f"{'compiled' if args.compile else 'eager'}, {torch.get_num_threads()} threads, median of {args.steps} steps "
          f"after {args.warmup} warm-up, alternating")
    for dtype in [DTYPES[name] for name in args.dtypes]:
        models, optimizers = build(args)  # fresh, identical weights for each precision
        seconds, losses = step_seconds(models, optimizers, idx, targets, dtype, args)
        tps = {name: idx.numel() / s for name, s in seconds.items()}
        label = "fp32" if dtype == torch.float32 else "bf16 autocast"
        print(f"{label:14s} ours {tps['ours']:8.0f} tok/s, nanoGPT {tps['nanoGPT']:8.0f} tok/s, "
              f"ours/nanoGPT tok/s ratio {tps['ours'] / tps['nanoGPT']:.2f}x  (last losses: ours "
              f"{losses['ours']:.4f}, nanoGPT {losses['nanoGPT']:.4f})")


if __name__ == "__main__":
    main()
