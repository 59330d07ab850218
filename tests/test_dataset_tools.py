"""dataset_tools.py: token ranges (computed once, kept beside the data) and the info / verify / verify-cache command
line."""
import glob
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
import indexed_dataset as dataset_tools
from indexed_dataset import check_token_range, token_range
from indexed_dataset import IndexedDataset
from conftest import corrupt, deny_writes, random_documents, write_ours


def cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "indexed_dataset.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_info_and_verify(tmp_path):
    rng = np.random.default_rng(9)
    documents = random_documents(rng, 50, vocab=500)
    prefixes = [write_ours(str(tmp_path / f"d{i}_text_document"), documents) for i in range(2)]
    tokens = sum(len(t) for t, _ in documents)
    sequences = sum(len(lengths) for _, lengths in documents)
    result = cli("info", str(tmp_path / "d*_text_document*"))
    assert result.returncode == 0, result.stderr
    assert f"{prefixes[0]}: 50 documents, {sequences} sequences, {tokens:,} tokens (uint16)" in result.stdout
    assert f"total of 2 prefixes: 100 documents, {2 * sequences} sequences, {2 * tokens:,} tokens" in result.stdout
    expanded = cli("info", *sorted(glob.glob(str(tmp_path / "d*_text_document*"))))  # an unquoted glob
    assert expanded.returncode == 0 and expanded.stdout == result.stdout

    result = cli("verify", str(tmp_path / "d*_text_document*"), "--vocab-size", "500")
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr
    result = cli("verify", prefixes[0], "--vocab-size", "100")
    assert result.returncode == 1 and "outside the vocabulary [0, 100)" in result.stderr

    corrupt(prefixes[1], ".bin", append=b"\0\0")
    result = cli("verify", prefixes[1])
    assert result.returncode == 1
    assert f"{prefixes[1]}.bin: {2 * tokens + 2} bytes, longer than the {2 * tokens} bytes its index" in result.stderr

    result = cli("info", str(tmp_path / "missing"))
    assert result.returncode == 1 and "missing.idx: no such file" in result.stderr


def test_token_range_is_computed_once_and_kept_beside_the_data(tmp_path, monkeypatch):
    prefix = write_ours(str(tmp_path / "d_text_document"), [([5, 9, 300], [3]), ([7], [1])])
    assert token_range(prefix) == (5, 300) and token_range(IndexedDataset(prefix))[1] == 300
    stats = json.load(open(prefix + ".stats.json"))
    assert (stats["min"], stats["max"]) == (5, 300)
    scans = []
    monkeypatch.setattr(dataset_tools, "_scan_range", lambda ds: scans.append(ds) or (0, 0))
    assert token_range(prefix) == (5, 300) and not scans  # from the stats file
    write_ours(prefix, [([5, 9, 301], [3]), ([7], [1])])  # new data under the same name: the key no longer fits
    assert token_range(prefix) == (0, 0) and len(scans) == 1


def test_token_range_of_a_read_only_directory(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    prefix = write_ours(str(data / "d_text_document"), [([5, 9, 300], [3])])
    deny_writes(monkeypatch, data)
    assert token_range(prefix)[1] == 300 and not os.path.exists(prefix + ".stats.json")


def test_check_token_range_names_the_file(tmp_path):
    good = write_ours(str(tmp_path / "good_text_document"), [([1, 2, 50256], [3])])
    big = write_ours(str(tmp_path / "big_text_document"), [([1, 60000, 3], [3])])
    check_token_range(good, 50257)
    check_token_range([good], 50257)
    with pytest.raises(ValueError, match=rf"token id 60000 in {big}\.bin is outside the model's vocabulary "
                                         r"\(vocab_size 50257\)"):
        check_token_range(str(tmp_path / "*_text_document"), 50257)
    negative = write_ours(str(tmp_path / "neg_text_document"), [([1, -3, 3], [3])], dtype=np.int32)
    with pytest.raises(ValueError, match=rf"token id -3 in {negative}\.bin is negative"):
        check_token_range([negative], 50257)
    assert token_range(write_ours(str(tmp_path / "empty"), [])) == (None, None)


def test_verify_reads_the_tokens_not_the_stats(tmp_path):
    prefix = write_ours(str(tmp_path / "d_text_document"), [([1, 2, 3], [3])])
    assert token_range(prefix)[1] == 3
    with open(prefix + ".bin", "r+b") as f:  # same size; the mtime may not move within the clock's resolution
        f.seek(2)
        f.write(struct.pack("<H", 999))
    assert dataset_tools.verify([prefix], vocab_size=100) == [
        f"{prefix}.bin: token ids span [1, 999], outside the vocabulary [0, 100)"]
