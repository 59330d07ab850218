"""Publish a file absent or complete: write a temporary beside it, fsync it, rename it over the final name, fsync the
directory. A crash leaves the old file (or none) and at most a hidden temporary, never a truncated file."""
import contextlib
import os

from safetensors import SafetensorError


class WriteError(OSError):
    """A file could not be written (full disk, read-only directory, a file in the path): one line naming it and why."""

    def __str__(self):
        return f"cannot write {self.filename}: {self.strerror}"


def _write_error(path, error):
    reason = getattr(error, "strerror", None) or (str(error).strip().splitlines() or [type(error).__name__])[-1]
    return WriteError(getattr(error, "errno", None), reason, str(path))


def fsync_dir(path):
    """Make a rename or a new entry in directory `path` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _publishing(path):
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
    except OSError as e:
        raise _write_error(path, e) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


@contextlib.contextmanager
def atomic_write(path, mode="wb", **open_kwargs):
    """`with atomic_write(path) as f: f.write(...)`: `path` appears, complete, only when the block succeeds."""
    with _publishing(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def atomic_save(path, save):
    """Publish what `save(tmp_path)` writes (safetensors, matplotlib) as `path`, like atomic_write."""
    with _publishing(path) as tmp:
        try:
            save(tmp)
        except (RuntimeError, SafetensorError) as e:  # a full disk: torch's zip writer ("unexpected pos"), safetensors
            raise _write_error(path, e) from e
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # some writers (safetensors) create 0600 files; publish as open() would
