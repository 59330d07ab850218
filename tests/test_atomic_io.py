import os
import socket

import pytest

from atomic_io import (LockHeld, atomic_path, atomic_save, atomic_write, error_reason, lock_file, lock_holder,
                       remove_stale_temporaries)


def test_atomic_write_publishes_complete_file(tmp_path):
    path = tmp_path / "a.txt"
    with atomic_write(path, "w") as f:
        f.write("hello")
    assert path.read_text() == "hello"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_atomic_write_failure_keeps_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path, "w") as f:
            f.write("half")
            raise RuntimeError("crash")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_atomic_save_by_name(tmp_path):
    path = tmp_path / "b.bin"
    atomic_save(path, lambda tmp: open(tmp, "wb").write(b"xyz"))
    assert path.read_bytes() == b"xyz"
    with pytest.raises(OSError):
        atomic_save(path, lambda tmp: (_ for _ in ()).throw(OSError("disk full")))
    assert path.read_bytes() == b"xyz" and os.listdir(tmp_path) == ["b.bin"]


def test_atomic_save_publishes_with_the_default_permissions(tmp_path):
    path = tmp_path / "c.bin"

    def private_writer(tmp):
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(b"x")

    atomic_save(path, private_writer)
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


WRITE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
import torch
from safetensors.torch import save_file
from atomic_io import WriteError, atomic_save, atomic_write
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
big = torch.zeros(100_000)
def write_bytes(path):
    with atomic_write(path) as f:
        f.write(bytes(100_000))
writers = {
    "open": write_bytes,
    "torch.save": lambda p: atomic_save(p, lambda tmp: torch.save(big, tmp)),
    "safetensors": lambda p: atomic_save(p, lambda tmp: save_file({"w": big}, tmp)),
}
for name, write in writers.items():
    path = sys.argv[1] + "/" + name.replace(".", "_")
    try:
        write(path)
    except WriteError as e:
        print(name, "|", e)
"""

@pytest.mark.slow
def test_a_failed_write_is_one_line_naming_the_file_and_leaves_nothing(tmp_path):
    """A full disk surfaces from open() as ENOSPC, from torch.save as "unexpected pos", from safetensors as its own
    error; each becomes one WriteError line naming the file, and no temporary is left behind."""
    import subprocess
    import sys

    from conftest import ROOT
    out = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_SIZE_LIMIT, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    print("\n".join(lines))
    assert len(lines) == 3
    for line in lines:
        name, message = line.split(" | ")
        assert message.startswith(f"cannot write {tmp_path}/{name.replace('.', '_')}: "), line
    assert os.listdir(tmp_path) == []


def test_a_lock_file_keeps_a_second_taker_out_naming_the_holder_until_it_is_closed(tmp_path):
    path = str(tmp_path / ".lock")
    fd = lock_file(path)
    with pytest.raises(LockHeld) as held:  # flock: a second open file, even in this process, is another taker
        lock_file(path)
    assert held.value.holder == f"pid {os.getpid()} on host {socket.gethostname()}"
    assert str(held.value) == f"{path} is held by {held.value.holder}"
    os.close(fd)
    os.close(lock_file(path))


def test_lock_holder_says_who_holds_a_lock_file_and_none_once_it_is_free(tmp_path):
    path = str(tmp_path / ".lock")
    assert lock_holder(path) is None  # no such file: no run ever held it
    fd = lock_file(path)
    assert lock_holder(path) == f"pid {os.getpid()} on host {socket.gethostname()}"
    os.close(fd)  # the holder is gone (as when a run ends or is killed); what it wrote stays
    assert lock_holder(path) is None and os.path.getsize(path) > 0
    os.close(lock_file(path))  # looking took no lock


def test_a_lock_file_its_holder_removed_counts_as_held(tmp_path):
    """A run that removes its lock file on the way out (prepare_fineweb.py) is still ending: the lock of the removed
    file must not let a second run in beside it."""
    path = str(tmp_path / ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.remove(path)
    with pytest.raises(LockHeld):  # /proc/self/fd/N opens the removed file again, as a run that opened it before did
        lock_file(f"/proc/self/fd/{fd}")
    os.close(fd)


def test_the_reason_of_a_failed_write_is_one_line():
    assert error_reason(OSError(28, "No space left on device")) == "No space left on device"
    assert error_reason(RuntimeError("Error while serializing:\nIoError(Os { code: 28 })\n")) == \
        "IoError(Os { code: 28 })"
    assert error_reason(RuntimeError()) == "RuntimeError"


def test_temporaries_are_unique_across_hosts_and_pid_namespaces(tmp_path, monkeypatch):
    """Two writers that share a pid (pid 1 in two containers, or on two hosts) never share a temporary: its name is
    random. tests/test_indexed_dataset.py runs two such writers for real (unshare --pid)."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    names = []
    for _ in range(2):
        with atomic_path(tmp_path / "a.npy") as tmp:
            names.append(os.path.basename(tmp))
            open(tmp, "wb").close()
    assert names[0] != names[1] and not [name for name in names if ".1.tmp" in name]


def test_only_temporaries_of_dead_writers_are_removed(tmp_path):
    dead = tmp_path / ".a.npy.1234567.tmp"  # a writer killed mid-write leaves it unlocked
    dead.write_bytes(b"x" * 100)
    empty = tmp_path / ".b.npy.1234567.tmp"  # may be a live writer's between its open and its flock
    empty.touch()
    (tmp_path / "other.tmp").write_bytes(b"x")  # not hidden: not a temporary of ours
    with atomic_write(tmp_path / "c.npy") as f:
        f.write(b"y" * 100)
        f.flush()
        [live] = [p for p in tmp_path.iterdir() if p.name.startswith(".c.npy.")]
        remove_stale_temporaries(str(tmp_path))
        assert live.exists() and not dead.exists() and empty.exists() and (tmp_path / "other.tmp").exists()
    assert (tmp_path / "c.npy").read_bytes() == b"y" * 100
    remove_stale_temporaries(str(tmp_path), keep_empty=False)  # a caller whose lock keeps writers out
    assert not empty.exists() and (tmp_path / "other.tmp").exists()
    remove_stale_temporaries(str(tmp_path / "missing"))  # no directory yet: nothing to do
