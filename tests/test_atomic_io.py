import os

import pytest

from atomic_io import atomic_save, atomic_write


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
