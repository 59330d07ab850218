"""processes.py: the one line that ends a run (a lost peer, a full disk, a path that is a file, out of GPU memory, a
torch older than MIN_TORCH), SIGTERM and SIGINT as a StopRequest (a person's second Ctrl-C is told the checkpoint is
being written, a third aborts without it), the helpers that work with or without a process group, and the GPUs' peak
FLOP/s for MFU."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import processes
import train_gpt2
from conftest import ROOT, checkpoints, tiny, wait_for_line
from processes import StopRequest, any_rank, error_line, first_error, first_line, lost_peer, on_each_node, on_rank0


# ----------------------------------------------------------------------------- the one line a run ends with

GLOO_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:6148. more"


class DCPError(Exception):
    """As torch.distributed.checkpoint's CheckpointException: each failed rank's exception and traceback."""

    def __init__(self, failures):
        super().__init__(f"ranks: {sorted(failures)}")
        self.failures = failures


def test_a_lost_peer_is_found_under_causes_and_dcp_failures_and_said_only_in_a_distributed_run(monkeypatch):
    wrapped = ValueError("the collective failed")
    wrapped.__cause__ = RuntimeError(GLOO_LOST)
    in_dcp = DCPError({1: (RuntimeError("Connection reset by peer"), "traceback")})
    assert lost_peer(wrapped) == "Connection closed by peer [10.0.0.2]:6148"  # gloo's source location off
    assert lost_peer(in_dcp) == "Connection reset by peer"
    assert lost_peer(RuntimeError("CUDA error: an illegal memory access")) is None
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process has no peer to lose: the error is what it says
    assert error_line(wrapped) == "the collective failed"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert error_line(wrapped) == (
        "lost another rank of the run (it was killed, ended with an error of its own, or its node failed or stopped "
        "answering: Connection closed by peer [10.0.0.2]:6148); rerun the same command to resume from the last "
        "checkpoint")


def test_error_line_names_the_path_and_what_to_do_and_leaves_other_errors_in_full(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    full = OSError(28, "No space left on device", "/data/out/ckpt/step_00000010.tmp/__0_0.distcp")
    assert error_line(full) == ("/data/out/ckpt/step_00000010.tmp/__0_0.distcp: No space left on device; the disk "
                                "is full: free some space or choose another out_dir")
    assert error_line(OSError(30, "Read-only file system")).endswith(
        "Read-only file system; the filesystem is read-only; choose another directory")
    assert error_line(FloatingPointError("step 5: train loss nan")) == "step 5: train loss nan"
    assert error_line(torch.cuda.OutOfMemoryError("CUDA out of memory")).startswith("out of GPU memory; lower ")
    assert error_line(KeyError("a bug")) is None  # shown in full, with its traceback
    assert first_line(ValueError("first\nsecond")) == "first" and first_line(KeyError()) == "KeyError"


def test_out_of_gpu_memory_is_one_line_saying_what_to_lower(data, tmp_path, monkeypatch):
    def out_of_memory(cfg, restore_signals=True):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_gpt2, "run", out_of_memory)
    with pytest.raises(SystemExit) as stopped:
        train_gpt2.cli(tiny(data, tmp_path / "out"))
    assert str(stopped.value).startswith("train_gpt2.py: error: out of GPU memory; lower "
                                         "local_batch_size")


@pytest.mark.slow
def test_an_older_torch_stops_at_start_in_one_line():
    """requirements.txt's floor is MIN_TORCH, the oldest torch bench/compat.sh passes the suite on."""
    assert processes.torch_version_problem() is None and processes.torch_version_problem("2.9.1+cu128") is None
    assert f"torch>={processes.MIN_TORCH}\n" in open(os.path.join(ROOT, "requirements.txt")).read()
    path = os.path.join(ROOT, "train_gpt2.py")
    told = (f"import runpy, sys, torch; torch.__version__ = torch.torch_version.TorchVersion('2.6.0+cu124'); "
            f"sys.argv = [{path!r}, '--help']; runpy.run_path({path!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", told], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert result.stderr == f"train_gpt2.py: error: torch 2.6.0+cu124 is older than {processes.MIN_TORCH}, the " \
        f"oldest this code is tested on; pip install 'torch>={processes.MIN_TORCH}' (or a CUDA build of it for GPUs)\n"


