"""Faults a run must survive or report in one line: SIGKILL of one rank of a 2-rank gloo run at seeded points (inside
a checkpoint's shard write, between the shards and the marker, between steps), then the same command again until
it finishes, with the final losses bit for bit those of an uninterrupted run; non-finite weights; a full disk;
paths that are files or read-only; a second run on a locked out_dir; SIGTERM's exit status."""
import errno
import os
import random
import re
import runpy
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from model import check_checkpoint, complete_checkpoints
import plot_log
import sample
import train_gpt2
from conftest import metrics, tiny, wait_for_line

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# the hooks live here, not in the product: FAULT=kind:args kills this process (SIGKILL) at one chosen point
LAUNCHER = """
import os, signal, sys
import torch
import torch.distributed.checkpoint.filesystem as fs
import train_gpt2
kind, *args = os.environ.get("FAULT", "none").split(":")
args = [int(a) for a in args]
rank = int(os.environ.get("RANK", 0))
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if kind == "step" and rank == args[0]:  # after this process's args[1]-th optimizer step
    real_step, steps = torch.optim.AdamW.step, [0]
    def step(self, *a, **kw):
        result = real_step(self, *a, **kw)
        steps[0] += 1
        if steps[0] == args[1]:
            die()
        return result
    torch.optim.AdamW.step = step
if kind == "bytes" and rank == args[0]:  # once args[2] bytes of this rank's shard of checkpoint step args[1] are out
    real_save, real_write, current = train_gpt2.dcp.save, fs._write_item, [""]
    def save(state_dict, checkpoint_id, **kwargs):
        current[0] = str(checkpoint_id)
        return real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
    def write_item(transforms, stream, *rest, **kwargs):
        result = real_write(transforms, stream, *rest, **kwargs)
        if current[0].endswith(f"step_{args[1]:08d}.tmp") and stream.tell() >= args[2]:
            stream.flush()
            die()
        return result
    train_gpt2.dcp.save, fs._write_item = save, write_item
if kind == "marker" and rank == 0:  # every file of checkpoint step args[0] written and synced, the marker not yet
    real_fsync_tree = train_gpt2.fsync_tree
    def fsync_tree(path):
        sizes = real_fsync_tree(path)
        if path.endswith(f"step_{args[0]:08d}.tmp"):
            die()
        return sizes
    train_gpt2.fsync_tree = fsync_tree
train_gpt2.cli()  # as `python train_gpt2.py ARGS`: exit status and error lines
"""


