"""Soak test of stopping under torchrun (run by hand; minutes): 2 gloo ranks of train_gpt2.py are sent SIGTERM at
seeded random moments (during setup, an evaluation, a checkpoint write, the Hugging Face export, or after an optimizer
step), either once to torchrun, which forwards it, or twice as Slurm does (to every worker, then to torchrun 0.1 s
later); the same command is rerun until the run completes, and each run must end equal to an uninterrupted one: the
losses in main.log and metrics.jsonl and the bytes of hf/. Prints the signals by phase and kind, how many stops wrote
their checkpoint, the steps lost, worker tracebacks, and whether every run was equal (naming the runs that were not).

    python bench/soak_torchrun.py --runs 20            # the full soak
    python bench/soak_torchrun.py --runs 1 --only-run 7 --seed 0   # run 7 of the seed-0 soak again, alone
"""
import argparse
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from checkpoint import complete_checkpoints  # noqa: E402
from conftest import hf_difference, kill_tree, metrics, tiny, vislog, write_byte_dataset  # noqa: E402

PHASES = ("setup", "evaluation", "checkpoint", "export", "step")

# the hooks live here, not in the product: SOAK_SIGNAL=phase:nth:rank:delay_s:kind makes rank `rank`, on the nth
# (0-based) entry into the phase's function, start a shell that sleeps delay_s and then signals: "single" SIGTERMs
# torchrun (which forwards it to its workers), "double" SIGTERMs every worker and torchrun 0.1 s later. The shell
# outlives the worker, so a worker killed by the first signal does not spare torchrun the second.
LAUNCHER = """
import os, subprocess, sys
import torch
import checkpoint
import train_gpt2
spec = os.environ.get("SOAK_SIGNAL")
if spec:
    phase, nth, sender, delay, kind = spec.split(":")
    nth, sender = int(nth), int(sender)

    def send():
        torchrun = os.getppid()
        workers = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == torchrun:
                        workers.append(entry)
            except (OSError, IndexError, ValueError):
                pass
        first = f"kill -TERM {' '.join(workers)}; sleep 0.1; " if kind == "double" else ""
        script = f"sleep {delay}; {first}kill -TERM {torchrun}; echo {phase}:{kind} >> {os.environ['SOAK_SENT']}"
        subprocess.Popen(["sh", "-c", script], start_new_session=True)

    def at(owner, name):
        real, calls = getattr(owner, name), [0]

        def wrapper(*args, **kwargs):
            if calls[0] == nth:
                send()
            calls[0] += 1
            return real(*args, **kwargs)
        setattr(owner, name, wrapper)
    if int(os.environ.get("RANK", 0)) == sender:
        owner, name = {"setup_distributed": (train_gpt2, "setup_distributed"), "setup": (train_gpt2, "setup"),
                       "evaluation": (train_gpt2.Evaluator, "__call__"), "checkpoint": (checkpoint, "save_checkpoint"),
                       "export": (train_gpt2, "publish_hf"), "step": (torch.optim.AdamW, "step")}[phase]
        at(owner, name)
train_gpt2.cli()
"""


