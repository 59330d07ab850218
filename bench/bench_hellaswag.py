"""HellaSwag examples/s of hellaswag.evaluate (as many examples per forward as --batch-tokens hold) against the
module before token batching (commit BEFORE: 4 examples per forward, logits at every position) and one example per
forward (karpathy/build-nanogpt's loop).

    python bench/bench_hellaswag.py --threads 1           # the demo model (configs/demo_cpu.py), random weights, CPU
    python bench/bench_hellaswag.py --data hellaswag_val.jsonl --num-examples 1000 --dtype bfloat16
    python bench/bench_hellaswag.py --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024   # GPT-2 124M's shape

The three run side by side in one process, pass by pass, on the same model; the earlier module is read with
`git show BEFORE:hellaswag.py` (so the bench runs in a clone). Both evaluates get render_all()'s tokens, made once
outside the timings, as a training run does. All must count the same correct endings (by mean and by sum loss).
Without --data the examples come from the cached download (if any) or the test fixture, cycled up to --num-examples.
On a CPU that other processes share, --threads 1 gives steadier numbers (two threads stall whenever one of them is
descheduled).
"""
import argparse
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hellaswag  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

BEFORE = "1492cee"  # the last commit that scored 4 examples per forward


def module_before():
    """hellaswag.py as it was at BEFORE, imported under the name hellaswag_before."""
    source = subprocess.run(["git", "show", f"{BEFORE}:hellaswag.py"], cwd=ROOT, capture_output=True, text=True)
    if source.returncode != 0:
        sys.exit(f"bench_hellaswag.py: error: git show {BEFORE}:hellaswag.py failed: {source.stderr.strip()}")
    spec = importlib.util.spec_from_loader("hellaswag_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source.stdout, f"{BEFORE}:hellaswag.py", "exec"), module.__dict__)
    return module


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
    parser.add_argument("--num-examples", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward in hellaswag.evaluate")
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
                          n_embd=args.n_embd)).to(args.device)
    autocast_dtype = None if args.dtype == "float32" else torch.bfloat16
    print(f"{len(examples)} examples from {path}; model {model.num_params() / 1e6:.1f}M parameters "
          f"({args.n_layer} layers, {args.n_embd} wide, context {args.block_size}), {args.device}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")

    before = module_before()
    rendered = hellaswag.render_all(examples)  # once per run, as train_gpt2 does; also builds the tokenizer
    rendered_before = before.render_all(examples)

    def counts(result):
        return result["correct_norm"], result["correct"]

    peer = "build-nanogpt per-example loop"
    old, new = f"before ({BEFORE}), 4 examples/forward", f"hellaswag.evaluate, {args.batch_tokens} tokens/forward"
    contenders = {  # name: (scoring function, its input)
        peer: (lambda ex: (naive_evaluate(model, ex, args.device, autocast_dtype), None), examples),
        old: (lambda ex: counts(before.evaluate(model, ex, device=args.device, autocast_dtype=autocast_dtype,
                                                batch_size=4)), rendered_before),
        new: (lambda ex: counts(hellaswag.evaluate(model, ex, device=args.device, autocast_dtype=autocast_dtype,
                                                   batch_tokens=args.batch_tokens)), rendered),
    }
    for fn, ex in contenders.values():  # warm-up
        fn(ex[:8])

    # alternate the contenders pass by pass, so a busy spell of the shared machine slows all of them alike
    seconds, results = {name: [] for name in contenders}, {}
    for _ in range(args.repeats):
        for name, (fn, ex) in contenders.items():
            results[name], s = timed(fn, ex)
            seconds[name].append(s)
    if results[old] != results[new] or results[peer][0] != results[new][0]:
        sys.exit(f"mismatch: (correct_norm, correct) differ: {results}")
    rates = {name: len(examples) / statistics.median(s) for name, s in seconds.items()}
    print(f"median of {args.repeats} alternating passes each; identical counts: correct_norm {results[new][0]}, "
          f"correct {results[new][1]} of {len(examples)}")
    for name, rate in rates.items():
        print(f"{name:42s} {rate:8.1f} examples/s   {rate / rates[old]:.2f}x before")
    print(f"the full validation set (10,042 examples) would take {10042 / rates[new] / 60:.1f} min here "
          f"(before: {10042 / rates[old] / 60:.1f} min)")


if __name__ == "__main__":
    main()
