"""The stall a checkpoint adds to training: written in the background (async_checkpoint=True, the default) against
the blocking save (async_checkpoint=False), on a CPU, a checkpoint every 2 steps.

    python bench/bench_async_checkpoint.py                       # 12 x 384, GPT-2's vocabulary, 8 steps, 3 rounds
    python bench/bench_async_checkpoint.py --n-layer 24 --n-embd 768 --rounds 5

Each run is train_gpt2.main in a fresh process on a synthetic token dataset (validation and the final export
aside). The stall is the time of the loop outside its steps (train_gpt2 times each step from its batch to its
optimizer update; a save, and the wait for a write in flight, fall outside), minus the same in the round's run
without checkpoints but the final one (ckpt_every_steps=0): so a machine whose load changes between runs moves the
step times, not the stall. The median step of each mode is printed beside it: on a CPU the writing thread competes
with the step's own threads, and that shows there. A round runs without checkpoints first, then blocking and
background in alternating order. Printed: each round, the medians and the ratio background / blocking stall
(goal <= 0.5).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2  # noqa: E402
from bench_train import synthetic_dataset  # noqa: E402

MODES = {"none": dict(ckpt_every_steps=0), "blocking": dict(ckpt_every_steps=2, async_checkpoint=False),
         "background": dict(ckpt_every_steps=2, async_checkpoint=True)}


def loop_seconds(argv, out_dir):
    """(seconds from the first step to the end of the loop, of them the seconds outside the steps, median step
    seconds) of train_gpt2.main(argv) in this process. A step is timed by train_gpt2 itself, from its batch to its
    optimizer update: a save, and the wait for a write, fall outside it."""
    times = {}
    real_start = train_gpt2.StepLog.start_step

    def start_step(self):
        times.setdefault("start", time.perf_counter())
        real_start(self)

    def publish_hf(model, cfg):  # the loop is done, its last checkpoint written; the export is not timed
        times["end"] = time.perf_counter()

    train_gpt2.StepLog.start_step, train_gpt2.publish_hf = start_step, publish_hf
    assert train_gpt2.main(argv) == 0
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = [record["step_ms"] / 1000 for record in map(json.loads, f) if "step_ms" in record]
    loop = times["end"] - times["start"]
    return loop, loop - sum(steps), statistics.median(steps)


def run_args(args, prefix, out_dir, mode):
    config = dict(data_paths=prefix, index_mapping_dir=os.path.dirname(prefix), split="100,0,0",
                  seq_length=args.seq_length, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                  vocab_size=args.vocab_size, padded_vocab_size=args.padded_vocab_size,
                  global_batch_size=args.batch_size, local_batch_size=args.batch_size, max_steps=args.steps,
                  lr_warmup_steps=1, val_tokens=0, val_every_steps=args.steps, device="cpu", dtype="float32",
                  compile=False, out_dir=out_dir, **MODES[mode])
    return [f"--{key}={value}" for key, value in config.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--padded-vocab-size", type=int, default=50304)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="where the runs write (default: a temporary directory)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # [out_dir, train_gpt2 arguments], as JSON
    args = parser.parse_args()
    if args.child:
        out_dir, argv = json.loads(args.child)
        print(json.dumps(loop_seconds(argv, out_dir)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        prefix = os.path.join(work, "tokens")
        synthetic_dataset(prefix, args.vocab_size, args.steps * args.batch_size * (args.seq_length + 1) * 4)
        stalls, outside, step = {"blocking": [], "background": []}, {}, {}
        for round_index in range(args.rounds):
            order = ["none", "blocking", "background"]
            if round_index % 2:  # alternate which of the two runs right after the run without checkpoints
                order = ["none", "background", "blocking"]
            for mode in order:
                out_dir = os.path.join(work, f"{mode}_{round_index}")
                child = json.dumps([out_dir, run_args(args, prefix, out_dir, mode)])
                child = [sys.executable, __file__, "--child", child]
                output = subprocess.run(child, check=True, capture_output=True, text=True).stdout
                _, outside[mode], step[mode] = json.loads(output.strip().splitlines()[-1])
            for mode in stalls:
                stalls[mode].append(outside[mode] - outside["none"])
            print(f"round {round_index + 1}: median step {step['none']:.2f} s without checkpoints, "
                  f"{step['blocking']:.2f} s blocking, {step['background']:.2f} s background; stall outside the "
                  f"steps: blocking {stalls['blocking'][-1]:+.2f} s, background {stalls['background'][-1]:+.2f} s",
                  flush=True)
    blocking, background = statistics.median(stalls["blocking"]), statistics.median(stalls["background"])
    saves = args.steps // 2 - 1  # the final checkpoint is written in every mode
    print(f"GPT {args.n_layer} x {args.n_embd}, vocabulary {args.padded_vocab_size}, B={args.batch_size} "
          f"T={args.seq_length}, fp32 CPU, {args.steps} steps, {saves} checkpoints more than without; medians of "
          f"{args.rounds} rounds: stall blocking {blocking:.2f} s, background {background:.2f} s")
    print(f"background / blocking stall: {background / blocking:.2f}x (goal <= 0.5x)")


if __name__ == "__main__":
    main()