def launch(work, args, spec=None, timeout=300):
    """One torchrun of 2 ranks: (exit status or "hung", its output, the signals its hook sent)."""
    sent_path = os.path.join(work, "sent")
    if os.path.exists(sent_path):
        os.remove(sent_path)
    env = dict(os.environ, PYTHONPATH=ROOT, SOAK_SENT=sent_path)
    env.pop("SOAK_SIGNAL", None)
    if spec:
        env["SOAK_SIGNAL"] = spec
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(work, "launch_with_signal.py"), *args]
    log_path = os.path.join(work, "launches", f"{len(os.listdir(os.path.join(work, 'launches'))):04d}.out")
    with open(log_path, "w") as out:
        out.write(f"SOAK_SIGNAL={spec}\n{' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = "hung"
        finally:
            kill_tree(proc)
    time.sleep(0.3)  # a signal shell still sleeping records itself before it is read (its delay is at most 0.25 s)
    with open(log_path) as f:
        output = f.read()
    sent = open(sent_path).read().split() if os.path.exists(sent_path) else []
    return status, output, sent


def signal_spec(rng, cfg):
    """A seeded random moment: (phase, SOAK_SIGNAL)."""
    phase, kind, sender = rng.choice(PHASES), rng.choice(["single", "double"]), rng.randrange(2)
    if phase == "setup":  # before the signal handlers exist (process group init) or while the run sets itself up
        hook, nth, delay = rng.choice(["setup_distributed", "setup"]), 0, rng.uniform(0, 1.5)
    elif phase == "evaluation":
        hook, nth, delay = phase, rng.randrange(2), rng.uniform(0, cfg["eval_s"])
    elif phase == "checkpoint":
        hook, nth, delay = phase, rng.randrange(3), rng.uniform(0, 0.2)  # a write takes 0.2-0.6 s here
    elif phase == "export":
        hook, nth, delay = phase, 0, rng.uniform(0, 0.15)  # so does the export
    else:
        hook, nth, delay = phase, rng.randrange(1, cfg["max_steps"]), rng.uniform(0, 0.05)
    return phase, f"{hook}:{nth}:{sender}:{delay:.3f}:{kind}"


def same_run(out, reference):
    """'' when out ended equal to the reference run (losses in main.log and metrics.jsonl, hf/ bytes), else why not."""
    try:
        if vislog(os.path.join(out, "main.log")) != vislog(os.path.join(reference, "main.log")):
            return "main.log differs"
    except AssertionError as e:  # a line vislog cannot read
        return str(e)
    for key in ("train_loss", "val_loss", "grad_norm"):
        try:
            if metrics(out, key) != metrics(reference, key):
                return f"metrics.jsonl {key} differs"
        except json.JSONDecodeError as e:
            return f"metrics.jsonl is not JSON lines: {e}"
    return hf_difference(out, reference)


def newest_step(out):
    done = complete_checkpoints(os.path.join(out, "ckpt")) if os.path.isdir(os.path.join(out, "ckpt")) else []
    return int(os.path.basename(done[-1])[len("step_"):]) if done else 0


def trained_to(out, offset):
    """1 + the last step main.log logged after its first `offset` bytes (0: none)."""
    if not os.path.exists(os.path.join(out, "main.log")):
        return 0
    with open(os.path.join(out, "main.log")) as f:
        f.seek(offset)
        return max((int(n) + 1 for n in re.findall(r"^s:(\d+) trl:", f.read(), re.M)), default=0)


def soak_run(work, data, config, reference, rng, counts, tracebacks, max_signals=3, max_attempts=8):
    """One run in a fresh out_dir, signalled at up to max_signals random moments, rerun until it completes; '' when
    it ended equal to the reference, else what differed."""
    out = os.path.join(work, "run")
    shutil.rmtree(out, ignore_errors=True)
    args = tiny(data, out, **{k: v for k, v in config.items() if k != "eval_s"})
    signals = 0
    for attempt in range(max_attempts):
        spec = None
        if signals < max_signals and (attempt == 0 or rng.random() < 0.5):
            phase, spec = signal_spec(rng, config)
        main_log = os.path.join(out, "main.log")
        log_size = os.path.getsize(main_log) if os.path.exists(main_log) else 0
        status, output, sent = launch(work, args, spec)
        counts["attempts"] += 1
        if status == "hung":
            counts["hung"] += 1
            return f"attempt {attempt} hung ({spec}):\n{output[-3000:]}"
        if re.search(r'File ".*train_gpt2\.py", line', output):
            counts["launches with a train_gpt2.py traceback"] += 1
            tracebacks.append(f"{spec}:\n{output[-3000:]}")
        if sent:
            signals += 1
            kind = sent[0].split(":")[1]
            counts["signals"] += 1
            counts[f"phase {phase}"] += 1
            counts[kind] += 1
            lost = max(0, trained_to(out, log_size) - newest_step(out))  # trained again by the next launch
            if re.search(r"stopped by a signal at step \d+", output):
                counts["outcome: stopped with its checkpoint"] += 1
            elif status == 0 or "exported Hugging Face weights" in output or "already complete" in output:
                counts["outcome: finished all the same"] += 1
            elif lost == 0:
                counts["outcome: killed, nothing lost"] += 1  # e.g. before the signal handlers exist
            else:
                counts["outcome: killed, steps lost"] += 1
                counts[f"steps lost in {phase} ({kind})"] += lost
        if status == 0 and not sent:
            break
    else:
        return f"never completed in {max_attempts} attempts"
    return same_run(out, reference)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-run", type=int, default=None, help="repeat this run of the seed's soak alone")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="soak_torchrun_")
    with open(os.path.join(work, "launch_with_signal.py"), "w") as f:
        f.write(LAUNCHER)
    os.makedirs(os.path.join(work, "launches"))  # every launch's output, in order
    data = os.path.join(work, "bytes")
    write_byte_dataset(data)
    config = dict(max_steps=args.max_steps, ckpt_every_steps=args.ckpt_every, val_every_steps=args.val_every,
                  val_tokens=16384)  # 512 windows: an evaluation long enough to be interrupted
    t0 = time.perf_counter()
    reference = os.path.join(work, "reference")
    status, output, _ = launch(work, tiny(data, reference, **config))
    assert status == 0, output[-3000:]
    config["eval_s"] = max(float(s) for s in re.findall(r"val loss [\d.]+ \| ([\d.]+) s", output))
    counts, failures, tracebacks, done = collections.Counter(), [], [], []
    try:
        for index in [args.only_run] if args.only_run is not None else range(args.runs):
            why = soak_run(work, data, config, reference, random.Random(f"{args.seed}:{index}"), counts, tracebacks)
            print(f"run {index}: {why or 'equal'}", flush=True)
            done.append(index)
            if why:
                failures.append(index)
                shutil.copytree(os.path.join(work, "run"), os.path.join(work, f"failed_run_{index}"))
    except KeyboardInterrupt:  # Ctrl-C (or kill -INT) ends the soak early: the counts of the runs that finished
        print(f"interrupted during run {len(done)}: counting the {len(done)} runs before it (the signals of the "
              f"interrupted one included)")
    phases = {p: counts[f"phase {p}"] for p in PHASES}
    outcomes = {key[len("outcome: "):]: n for key, n in sorted(counts.items()) if key.startswith("outcome: ")}
    lost = {key[len("steps lost in "):]: n for key, n in sorted(counts.items()) if key.startswith("steps lost in ")}
    print(f"{len(done)} runs ({counts['attempts']} torchrun launches) of {args.max_steps} steps on 2 ranks; "
          f"{counts['signals']} signals sent (by phase {phases}; single {counts['single']}, double "
          f"{counts['double']}); outcomes {outcomes}; steps trained again after a kill {lost or 0}; launches with a "
          f"train_gpt2.py traceback: {counts['launches with a train_gpt2.py traceback']}; hung: {counts['hung']}; "
          f"every run equal to the uninterrupted one (losses, main.log, hf/): "
          + ("yes" if not failures else f"NO, runs {failures} (rerun one with --seed {args.seed} --only-run N)")
          + f" ({time.perf_counter() - t0:.0f} s, in {work})")
    if tracebacks:
        print("the first launch with a traceback, its signal and the end of its output:\n" + tracebacks[0])
    sys.exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
