"""Soak test of crash recovery (run by hand; minutes): SIGKILL one rank of a 2-rank gloo run of train_gpt2.py at
seeded random points (inside a checkpoint shard write, between the shards and the completeness marker, after a
random optimizer step), rerun the same command after each kill, and finally compare the losses with an uninterrupted
run. Prints the kills by kind, the checkpoints found incomplete or damaged, and whether the losses match bit for bit.

    python bench/soak_kill.py --kills 50            # the full soak
    python bench/soak_kill.py --kills 6 --max-steps 24
"""
import argparse
import collections
import os
import pathlib
import random
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from checkpoint import check_checkpoint, complete_checkpoints  # noqa: E402
from test_train_gpt2_distributed import launch  # noqa: E402
from conftest import metrics, tiny, write_byte_dataset  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="soak_kill_")
    data = os.path.join(work, "bytes")
    write_byte_dataset(data)
    config = dict(max_steps=args.max_steps, ckpt_every_steps=args.ckpt_every, val_every_steps=args.ckpt_every * 5)
    t0 = time.perf_counter()
    result = launch_in(work, tiny(data, os.path.join(work, "reference"), **config))
    assert result.returncode == 0, result.stderr[-3000:]
    out = os.path.join(work, "killed")
    kinds, runs, left_incomplete = collections.Counter(), 0, 0
    while kinds.total() < args.kills:
        done = complete_checkpoints(os.path.join(out, "ckpt"))
        start = int(os.path.basename(done[-1])[5:]) if done else 0
        ahead = [s for s in range(start + args.ckpt_every, args.max_steps, args.ckpt_every)]
        if not ahead:
            break  # too close to the end to kill inside a checkpoint: let the run finish
        kind = rng.choice(["bytes", "marker", "step"])
        fault = {"bytes": f"bytes:{rng.randrange(2)}:{rng.choice(ahead[:3])}:{rng.randrange(1, 200_000)}",
                 "marker": f"marker:{rng.choice(ahead[:3])}",
                 "step": f"step:{rng.randrange(2)}:{rng.randrange(1, 3 * args.ckpt_every)}"}[kind]
        result = launch_in(work, tiny(data, out, **config), fault)
        runs += 1
        if result.returncode == 0:
            break  # the run reached its end before the fault fired
        kinds[kind] += 1
        left_incomplete += sum(name.endswith(".tmp") for name in os.listdir(os.path.join(out, "ckpt")))
        ckpt_root = os.path.join(out, "ckpt")
        steps = [os.path.join(ckpt_root, n) for n in os.listdir(ckpt_root) if re.fullmatch(r"step_\d{8}", n)]
        assert sorted(steps) == complete_checkpoints(ckpt_root), f"{fault}: an incomplete step_N"
        assert all(check_checkpoint(p) is None for p in steps), f"{fault}: a damaged step_N"
    result = launch_in(work, tiny(data, out, **config))
    assert result.returncode == 0, result.stderr[-3000:]
    same = metrics(out, "train_loss") == metrics(os.path.join(work, "reference"), "train_loss") and \
        metrics(out, "val_loss") == metrics(os.path.join(work, "reference"), "val_loss")
    print(f"{kinds.total()} kills in {runs + 1} runs of {args.max_steps} steps ({dict(kinds)}); interrupted "
          f"checkpoint writes left as *.tmp: {left_incomplete}; every step_N complete after every kill: yes; final "
          f"losses equal the uninterrupted run bit for bit: {'yes' if same else 'NO'} "
          f"({time.perf_counter() - t0:.0f} s, in {work})")
    sys.exit(0 if same else 1)


def launch_in(work, args, fault="none"):
    return launch(pathlib.Path(work), args, fault)


if __name__ == "__main__":
    main()
