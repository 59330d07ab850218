"""Training-step throughput of model.GPT against transformers' GPT2LMHeadModel (same weights, same batch, same run),
with and without the padded vocabulary, and the load time of one Hugging Face export by each.

    python bench/bench_model.py                                   # small GPT-2-vocabulary model, CPU, ~1 minute
    python bench/bench_model.py --n-layer 12 --n-head 12 --n-embd 768 --seq-len 1024 --device cuda --dtype bfloat16
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_files import from_pretrained  # noqa: E402
from model import GPT  # noqa: E402


def step_seconds(models, idx, labels, *, steps, device, dtype):
    """Median seconds of a forward + backward of the mean next-token loss, per model. The models take turns step by
    step, so load from other processes on a shared machine hits them alike; the first round is a warm-up."""
    def step(model):
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            if isinstance(model, GPT):
                loss = model(idx, labels)[1]
            else:
                loss = model(idx, labels=labels, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    times = {name: [] for name in models}
    for _ in range(steps + 1):
        for name, model in models.items():
            start = time.perf_counter()
            step(model)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                    n_positions=args.seq_len, vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0))
    with tempfile.TemporaryDirectory() as export:
        hf.save_pretrained(export)
        start = time.perf_counter()
        GPT2LMHeadModel.from_pretrained(export)
        hf_load = time.perf_counter() - start
        start = time.perf_counter()
        ours = from_pretrained(export)
        ours_load = time.perf_counter() - start
        padded = from_pretrained(export, padded_vocab_size=50304)
    idx = torch.randint(0, 50257, (args.batch_size, args.seq_len), device=args.device)
    labels = idx  # transformers shifts labels itself; our targets would be shifted, which costs the same

    print(f"GPT-2 {args.n_layer}x{args.n_embd}, {ours.num_params() / 1e6:.1f}M params, batch {args.batch_size}x"
          f"{args.seq_len}, {args.device} {args.dtype}, {args.steps} steps")
    print(f"load:  ours {ours_load:.2f}s, transformers {hf_load:.2f}s, ratio {hf_load / ours_load:.2f}x")
    models = {"transformers": hf, "ours": ours, "ours padded 50304": padded}
    seconds = step_seconds({name: m.to(args.device) for name, m in models.items()}, idx, labels, steps=args.steps,
                           device=args.device, dtype=dtype)
    for name in ("ours", "ours padded 50304"):
        ours_tps, hf_tps = idx.numel() / seconds[name], idx.numel() / seconds["transformers"]
        print(f"train step: {name:18s} {ours_tps:9.0f} tok/s, transformers {hf_tps:9.0f} tok/s, "
              f"ratio {ours_tps / hf_tps:.2f}x")

if __name__ == "__main__":
    main()
