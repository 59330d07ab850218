"""The run's processes: the process group and helpers that work with or without one, the stop that
a SIGTERM or SIGINT asks for, and the one line that says why a run ended (a lost peer, a full disk)."""
import contextlib
import errno
import gc
import os
import re
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_distributed(device_choice="auto", timeout_s=900):
    """(rank, world_size, device); under torchrun also the process group: NCCL on GPUs, gloo on CPU."""
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("config: device is 'cuda' but torch sees no CUDA GPU")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    torch.backends.cuda.matmul.allow_tf32 = use_cuda  # TF32 matmuls on GPUs, as cuDNN already does
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    if not use_cuda:
        dist.init_process_group("gloo", timeout=timeout)
        return rank, world_size, torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return rank, world_size, device


@contextlib.contextmanager
def deterministic_kernels(on=True):
    """Within it, torch picks deterministic kernels where it has them and raises where an op has
    none, so that a rerun on the same GPU computes the same bits (a resume retraces the run);
    afterwards the process's settings are as before, also in a Python session that ran a run.
    Entered before CUDA starts: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it makes its first
    handle, and without a fixed workspace it may pick another algorithm when streams share one."""
    if not on:
        yield
        return
    from torch._inductor import config as inductor  # the compiler's, imported only when asked for
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    inductor_before = getattr(inductor, "deterministic", None)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Also flash attention's backward (FA2's deterministic one, a little slower) and
    # memory-efficient attention's (one key split).
    torch.use_deterministic_algorithms(True)
    if inductor_before is not None:  # recent torch sets it in use_deterministic_algorithms too
        # Inductor picks kernel configs by rules, not by timing them on the GPU: another process
        # could time another winner, one that sums in another order.
        inductor.deterministic = True
    try:
        yield
    finally:
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        if inductor_before is not None:
            inductor.deterministic = inductor_before


def end_distributed():
    """Destroy the process group, if any. What still refers to it (compiled graphs, FSDP state) is
    freed first: gloo otherwise aborts now and then at exit."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


# Each helper below also works without a process group (one process), so callers never branch.
def rank_and_world_size():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_master():
    return rank_and_world_size()[0] == 0


def barrier(group=None):
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast_object(obj):
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def attempt(work):
    """(work(), None), or (None, the ValueError or OSError it raised): a bad config or file that
    the caller raises on every rank, so that no rank waits for one that failed."""
    try:
        return work(), None
    except (ValueError, OSError) as e:
        return None, e


def first_error(error):
    """Raise on every rank the first rank's `error` (None where that rank had none)."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    for error in errors:
        if error is not None:
            raise error


def on_rank0(work):
    """work() done by rank 0 alone; its result on every rank, or its error raised on every rank."""
    result, error = broadcast_object(attempt(work) if is_master() else (None, None))
    if error is not None:
        raise error
    return result


def on_each_node(work):
    """work() done first by each node's local rank 0, then by the node's other ranks, which find
    its result there (a hub download into the node's own cache: nodes need not share a home)."""
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    result = None
    for my_turn in (first, not first):
        error = None
        if my_turn:
            result, error = attempt(work)
        first_error(error)
    return result


