"""
The out_dir of a training run: which directories may hold one, the lock that keeps a second run out, and the logs of
an earlier run moved aside before a fresh one starts. Nothing here deletes a file the run did not make.
"""
import errno
import fcntl
import os
import socket

ROOT = os.path.dirname(os.path.abspath(__file__))
# what train_gpt2.py writes into an out_dir; a non-empty directory holding none of these belongs to someone else
RUN_FILES = ("train_config.json", "ckpt", "main.log", "metrics.jsonl", ".lock")
RUN_LOGS = ("main.log", "metrics.jsonl")
HF_MARKER = ".train_gpt2.json"  # in every hf/ export: only such an hf/ may be replaced by the next export


def check_out_dir(out_dir):
    """Raise ValueError when `out_dir` must not receive a run: empty, the working or project directory or one of
    their parents, a file, or an existing directory with files in it that no run wrote."""
    if not out_dir or not out_dir.strip():
        raise ValueError("config: out_dir is empty; name a directory for the run, e.g. --out_dir=out")
    path = os.path.realpath(out_dir)
    for name, protected in (("the current directory", os.getcwd()), ("the project directory", ROOT)):
        protected = os.path.realpath(protected)
        if protected == path or protected.startswith(path.rstrip(os.sep) + os.sep):
            raise ValueError(f"{out_dir}: out_dir is {name} or one of its parents; name a directory of its own, "
                             f"e.g. --out_dir=out")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{out_dir}: out_dir is a file; name a directory")
    if os.path.isdir(path):
        entries = os.listdir(path)
        if entries and not any(name in entries for name in RUN_FILES):
            raise ValueError(f"{out_dir}: out_dir holds {len(entries)} entries (e.g. {sorted(entries)[0]!r}) but "
                             f"no train_config.json, ckpt/ or main.log: it is not a training run's directory; name "
                             f"an empty or new directory")


class RunLock:
    """An exclusive flock on out_dir/.lock, held for the life of the run (the OS drops it when the process dies, so
    kill -9 never leaves a stale lock). The holder writes its pid and host into the file for the error the next
    run prints. flock works across nodes on NFS (Linux emulates it with POSIX locks) and on Lustre mounted with
    -o flock."""
    held = []  # the descriptors of this process's locks, until release_all

    @classmethod
    def acquire(cls, out_dir):
        path = os.path.join(out_dir, ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise ValueError(f"{out_dir}: another run is training in this out_dir ({path} is held by {holder}); "
                                 f"wait for it to end, stop it, or choose another out_dir") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        cls.held.append(fd)

    @classmethod
    def release_all(cls):
        while cls.held:
            os.close(cls.held.pop())  # closing the only descriptor drops the flock


def move_old_logs(out_dir):
    """Rename main.log / metrics.jsonl of an earlier run to NAME.K (the next free K) so a fresh run never mixes its
    curves with them; return the messages saying so."""
    moved = []
    for name in RUN_LOGS:
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            k = 1
            while os.path.exists(f"{path}.{k}"):
                k += 1
            os.rename(path, f"{path}.{k}")
            moved.append(f"{path} of an earlier run moved to {path}.{k}")
    return moved


def os_error_message(e):
    """One line for an OSError: what failed on which path, and the way out."""
    hints = {errno.ENOSPC: "free some space or choose another out_dir",
             errno.EDQUOT: "free some space or choose another out_dir",
             errno.EACCES: "choose a directory you can write to", errno.EPERM: "choose a directory you can write to",
             errno.EROFS: "the filesystem is read-only; choose another directory",
             errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
             errno.EEXIST: "a part of the path is a file, not a directory; choose another path",
             errno.ENOENT: "check the path"}
    where = e.filename if e.filename is not None else ""
    text = f"{where}: {e.strerror or e}" if where else str(e)
    hint = hints.get(e.errno)
    return f"{text}; {hint}" if hint else text
