"""Overhead of train_gpt2.py's training loop over a bare forward/backward/step loop on the same model and batch.

    python bench/bench_train.py                                  # configs/demo_cpu.py's model and batch, CPU
    python bench/bench_train.py --n-layer 12 --n-head 12 --n-embd 768 --seq-length 1024 --batch-size 64 \\
        --grad-accum 8 --padded-vocab-size 50304 --dtype bfloat16 --compile --rounds 1  # GPT-2 124M on a GPU

Both loops train the same architecture with the same optimizer, dtype, compile setting and batch size; the bare
loop feeds one fixed batch from memory and does nothing else, the full loop is train_gpt2.main on a synthetic token
dataset (random tokens), with validation and periodic checkpoints off. Each reports the median wall time of one
optimizer step after warm-up (for the full loop: between consecutive metrics.jsonl records, so data loading, loss
all-reduce, logging and everything else between two steps counts). The loops alternate, bare first and last
(--rounds full loops between --rounds + 1 bare ones); each full loop is compared with the mean of the bare loops
around it and the median of those ratios is reported, so a machine that slows down or speeds up meanwhile (other
jobs, clocks) does not pass for overhead. Goal: overhead <= 3%.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2  # noqa: E402
from indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def synthetic_dataset(prefix, vocab_size, num_tokens, seed=0):
    """Random tokens in documents of 1-4K tokens."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16 if vocab_size < 65500 else np.int32)
    written = 0
    while written < num_tokens:
        length = int(rng.integers(1024, 4096))
        builder.add_document(rng.integers(0, vocab_size, length))
        written += length
    builder.finalize(prefix + ".idx")


def bare_loop(args, device, steps, plain_head=False):
    """Median seconds per optimizer step of forward/backward/clip/step on one fixed batch. plain_head: the loss from
    the full logits (model(x), then fp32 cross-entropy), the head nanoGPT and our earlier model used."""
    config = GPTConfig(block_size=args.seq_length, vocab_size=args.vocab_size, padded_vocab_size=args.padded_vocab_size,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    if args.compile:
        for block in model.transformer.h:
            block.compile()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)],
                                  lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(args.grad_accum):
            with autocast:
                if plain_head:
                    logits, _ = model(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                else:
                    _, loss = model(x, y)
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[args.warmup:])


def full_loop(args, device, steps, workdir):
    """Median seconds per optimizer step of train_gpt2.main, from the timestamps of its metrics records."""
    prefix = os.path.join(workdir, "synthetic")
    synthetic_dataset(prefix, args.vocab_size, int(steps * args.batch_size * args.grad_accum * args.seq_length * 1.2))
    out_dir = os.path.join(workdir, "out")
    overrides = dict(data_paths=prefix, index_mapping_dir=os.path.join(workdir, "cache"), split="99,1,0",
                     seq_length=args.seq_length, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     vocab_size=args.vocab_size, padded_vocab_size=args.padded_vocab_size,
                     global_batch_size=args.batch_size * args.grad_accum, local_batch_size=args.batch_size,
                     max_steps=steps, lr=1e-4, lr_warmup_steps=1, val_tokens=0, ckpt_every_steps=0,
                     device=device.type, dtype=args.dtype, compile=args.compile, seed=args.seed, out_dir=out_dir)
    train_gpt2.main([f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in overrides.items()])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        stamps = [record["time"] for record in map(json.loads, f) if "train_loss" in record]
    return statistics.median(np.diff(stamps)[args.warmup:])


