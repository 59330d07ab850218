"""HellaSwag examples/s of hellaswag.evaluate (several examples per forward) against one example per forward.

    python bench/bench_hellaswag.py --threads 1           # the demo model (configs/demo_cpu.py), random weights, CPU
    python bench/bench_hellaswag.py --data hellaswag_val.jsonl --num-examples 1000 --dtype bfloat16
    python bench/bench_hellaswag.py --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024   # GPT-2 124M's shape

Two peers, each one example (4 rows) per forward: the loop of karpathy/build-nanogpt's hellaswag.py (tokenizes each
example, cross-entropy over every position, then the ending mask), and hellaswag.evaluate itself with batch_size 1
(what batching alone buys). hellaswag.evaluate gets render_all()'s tokens, made once outside the timings, as a
training run does. All must pick the same endings; the counts are checked. Without --data the examples come from the
cached download (if any) or the test fixture, cycled up to --num-examples. On a CPU that other processes share,
--threads 1 gives steadier numbers (two threads stall whenever one of them is descheduled).
"""
import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hellaswag  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


@torch.no_grad()
def naive_evaluate(model, examples, device, autocast_dtype):
    """build-nanogpt's loop: 4 rows per forward, the loss of every position computed, then masked."""
    block_size = model.config.block_size
    correct_norm = 0
    for example in examples:
        context, endings, _ = hellaswag.render_all([example])[0]
        rows = [(context + ending)[-block_size:] for ending in endings]
        masks = [([0] * len(context) + [1] * len(ending))[-block_size:] for ending in endings]
        width = max(len(row) for row in rows)
        tokens = torch.zeros(4, width, dtype=torch.long)
        mask = torch.zeros(4, width, dtype=torch.long)
        for i, (row, row_mask) in enumerate(zip(rows, masks)):
            tokens[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row_mask)] = torch.tensor(row_mask)
        tokens, mask = tokens.to(device), mask.to(device)
        with torch.autocast(tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(tokens)[0]
        shift_logits = logits[:, :-1, :].contiguous().float()
        shift_tokens = tokens[:, 1:].contiguous()
        shift_losses = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_tokens.view(-1),
                                       reduction="none").view(tokens.size(0), -1)
        shift_mask = mask[:, 1:].contiguous()
        avg_loss = (shift_losses * shift_mask).sum(dim=1) / shift_mask.sum(dim=1)
        correct_norm += int(avg_loss.argmin().item() == example["label"])
    return correct_norm


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="a HellaSwag jsonl (default: the cached download or the fixture)")
    parser.add_argument("--num-examples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="examples per forward in hellaswag.evaluate")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes of each; the median counts")
    # the demo model of configs/demo_cpu.py: 4 layers, 4 heads, 128 wide, 128-token context, GPT-2 vocabulary
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="autocast dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cached = os.path.join(os.environ.get("HELLASWAG_CACHE") or hellaswag.CACHE_DIR, "hellaswag_val.jsonl")
    path = args.data or (cached if os.path.isfile(cached) else os.path.join(ROOT, "tests", "fixtures",
                                                                           "hellaswag_small.jsonl"))
    examples = list(itertools.islice(itertools.cycle(hellaswag.load_examples(path)), args.num_examples))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd)).to(args.device).eval()
    autocast_dtype = None if args.dtype == "float32" else torch.bfloat16
    print(f"{len(examples)} examples from {path}; model {model.num_params() / 1e6:.1f}M parameters "
          f"({args.n_layer} layers, {args.n_embd} wide, context {args.block_size}), {args.device}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")

    rendered = hellaswag.render_all(examples)  # once per run, as train_gpt2 does; also builds the tokenizer
    contenders = {
        "build-nanogpt per-example loop": lambda ex: naive_evaluate(model, ex, args.device, autocast_dtype),
        "hellaswag.evaluate, batch 1": lambda ex: hellaswag.evaluate(
            model, ex, device=args.device, autocast_dtype=autocast_dtype, batch_size=1)["correct_norm"],
        f"hellaswag.evaluate, batch {args.batch_size}": lambda ex: hellaswag.evaluate(
            model, ex, device=args.device, autocast_dtype=autocast_dtype, batch_size=args.batch_size)["correct_norm"],
    }
    inputs = [examples, rendered, rendered]
    for fn, ex in zip(contenders.values(), inputs):  # warm-up
        fn(ex[:2 * args.batch_size])

    # alternate the contenders pass by pass, so a busy spell of the shared machine slows all of them alike
    seconds = {name: [] for name in contenders}
    counts = {}
    for _ in range(args.repeats):
        for (name, fn), ex in zip(contenders.items(), inputs):
            counts[name], s = timed(fn, ex)
            seconds[name].append(s)
    if len(set(counts.values())) != 1:
        sys.exit(f"mismatch: correct_norm differs: {counts}")
    rates = {name: len(examples) / statistics.median(s) for name, s in seconds.items()}
    peer = rates["build-nanogpt per-example loop"]
    print(f"median of {args.repeats} alternating passes each; all {counts[name]}/{len(examples)} correct_norm")
    for name, rate in rates.items():
        print(f"{name:34s} {rate:8.1f} examples/s   {rate / peer:.2f}x the build-nanogpt loop")
    batched = rates[name]
    print(f"batch {args.batch_size} against batch 1: {batched / rates['hellaswag.evaluate, batch 1']:.2f}x; the full "
          f"validation set (10,042 examples) would take {10042 / batched / 60:.1f} min here")


if __name__ == "__main__":
    main()
