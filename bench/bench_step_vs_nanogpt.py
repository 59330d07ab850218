"""Training-step throughput (forward, backward, AdamW step) of model.GPT against nanoGPT's GPT (its model.py, from a
checkout of github.com/karpathy/nanoGPT given by --nanogpt or $NANOGPT_DIR; it is not shipped here) on the same
tokens from the same weights: 4 layers, 128 wide, 4 heads, T=64, B=8, vocabulary 50257 padded to 50304 (both multiply
by all 50304 rows; nanoGPT's loss counts them all, ours masks the 47 padded ones). Both compiled as their trainers
do: ours per block (block.compile(), as train_gpt2.py before FSDP2) with the loss head's chunks (compile_loss),
nanoGPT's whole model with torch.compile; --no-compile runs both eagerly. The two models alternate step by step, fp32
and bf16 autocast; the median of the timed steps is compared.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT --steps 20 --device cuda
    python bench/bench_step_vs_nanogpt.py --nanogpt ../nanoGPT --no-compile --dtypes fp32   # the eager CPU step
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402


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


def step_seconds(models, optimizers, idx, targets, dtype, args):
    def step(name):
        with torch.autocast(args.device, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = models[name](idx, targets)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    times, losses = {name: [] for name in models}, {}
    for i in range(args.warmup + args.steps):
        for name in models:
            start = time.perf_counter()
            losses[name] = step(name)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, losses


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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.nanogpt_model = import_nanogpt(args.nanogpt)
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), generator=generator).to(args.device)
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    print(f"GPT 4x128, 4 heads, B={args.batch_size} T={args.seq_len}, vocab 50304, AdamW, {args.device}, "
          f"{'compiled' if args.compile else 'eager'}, {torch.get_num_threads()} threads, median of {args.steps} steps after {args.warmup} warm-up, "
          f"alternating")
    for dtype in [dict(fp32=torch.float32, bf16=torch.bfloat16)[name] for name in args.dtypes]:
        models, optimizers = build(args)  # fresh, identical weights for each precision
        seconds, losses = step_seconds(models, optimizers, idx, targets, dtype, args)
        tps = {name: idx.numel() / s for name, s in seconds.items()}
        label = "fp32" if dtype == torch.float32 else "bf16 autocast"
        print(f"{label:14s} ours {tps['ours']:8.0f} tok/s, nanoGPT {tps['nanoGPT']:8.0f} tok/s, "
              f"ours/nanoGPT tok/s ratio {tps['ours'] / tps['nanoGPT']:.2f}x  (last losses: ours "
              f"{losses['ours']:.4f}, nanoGPT {losses['nanoGPT']:.4f})")


if __name__ == "__main__":
    main()