def any_rank(flag):
    """Whether `flag` is true on any rank (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return bool(flag)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL: this rank's current GPU
    total = torch.tensor(float(bool(flag)), device=device)
    dist.all_reduce(total)
    return total.item() > 0


def say(text):
    print(text, file=sys.stderr, flush=True)


class StopRequest:
    """Why the run should stop at the next step: a SIGTERM or SIGINT (it then checkpoints and exits
    128 + signum), or a data error of the reading thread (it checkpoints, then reports the error).

    While the run stops, more SIGTERMs are absorbed: a scheduler signals every process and then
    torchrun forwards its own, and none may kill the worker before its checkpoint. A person's
    second Ctrl-C is told that the checkpoint is being written; a third aborts without it."""

    def __init__(self):
        self.signal = self.time = self.error = None
        self.interrupts = 0  # Ctrl-Cs after the first signal
        self.told = False  # whether a repeated SIGTERM was said to be ignored
        self.ended = False  # set when the run ends, however: the reading thread then ends too
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def requested(self):
        return self.signal is not None or self.error is not None

    def handle(self, signum, frame):
        if self.signal is None:
            self.signal, self.time = signum, time.perf_counter()
        elif signum == signal.SIGTERM:
            if not self.told and is_master():
                say("SIGTERM again while stopping: ignored, the checkpoint is being written")
            self.told = True
        else:
            self.interrupts += 1
            if self.interrupts == 1 and is_master():
                say("stopping: the checkpoint is being written; Ctrl-C again (or kill -9) aborts "
                    "without it, and a rerun then resumes from the checkpoint before")
            elif self.interrupts > 1:  # the person insists: die by SIGINT, without a traceback
                say("aborted without a checkpoint; rerun the same command to resume from the "
                    "last one")
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)

    def stopped(self, step, log):
        """Say that the run stopped at `step` after its checkpoint; the exit status, 128 + signum
        (143 for SIGTERM, also on a rank that only heard of the stop from another)."""
        since = f", {time.perf_counter() - self.time:.1f} s after the signal" if self.time else ""
        log(f"stopped by a signal at step {step}{since}; rerun the same command to resume")
        return 128 + (self.signal or signal.SIGTERM)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
        "Timed out waiting", "NCCL communicator was aborted")


def lost_peer(error):
    """The first line of what says that another rank died or stopped answering (a gloo or NCCL
    error in a collective, also one DCP wraps), or None."""
    causes, seen = [error], set()
    while causes:
        e = causes.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dist.DistError) or \
                (isinstance(e, RuntimeError) and any(words in str(e) for words in GONE)):
            line = first_line(e)
            return re.sub(r"^\[[^\]]*\] *", "", line).split(". ")[0]  # gloo's source location off
        failures = getattr(e, "failures", None) or {}  # DCP's: {rank: (exception, traceback)}
        causes += [e.__cause__, e.__context__] + [failure for failure, _ in failures.values()]
    return None


SPACE = "the disk is full: free some space or choose another out_dir"
WRITE = "choose a directory you can write to"
NOT_A_DIRECTORY = "a part of the path is a file, not a directory; choose another path"
OS_ERROR_HINTS = {errno.ENOSPC: SPACE, errno.EDQUOT: SPACE, errno.EACCES: WRITE,
                  errno.EPERM: WRITE, errno.ENOTDIR: NOT_A_DIRECTORY,
                  errno.EEXIST: NOT_A_DIRECTORY, errno.ENOENT: "check the path",
                  errno.EROFS: "the filesystem is read-only; choose another directory"}


def first_line(error):
    """The first line of an error's text, or its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def error_line(error):
    """The one line that a run's error ends it with, or None for an error to show in full."""
    cause = lost_peer(error) if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None
    if cause is not None:
        return ("lost another rank of the run (it was killed, ended with an error of its own, or "
                f"its node failed or stopped answering: {cause}); rerun the same command to "
                "resume from the last checkpoint")
    if isinstance(error, (ValueError, FloatingPointError)):
        return str(error)
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return ("out of GPU memory; lower local_batch_size (the gradient accumulation grows to "
                "keep global_batch_size), set activation_checkpointing=True, or use more GPUs")
    if isinstance(error, OSError):  # a file or directory the run cannot use
        text = error.strerror or str(error)
        if error.filename is not None:
            text = f"{error.filename}: {text}"
        if error.errno in OS_ERROR_HINTS:
            text += f"; {OS_ERROR_HINTS[error.errno]}"
        return text
    return None


def exit_with(work, script):
    """sys.exit(work()). An error that error_line() names ends the process with that one line,
    `SCRIPT: error: ...`, prefixed with the rank under torchrun; any other is raised in full."""
    try:
        sys.exit(work())
    except Exception as e:
        text = error_line(e)
        if text is None:
            raise
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            # One write of the whole line: the ranks' lines never run together.
            sys.stderr.write(f"[rank {os.environ.get('RANK', 0)}] {script}: error: {text}\n")
            sys.stderr.flush()
            sys.exit(1)
        sys.exit(f"{script}: error: {text}")


def clock(device):
    """A host time, or on a GPU an event recorded in the stream (read once it is done)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def peak_memory(device, reset=False):
    """(GiB, label) of the peak since the last reset: CUDA's high-water mark, or the process's
    VmHWM (writing 5 to clear_refs resets it)."""
    if device.type == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.max_memory_allocated(device) / 2**30, "mem"
    with contextlib.suppress(OSError):
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20, "rss"
    # No /proc here (some sandboxes): the peak since the process began.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss"


# The oldest torch the whole test suite passes on (bench/compat.sh; docs/development.md says why).
MIN_TORCH = "2.9.1"


def torch_version_problem(version=torch.__version__):
    """None, or the one line saying that this `version` of torch is older than MIN_TORCH."""
    if torch.torch_version.TorchVersion(version) < MIN_TORCH:
        return (f"torch {version} is older than {MIN_TORCH}, the oldest this code is tested on; "
                f"pip install 'torch>={MIN_TORCH}' (or a CUDA build of it for GPUs)")
    return None


# Dense bf16 tensor-core TFLOP/s of one GPU, for MFU. The first name found in the device's name
# wins, so a more specific name comes before the name it contains ("H200 NVL" before "H200").
PEAK_BF16_TFLOPS = [("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200 NVL", 835),
                    ("H200", 989), ("A100", 312), ("B200", 2250)]


def peak_flops(device):
    """Dense bf16 FLOP/s of one `device` from PEAK_BF16_TFLOPS, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None
