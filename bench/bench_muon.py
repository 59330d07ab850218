"""Muon against AdamW on the quick-start demo model (configs/demo_cpu.py): val loss at equal steps and at equal
wall time, each as a ratio Muon / AdamW (below 1: Muon is ahead).

    python prepare_fineweb.py --input data/tinyshakespeare.txt --output-dir data/shakespeare   # once
    python bench/bench_muon.py                   # the demo's 400 steps
    python bench/bench_muon.py --steps 100       # a shorter schedule (warmup and decay fit into it)

AdamW trains with the demo's settings; Muon with the same ones and --optimizer=muon alone, so at Muon's own defaults
(TrainConfig's muon_lr for the matrices and SCALAR_LR_FACTOR x lr for the AdamW part). Equal steps: both train
--steps steps and their final val losses are compared. Equal wall time: the step time of each is measured in short
runs without validation, alternating (--rounds of each), and the median of Muon's over AdamW's says how many steps
AdamW trains in Muon's time of --steps; a third run trains AdamW for that many steps, on its own schedule (when that
is --steps, the two comparisons are the same runs). Alternating keeps a machine that slows down or speeds up
meanwhile from passing for either optimizer's cost.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2  # noqa: E402
from train_gpt2 import SCALAR_LR_FACTOR  # noqa: E402
from configurator import exec_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.py")


def train(out_dir, steps, args, **overrides):
    """(final val loss or None, median step seconds) of the demo trained for `steps` steps with `overrides`."""
    base = dict(data_paths=args.data_paths, index_mapping_dir=os.path.join(args.workdir, "cache"),
                max_steps=steps, val_every_steps=steps, sample_tokens=0, ckpt_every_steps=0, out_dir=out_dir)
    base.update(overrides)
    argv = [DEMO] + [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in base.items()]
    assert train_gpt2.main(argv) == 0
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    val = [r["val_loss"] for r in records if "val_loss" in r and r["step"] == steps] + [None]
    step_ms = [r["step_ms"] for r in records if "step_ms" in r][1:]  # the first step warms up
    return val[0], statistics.median(step_ms) / 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of each run (the demo's: 400)")
    parser.add_argument("--rounds", type=int, default=3, help="timing runs of each optimizer, alternating")
    parser.add_argument("--timing-steps", type=int, default=12, help="steps of each timing run")
    parser.add_argument("--sweep-lrs", type=float, nargs="*", default=[],
                        help="first train Muon at each of these muon_lr x each --sweep-factors (equal steps)")
    parser.add_argument("--sweep-factors", type=float, nargs="*", default=[1, 3],
                        help="the AdamW part's lr as these multiples of the demo's lr")
    parser.add_argument("--data-paths", default=os.path.join(ROOT, "data/shakespeare/processed_data_0_text_document"))
    args = parser.parse_args()
    demo, defaults = exec_config(DEMO), train_gpt2.TrainConfig()
    warmup = min(demo["lr_warmup_steps"], args.steps // 10)
    muon = dict(optimizer="muon", lr_warmup_steps=warmup)
    scalar_lr = defaults.muon_scalar_lr or SCALAR_LR_FACTOR * demo["lr"]
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        for muon_lr in args.sweep_lrs:
            for factor in args.sweep_factors:
                loss, _ = train(os.path.join(workdir, f"sweep_{muon_lr}_{factor}"), args.steps, args,
                                **dict(muon, muon_lr=muon_lr, muon_scalar_lr=factor * demo["lr"]))
                print(f"sweep: muon_lr {muon_lr:g}, AdamW part {factor:g}x lr: val loss {loss:.4f}", flush=True)
        ratios = []
        for k in range(args.rounds):
            timed = dict(lr_warmup_steps=1, val_tokens=0)
            adamw_s = train(os.path.join(workdir, f"time_adamw_{k}"), args.timing_steps, args, **timed)[1]
            muon_s = train(os.path.join(workdir, f"time_muon_{k}"), args.timing_steps, args, **dict(muon, **timed))[1]
            ratios.append(muon_s / adamw_s)
        adamw_loss, _ = train(os.path.join(workdir, "adamw"), args.steps, args, lr_warmup_steps=warmup)
        muon_loss, _ = train(os.path.join(workdir, "muon"), args.steps, args, **muon)
        same_time_steps = round(args.steps * statistics.median(ratios))
        timed_loss = adamw_loss
        if same_time_steps != args.steps:
            timed_loss, _ = train(os.path.join(workdir, "adamw_timed"), same_time_steps, args,
                                  lr_warmup_steps=min(demo["lr_warmup_steps"], same_time_steps // 10))
    print(f"\ndemo model, {args.steps} steps: AdamW (lr {demo['lr']:g}) val loss {adamw_loss:.4f}; Muon (lr "
          f"{defaults.muon_lr:g}, AdamW part {scalar_lr:g}) val loss {muon_loss:.4f}; Muon's step time / AdamW's: "
          f"{statistics.median(ratios):.3f}x (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"equal steps ({args.steps}): Muon / AdamW val loss {muon_loss / adamw_loss:.3f}x")
    print(f"equal wall time (AdamW trains {same_time_steps} steps in Muon's time of {args.steps}, val loss "
          f"{timed_loss:.4f}): Muon / AdamW val loss {muon_loss / timed_loss:.3f}x")


if __name__ == "__main__":
    main()