# ----------------------------------------------------------------------------- without a process group

def test_the_helpers_work_without_a_process_group():
    assert on_rank0(lambda: 5) == 5 and on_each_node(lambda: "cached") == "cached"
    with pytest.raises(ValueError, match="bad config"):
        on_rank0(lambda: int("bad config"))
    assert any_rank(1) is True and any_rank(0) is False
    first_error(None)
    with pytest.raises(OSError, match="gone"):
        first_error(OSError("gone"))
    assert processes.rank_and_world_size() == (0, 1) and processes.is_master()


def test_deterministic_kernels_hold_within_and_are_put_back_after(monkeypatch):
    """--deterministic=True: torch's deterministic kernels, cuBLAS's fixed workspace (set before CUDA starts, so the
    environment, which cuBLAS reads then) and Inductor's rules instead of timings, all as they were after the run."""
    from torch._inductor import config as inductor
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with processes.deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with processes.deterministic_kernels():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and inductor.deterministic
    assert not torch.are_deterministic_algorithms_enabled() and not inductor.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a deterministic setting of the user's own stays
    with processes.deterministic_kernels():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


# ----------------------------------------------------------------------------- SIGTERM and SIGINT

def test_a_signal_asks_for_a_stop_and_a_repeated_sigterm_is_absorbed_and_said_once(capsys):
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line runs
        assert stop.requested() and stop.signal == signal.SIGTERM and stop.time is not None
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's, then torchrun's
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # a person's Ctrl-C while the checkpoint is written
        assert stop.signal == signal.SIGTERM and stop.interrupts == 1
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    said = capsys.readouterr().err.splitlines()
    assert said == ["SIGTERM again while stopping: ignored, the checkpoint is being written",
                    "stopping: the checkpoint is being written; Ctrl-C again (or kill -9) aborts without it, and a "
                    "rerun then resumes from the checkpoint before"]


SLOW_CHECKPOINT = """
import time
import checkpoint
import train_gpt2
real_save_checkpoint = checkpoint.save_checkpoint
def save_checkpoint(*args):  # a checkpoint that takes a while to write, as a large model's does
    time.sleep(3)
    return real_save_checkpoint(*args)
checkpoint.save_checkpoint = save_checkpoint
train_gpt2.cli()
"""


@pytest.mark.slow
@pytest.mark.parametrize("interrupts", [2, 3])
def test_a_second_ctrl_c_says_the_checkpoint_is_being_written_and_a_third_aborts_without_a_traceback(
        data, tmp_path, interrupts):
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CHECKPOINT, *tiny(data, out, ckpt_every_steps=0)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(out / "main.log", r"^s:5 trl", proc)
        for _ in range(interrupts):  # a person's presses, apart (signals sent at once would merge into one)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "stopping: the checkpoint is being written; Ctrl-C again (or kill -9) aborts without it" in stderr
    if interrupts == 2:
        assert proc.returncode == 128 + signal.SIGINT and "stopped by a signal at step" in stdout
        assert len(checkpoints(out)) == 1
    else:
        assert proc.returncode == -signal.SIGINT and checkpoints(out) == []
        assert "aborted without a checkpoint; rerun the same command to resume from the last one" in stderr


# ----------------------------------------------------------------------------- the GPU's peak, for MFU

def test_mfu_peak_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names.pop(0))
    names = ["NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 NVL",
             "NVIDIA A100-SXM4-80GB", "NVIDIA B200", "NVIDIA GeForce RTX 4090"]
    peaks = [processes.peak_flops(torch.device("cuda", 0)) for _ in range(8)]
    assert peaks == [756e12, 989e12, 989e12, 835e12, 835e12, 312e12, 2250e12, None]
    assert processes.peak_flops(torch.device("cpu")) is None
    keys = [key for key, _ in processes.PEAK_BF16_TFLOPS]  # a name never shadows a more specific one after it
    assert not [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if a in b]
