"""The step right after an evaluation against the step before it, in a compiled CPU run: evaluation as it runs now
(the model uncompiled, under torch.compiler.set_stance("force_eager")) against evaluation compiled as before (that
stance made a no-op, so that validation, HellaSwag and the sample run the compiled blocks and loss head).

    python bench/bench_eval_compile.py                    # 3 rounds, 24 steps, an evaluation every 4
    python bench/bench_eval_compile.py --rounds 3 --steps 40

The run is configs/demo_cpu.py (its data prepared here from the bundled Shakespeare) at 2 layers x 64 with compile
on, validation, HellaSwag (the tests' small fixture) and a 16-token sample every --val-every steps. Each mode runs in
a fresh process (no graph or cache shared in memory), alternating. For each evaluation after the first step, the
ratio is the step right after it over the median of the 3 steps before it (step 0, which compiles, left out); the
median over evaluations and rounds is printed, with the time the evaluations of a run took and the graphs dynamo
compiled (training's alone: 2, one per compiled function).
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELLASWAG = os.path.join(ROOT, "tests", "fixtures", "hellaswag_small.jsonl")
MODES = ("uncompiled evaluation (now)", "compiled evaluation (before)")


def child(mode, out, data, steps, val_every):
    """One run in this process; prints a JSON line: each evaluation's seconds, the graphs compiled, each step's ms."""
    sys.path.insert(0, ROOT)
    import torch
    import train_gpt2
    from torch._dynamo.utils import counters

    if mode == MODES[1]:  # as before: evaluation runs whatever torch.compile made of the model
        torch.compiler.set_stance = lambda *args, **kwargs: contextlib.nullcontext()
    evaluations, real_call = {}, train_gpt2.Evaluator.__call__

    def timed(self, model, step, stop):
        start = time.perf_counter()
        try:
            return real_call(self, model, step, stop)
        finally:
            evaluations[step] = time.perf_counter() - start

    train_gpt2.Evaluator.__call__ = timed
    args = [os.path.join(ROOT, "configs", "demo_cpu.py"), f"--data_paths={data!r}", f"--out_dir={out!r}",
            "--n_layer=2", "--n_head=2", "--n_embd=64", "--compile=True", f"--max_steps={steps}",
            f"--val_every_steps={val_every}", f"--hellaswag={HELLASWAG!r}", "--sample_tokens=16",
            "--val_tokens=1280", "--ckpt_every_steps=0", "--hf_export='off'"]
    assert train_gpt2.main(args) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        step_ms = {r["step"]: r["step_ms"] for r in map(json.loads, f) if "step_ms" in r}
    print("RESULT " + json.dumps(dict(evaluations=evaluations, graphs=counters["frames"]["ok"], step_ms=step_ms)))


def after_over_before(step_ms, s):
    """The step right after the evaluation at step s over the median of the 3 steps before it (not step 0)."""
    before = [step_ms[str(b)] for b in range(max(1, s - 3), s)]
    return step_ms[str(s)] / statistics.median(before)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "OUT", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.steps, args.val_every)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--input",
                        os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--output-dir", tmp, "--workers", "1"],
                       check=True, capture_output=True)
        data = os.path.join(tmp, "processed_data_0_text_document")
        results = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES:
                out = os.path.join(tmp, f"out_{round_}_{MODES.index(mode)}")
                command = [sys.executable, __file__, "--steps", str(args.steps), "--val-every", str(args.val_every),
                           "--child", mode, out, data]
                done = subprocess.run(command, capture_output=True, text=True)
                assert done.returncode == 0, done.stderr[-3000:]
                line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
                results[mode].append(json.loads(line.removeprefix("RESULT ")))
    ratios, eval_seconds = {}, {}
    for mode, runs in results.items():
        ratios[mode] = [after_over_before(run["step_ms"], s) for run in runs
                        for s in map(int, run["evaluations"]) if 1 < s < args.steps]
        eval_seconds[mode] = [sum(run["evaluations"].values()) for run in runs]
        graphs = sorted({run["graphs"] for run in runs})
        print(f"{mode}: step after an evaluation / step before it: median {statistics.median(ratios[mode]):.2f}x "
              f"(each: {', '.join(f'{r:.2f}' for r in ratios[mode])}); all evaluations of a run "
              f"{', '.join(f'{s:.1f}' for s in eval_seconds[mode])} s; graphs compiled: {graphs}")
    now, before = (statistics.median(eval_seconds[mode]) for mode in MODES)
    print(f"evaluation time, uncompiled / compiled as before: {now / before:.2f}x ({now:.1f} vs {before:.1f} s a run)")


if __name__ == "__main__":
    main()