def launch(tmp_path, args, fault="none", nproc=2, timeout=300):
    launcher = tmp_path / "launch_with_fault.py"
    launcher.write_text(LAUNCHER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(launcher),
           *args]
    env = dict(os.environ, FAULT=fault, PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def kill_points(seed, max_steps, every):
    """Seeded faults: one inside a shard write, one before a marker, one between steps."""
    rng = random.Random(seed)
    ckpts = list(range(every, max_steps, every))
    return [f"bytes:{rng.randrange(2)}:{rng.choice(ckpts)}:{rng.randrange(1, 200_000)}",
            f"marker:{rng.choice(ckpts)}", f"step:{rng.randrange(2)}:{rng.randrange(1, every + 2)}"]


def assert_only_complete_checkpoints(out):
    """Every step_N directory is complete and readable; interrupted writes are only *.tmp directories."""
    ckpt_root = os.path.join(out, "ckpt")
    steps = [os.path.join(ckpt_root, n) for n in os.listdir(ckpt_root) if re.fullmatch(r"step_\d{8}", n)]
    assert sorted(steps) == complete_checkpoints(ckpt_root)
    assert all(check_checkpoint(path) is None for path in steps)


def test_sigkill_at_seeded_points_then_rerun_gives_the_uninterrupted_run_bit_for_bit(data, tmp_path):
    config = dict(max_steps=16, ckpt_every_steps=4, val_every_steps=8)
    reference = launch(tmp_path, tiny(data, tmp_path / "reference", **config))
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "killed"
    for fault in kill_points(0, 16, 4):
        before = complete_checkpoints(str(out / "ckpt"))
        result = launch(tmp_path, tiny(data, out, **config), fault)
        assert result.returncode != 0, f"{fault}: the run was not killed"
        assert_only_complete_checkpoints(out)
        if before:  # it resumed from the newest complete checkpoint there was
            assert f"resuming from {before[-1]}" in result.stdout, fault
    result = launch(tmp_path, tiny(data, out, **config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(out, "train_loss") == metrics(tmp_path / "reference", "train_loss")
    assert metrics(out, "val_loss") == metrics(tmp_path / "reference", "val_loss")


def test_non_finite_weights_are_never_checkpointed_or_exported(data, tmp_path):
    # AdamW's decoupled weight decay p *= 1 - lr * weight_decay overflows float32 in the first update, after a
    # finite loss and grad norm: only the weights show it
    blow_up = dict(lr=1e30, weight_decay=1e10)
    out = tmp_path / "one"
    with pytest.raises(FloatingPointError, match=r"checkpoint at step 1: parameters hold NaN or inf "
                                                 r"\(transformer\..*\); nothing was written.*none"):
        train_gpt2.main(tiny(data, out, max_steps=1, **blow_up))
    assert os.listdir(out / "ckpt") == [] and not os.path.exists(out / "hf")
    # sharded: each rank checks its own shard and all ranks stop; the last good checkpoint stays the newest
    out = tmp_path / "two"
    assert launch(tmp_path, tiny(data, out, max_steps=2, ckpt_every_steps=1)).returncode == 0
    result = launch(tmp_path, tiny(data, out, max_steps=3, ckpt_every_steps=1, **blow_up))
    assert result.returncode == 1 and not re.search(r"\[rank\d\]: Traceback", result.stderr)  # torchrun has its own
    assert re.search(r"checkpoint at step 3: parameters hold NaN or inf .*step_00000002", result.stderr)
    assert sorted(os.listdir(out / "ckpt")) == ["step_00000001", "step_00000002"]


def run_main_as_script(monkeypatch, args):
    """train_gpt2.py's __main__ block in this process: (exit status or message, nothing printed as a traceback)."""
    monkeypatch.setattr(sys, "argv", ["train_gpt2.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(ROOT, "train_gpt2.py"), run_name="__main__")
    return exit_info.value.code


def test_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_checkpoint(data, tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs
    real_write, calls = fs._write_item, []

    def write_item(transforms, stream, *rest, **kwargs):
        calls.append(stream.name)
        if "step_00000004" in stream.name:
            raise OSError(errno.ENOSPC, "No space left on device", stream.name)
        return real_write(transforms, stream, *rest, **kwargs)
    monkeypatch.setattr(fs, "_write_item", write_item)
    out = tmp_path / "full"
    message = run_main_as_script(monkeypatch, tiny(data, out, max_steps=6, ckpt_every_steps=2))
    assert re.fullmatch(r"train_gpt2\.py: error: .*step_00000004\.tmp/__0_0\.distcp: writing checkpoint "
                        r".*step_00000004 failed on rank 0: No space left on device; free some space or choose "
                        r"another out_dir", message)
    assert os.listdir(out / "ckpt") == ["step_00000002"]


def test_os_errors_are_one_line_naming_the_path(data, tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    message = run_main_as_script(monkeypatch, tiny(data, a_file / "out", max_steps=1))
    assert message == f"train_gpt2.py: error: {a_file / 'out'}: Not a directory; a part of the path is a file, " \
                      f"not a directory; choose another path"
    message = run_main_as_script(monkeypatch, tiny(data, tmp_path / "out", index_mapping_dir=str(a_file / "cache"),
                                                   max_steps=1))
    assert message.startswith(f"train_gpt2.py: error: {a_file / 'cache'}") and "Not a directory" in message
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the directory refuse new entries as the kernel would
        real_makedirs = os.makedirs

        def makedirs(path, *args, **kwargs):
            if str(path).startswith(str(read_only)):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_makedirs(path, *args, **kwargs)

        monkeypatch.setattr(os, "makedirs", makedirs)
    message = run_main_as_script(monkeypatch, tiny(data, read_only, max_steps=1))
    assert "Permission denied; choose a directory you can write to" in message
    monkeypatch.undo()

    with open(tmp_path / "main.log", "w") as f:
        f.write("s:0 tel:6.0\ns:0 trl:6.1 lr:0.001 norm:1.0\ns:1 trl:5.0 lr:0.001 norm:1.0\n")
    with pytest.raises(SystemExit) as exit_info:
        plot_log.main([str(tmp_path / "main.log"), "-o", str(a_file / "curves.png")])
    assert str(exit_info.value.code).startswith(f"plot_log.py: error: -o {a_file / 'curves.png'}: ")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        sample.main(["--model", str(tmp_path / "nowhere"), "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: torch sees no CUDA GPU here; use --device cpu" in capsys.readouterr().err


def test_second_run_on_a_locked_out_dir_fails_naming_the_holder(data, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"import train_gpt2, time; train_gpt2.lock_out_dir({str(out)!r}); "
                               f"print('locked', flush=True); time.sleep(120)"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ValueError, match=rf"another run is training in this out_dir .*held by pid {holder.pid} "
                                             rf"on host"):
            train_gpt2.main(tiny(data, out, max_steps=1))
    finally:
        holder.send_signal(signal.SIGKILL)  # the OS drops the lock of a killed holder: no stale lock
        holder.wait()
    assert train_gpt2.main(tiny(data, out, max_steps=1)) == 0


def test_sigterm_exits_143_after_its_checkpoint_and_a_finished_run_exits_0(data, tmp_path):
    out = tmp_path / "preempted"
    args = tiny(data, out, ckpt_every_steps=0, max_steps=30)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(out / "main.log", r"^s:5 trl", proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by a signal" in stdout and "Traceback" not in stderr
    assert "Warning" not in stderr  # e.g. no FutureWarning from a decorated class
    assert len(complete_checkpoints(str(out / "ckpt"))) == 1
    assert train_gpt2.main(args) == 0
