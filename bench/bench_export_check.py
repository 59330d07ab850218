"""What the check of the model's function adds to a run's start: hf_files.check_function (the configured model, every
layer and the whole context, exported and read back with transformers, and the fingerprint every checkpoint records),
for the demo's and the 124M config's architectures, against the limits of 2 s and 10 s.

    python bench/bench_export_check.py --rounds 5

Each round runs two fresh processes, alternating: one imports what train_gpt2.py imports and builds the config's
GPTConfig, the other does the same and then runs the check, as setup() does before step 1. The figure is the
difference of their medians (the checks' share of a cold start, transformers' import included).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"configs/demo_cpu.py": 2.0, "configs/gpt2_124m.py": 10.0}
SCRIPT = """
import sys, time
t0 = time.perf_counter()
import train_gpt2, checkpoint, hf_files
cfg = train_gpt2.load_config([{config!r}])
config = checkpoint.model_config_of(cfg)
if {check}:
    exportable, line, _ = hf_files.check_function(config)
    assert exportable, line
print(time.perf_counter() - t0)
"""


def seconds(config, check):
    command = [sys.executable, "-c", SCRIPT.format(config=config, check=check)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return float(result.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for config, limit in LIMITS.items():
        plain, checked = [], []
        for _ in range(args.rounds):
            plain.append(seconds(config, False))
            checked.append(seconds(config, True))
        added = statistics.median(checked) - statistics.median(plain)
        print(f"{config}: start {statistics.median(plain):.2f} s, with the checks {statistics.median(checked):.2f} s "
              f"(medians of {args.rounds}): +{added:.2f} s, {added / limit:.2f}x the limit of {limit:g} s", flush=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
