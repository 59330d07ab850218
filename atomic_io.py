"""
Write a file so that it is either absent, or complete under its final name: write a temporary file in the same
directory, flush and fsync it, rename it over the final name, then fsync the directory so the rename survives a power
loss. A crash at any point leaves the old file (or none) and at most a hidden temporary, never a truncated file that
looks finished. Every module that publishes a file uses this.
"""
import contextlib
import os


def fsync_dir(path):
    """Make a rename or a new entry in directory `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_path(path):
    """A hidden name beside `path`, unique per process, so ranks or workers writing at once never share it."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def atomic_write(path, mode="wb", **open_kwargs):
    """`with atomic_write(path) as f: f.write(...)`: `path` appears, complete, only when the block succeeds."""
    with _publishing(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def atomic_save(path, save):
    """`save(tmp_path)` writes a file the caller cannot hand a file object to (safetensors, matplotlib with a name);
    the result is published as `path` like atomic_write's."""
    with _publishing(path) as tmp:
        save(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # some writers (safetensors) create 0600 files; publish as open() would


@contextlib.contextmanager
def _publishing(path):
    """A temporary name to write; once the block is done (and the file closed): fsync, rename over `path`, fsync the
    directory. On an error the temporary is removed and `path` is left as it was."""
    tmp = temporary_path(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
