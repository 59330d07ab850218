"""Publish a file absent or complete: write a temporary beside it, fsync it, rename it over the final name, fsync the
directory. A crash leaves the old file (or none) and at most a hidden temporary, never a truncated file.
Also the lock file that keeps a second run out of a directory, and the one-line reason of a failed write."""
import contextlib
import errno
import fcntl
import os

from safetensors import SafetensorError


class WriteError(OSError):
    """A file could not be written (full disk, read-only directory, a file in the path): one line naming it and why."""

    def __str__(self):
        return f"cannot write {self.filename}: {self.strerror}"


class LockHeld(Exception):
    """Another process holds the lock file; `holder` is what it wrote there ("pid 123 on host node7")."""

    def __init__(self, path, holder):
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


def lock_file(path):
    """Take an exclusive flock on `path` (made if absent) without waiting and write our pid and host into it; return
    its descriptor. Closing it, or the death of the process, drops the lock (on NFS and Lustre across nodes too).
    Raises LockHeld, naming the holder, if another process has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = not os.fstat(fd).st_nlink  # its holder removed it between our open and flock: that run is ending
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            os.close(fd)
            raise
        held = True
    if held:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        raise LockHeld(path, holder)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {os.uname().nodename}\n".encode(), 0)  # for the next run's error
    return fd


def error_reason(error):
    """What a one-line message should say of a failed write: the OS's reason (strerror) if there is one, else the last
    line of the error's text (safetensors' messages run to several lines), else the error's type."""
    lines = str(error).strip().splitlines()
    return getattr(error, "strerror", None) or (lines[-1] if lines else type(error).__name__)


def fsync_dir(path):
    """Make a rename or a new entry in directory `path` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path, errors=OSError):
    """Yield a temporary name; when the block succeeds fsync it, rename it over `path` and fsync the directory."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # per process: ranks or workers never share it
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except WriteError:  # a nested publish (prepare_fineweb's .idx inside its .bin) names its own file
        raise
    except errors as e:
        raise WriteError(getattr(e, "errno", None), error_reason(e), str(path)) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


@contextlib.contextmanager
def atomic_write(path, mode="wb", **open_kwargs):
    """`with atomic_write(path) as f: f.write(...)`: `path` appears, complete, only when the block succeeds."""
    with atomic_path(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def atomic_save(path, save):
    """Publish what `save(tmp_path)` writes (safetensors, matplotlib) as `path`, like atomic_write."""
    # a full disk fails in torch's zip writer as a RuntimeError ("unexpected pos"), in safetensors as its own error
    with atomic_path(path, (OSError, RuntimeError, SafetensorError)) as tmp:
        save(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # some writers (safetensors) create 0600 files; publish as open() would