def compare_loss_heads(args, device):
    """tok/s, MFU (llm.c's FLOP count) and peak memory of the bare loop with each loss head, alternating."""
    tokens = args.batch_size * args.grad_accum * args.seq_length
    config = GPTConfig(block_size=args.seq_length, vocab_size=args.vocab_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, padded_vocab_size=args.padded_vocab_size)
    with torch.device("meta"):
        flops_per_token = GPT(config).flops_per_token(args.seq_length)
    peak = train_gpt2.peak_flops(device)
    results = {"chunked": [], "plain": []}
    memory = {}
    for _ in range(args.rounds):
        for name in results:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            results[name].append(bare_loop(args, device, args.steps, plain_head=name == "plain"))
            if device.type == "cuda":
                memory[name] = torch.cuda.max_memory_allocated(device) / 2**30
    seconds = {name: statistics.median(runs) for name, runs in results.items()}
    for name in results:
        mfu = f", MFU {100 * tokens / seconds[name] * flops_per_token / peak:.1f}%" if peak else ""
        mem = f", peak memory {memory[name]:.1f} GiB" if name in memory else ""
        print(f"{name + ' loss head':>18}: {tokens / seconds[name]:12,.0f} tok/s{mfu}{mem}")
    print(f"chunked / plain: {seconds['plain'] / seconds['chunked']:.2f}x tok/s"
          + (f", {memory['chunked'] / memory['plain']:.2f}x peak memory" if memory else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--padded-vocab-size", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    parser.add_argument("--grad-accum", type=int, default=1, help="forwards per optimizer step")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per loop, warm-up included")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--rounds", type=int, default=3, help="full loops, each between two bare loops")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (both loops)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--loss-heads", action="store_true",
                        help="instead: the bare loop with the chunked loss head against the plain full-logits head")
    args = parser.parse_args()
    if args.steps - 1 <= args.warmup:
        parser.error("--steps must exceed --warmup + 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    device = torch.device(args.device)
    if args.loss_heads:
        return compare_loss_heads(args, device)

    memory = {}
    bare_runs, full_runs = [bare_loop(args, device, args.steps)], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as workdir:
            full_runs.append(full_loop(args, device, args.steps, workdir))
        if device.type == "cuda":
            memory["train_gpt2.py loop"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        bare_runs.append(bare_loop(args, device, args.steps))
        if device.type == "cuda":
            memory["bare forward/backward/step"] = torch.cuda.max_memory_allocated(device) / 2**30
    ratios = [full / ((before + after) / 2) for full, before, after in zip(full_runs, bare_runs, bare_runs[1:])]
    bare, full = statistics.median(bare_runs), statistics.median(full_runs)

    tokens = args.batch_size * args.grad_accum * args.seq_length
    config = GPTConfig(block_size=args.seq_length, vocab_size=args.vocab_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    with torch.device("meta"):
        flops_per_token = GPT(config).flops_per_token(args.seq_length)
    peak = train_gpt2.peak_flops(device)
    print(f"\n{args.n_layer} layers x {args.n_embd}, vocab {args.vocab_size}, {args.batch_size} x {args.seq_length} "
          f"tokens x {args.grad_accum} accumulation, {args.dtype}, compile {args.compile}, {device}, "
          f"{torch.get_num_threads()} CPU threads")
    for name, seconds in (("bare forward/backward/step", bare), ("train_gpt2.py loop", full)):
        mfu = f", MFU {100 * tokens / seconds * flops_per_token / peak:.1f}% of bf16 peak" if peak else ""
        mem = f", peak memory {memory[name]:.1f} GiB" if name in memory else ""
        print(f"{name:>28}: {1000 * seconds:9.1f} ms/step, {tokens / seconds:12,.0f} tok/s{mfu}{mem}")
    in_order = [f"bare {1000 * bare_runs[0]:.1f}"]
    for full_run, bare_run in zip(full_runs, bare_runs[1:]):
        in_order += [f"full {1000 * full_run:.1f}", f"bare {1000 * bare_run:.1f}"]
    print(f"{'all loops, in order':>28}: {', '.join(in_order)} ms/step")
    ratio = statistics.median(ratios)
    print(f"{'full loop / bare loop':>28}: {ratio:.3f} x time per step ({100 * (ratio - 1):+.1f}% overhead, median of "
          f"{len(ratios)} rounds; goal <= +3%)")


if __name__ == "__main__":
    main()
