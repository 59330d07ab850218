"""Publish a file absent or complete: write a temporary beside it, fsync it, rename it over the final
name, fsync the directory; a crash leaves the old file or none. Also a run's lock file."""
import contextlib
import fcntl
import os
import secrets

from safetensors import SafetensorError


class WriteError(OSError):
    """A file could not be written (full disk, read-only directory): one line naming it and why."""

    def __str__(self):
        return f"cannot write {self.filename}: {self.strerror}"


class LockHeld(Exception):
    """Another process holds the lock file; `holder` is what it wrote there ("pid 1 on host n7")."""

    def __init__(self, path, holder):
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


def lock_file(path):
    """Flock `path`, write our pid and host in it, return its descriptor; LockHeld if another has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = not os.fstat(fd).st_nlink  # its holder removed it between our open and flock
    except (BlockingIOError, PermissionError):  # held by another process
        held = True
    if held:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        raise LockHeld(path, holder)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {os.uname().nodename}\n".encode(), 0)
    return fd


def lock_holder(path):
    """What the process that holds lock file `path` wrote in it, or None where none holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no such file: no run ever held it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except (BlockingIOError, PermissionError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
    finally:
        os.close(fd)


def remove_stale_temporaries(directory, keep_empty=True):
    """Remove the temporaries (.*.tmp) in `directory` whose writers died (kill -9): those whose
    flock can be taken. An empty one may be a live writer's before its flock, so it stays, unless
    the caller's own lock keeps every other writer out of `directory` (keep_empty=False)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    for path in [os.path.join(directory, n) for n in names if n[0] == "." and n.endswith(".tmp")]:
        with contextlib.suppress(OSError):  # held by a live writer, or removed by another cleaner
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_size or not keep_empty:
                    os.remove(path)
            finally:
                os.close(fd)


def error_reason(error):
    """The OS's reason (strerror), else the last line of the error's text, else its type."""
    lines = str(error).strip().splitlines()
    return getattr(error, "strerror", None) or (lines[-1] if lines else type(error).__name__)


def fsync_dir(path):
    """Make a rename or a new entry in directory `path` durable (where directories can be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path, errors=OSError, durable=True):
    """Yield a temporary name, random rather than the pid (containers share pids), flocked while written so
    that remove_stale_temporaries leaves it; on success fsync it unless not `durable`, rename it to `path`."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{secrets.randbits(63)}.tmp")
    fd = None
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a cleaner may hold it a moment, but leaves it: it is empty
        yield tmp
        if durable:
            os.fsync(fd)  # the file the block wrote by name
        os.replace(tmp, path)
    except WriteError:  # a nested publish (prepare_fineweb's .idx inside its .bin) names its file
        raise
    except errors as e:
        raise WriteError(getattr(e, "errno", None), error_reason(e), str(path)) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        if fd is not None:
            os.close(fd)
    if durable:
        fsync_dir(directory)


@contextlib.contextmanager
def atomic_write(path, mode="wb", durable=True, **open_kwargs):
    """`with atomic_write(path) as f: f.write(...)`: `path` appears, whole, when the block succeeds."""
    with atomic_path(path, durable=durable) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def atomic_save(path, save):
    """Publish what `save(tmp_path)` writes (safetensors, matplotlib) as `path`, as atomic_write."""
    # A full disk fails in torch's zip writer as a RuntimeError, in safetensors as its own error.
    with atomic_path(path, (OSError, RuntimeError, SafetensorError)) as tmp:
        save(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # safetensors creates 0600 files; publish as open() would
