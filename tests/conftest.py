"""Helpers and fixtures several test files use: tiny datasets, the tiny training config, torchrun, log readers."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

# Tests never touch the network: the hub client must answer from local files or fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from indexed_dataset import IndexedDatasetBuilder  # noqa: E402 (after the path is set)


BYTE_EOT = 511


def random_documents(rng, count, max_length=60, vocab=1000):
    """(tokens, lengths) pairs: mostly one sequence, some empty documents, zero-length and two-sequence ones."""
    documents = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.05:
            documents.append((np.zeros(0, np.int64), []))
        elif kind < 0.08:
            documents.append((np.zeros(0, np.int64), [0]))
        elif kind < 0.2:
            a, b = rng.integers(1, max_length, 2)
            documents.append((rng.integers(0, vocab, a + b), [int(a), int(b)]))
        else:
            n = int(rng.integers(1, max_length))
            documents.append((rng.integers(0, vocab, n), [n]))
    return documents


def write_ours(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for tokens, lengths in documents:
        builder.add_document(tokens, lengths)
    builder.finalize(prefix + ".idx")
    return prefix


def corrupt(prefix, suffix, offset=None, data=b"", size=None, append=b""):
    """Overwrite `data` at `offset`, cut the file to `size`, or `append` to it."""
    path = prefix + suffix
    content = bytearray(open(path, "rb").read())
    if offset is not None:
        content[offset:offset + len(data)] = data
    if size is not None:
        content = content[:size]
    open(path, "wb").write(bytes(content) + append)


def deny_writes(monkeypatch, directory):
    """Make os.access say `directory` and what is under it cannot be written. Tests run as root, for whom os.access
    ignores the mode bits (a chmod 0o555 alone would not show), so it answers here as it would for a user."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: (not str(path).startswith(str(directory))
                                                          and real_access(path, mode)))


def write_byte_dataset(prefix):
    """Each blank-line separated block of Shakespeare as UTF-8 bytes + an end-of-document token."""
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        blocks = [b for b in re.split(r"\n\s*\n", f.read()) if b.strip()]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for block in blocks:
        builder.add_document(np.append(np.frombuffer(block.encode(), dtype=np.uint8), BYTE_EOT).astype(np.uint16))
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("bytes") / "shakespeare_bytes")
    write_byte_dataset(prefix)
    return prefix


def tiny(data, out_dir, **overrides):
    """--key=value arguments for a 2-layer model on the byte dataset: 60 steps of 8 x 32 tokens."""
    config = dict(data_paths=data, index_mapping_dir=os.path.join(os.path.dirname(data), "index_cache"),
                  split="90,10,0", seq_length=32, n_layer=2, n_head=2, n_embd=32, vocab_size=512,
                  padded_vocab_size=None, global_batch_size=8, local_batch_size=4, max_steps=60, lr=3e-3,
                  lr_warmup_steps=2, val_every_steps=10, val_tokens=512, ckpt_every_steps=10, device="cpu",
                  dtype="float32", compile=False, dist_timeout_s=60, out_dir=str(out_dir))
    config.update(overrides)
    return [f"--{key}={value!r}" if isinstance(value, str) else f"--{key}={value}" for key, value in config.items()]


def save_tiny_hf_gpt2(path, vocab_size):
    """A random 2-layer, 32-wide GPT2LMHeadModel saved by transformers at `path` (seed 0); returns `path`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def torchrun(args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, "train_gpt2.py"), *args]


def run(cmd, timeout=300):
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def vislog(path):
    """main.log read the way llm.c's dev/vislog.ipynb reads it: the first key:value after s:N on each line; a later
    line for the same step and stream wins."""
    streams = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"s:(\d+) (\w+):([\d.]+)", line)
            assert m, f"main.log line vislog cannot parse: {line!r}"
            streams.setdefault(m.group(2), {})[int(m.group(1))] = float(m.group(3))
    return streams


def metrics(out_dir, key):
    """{step: value} of a metric in metrics.jsonl (full precision); later records win, as in vislog."""
    found = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if key in record:
                found[record["step"]] = record[key]
    return found


def checkpoints(out_dir):
    return sorted(os.listdir(os.path.join(out_dir, "ckpt")))


def wait_for_line(path, pattern, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if os.path.exists(path):
            with open(path) as f:
                if re.search(pattern, f.read(), re.M):
                    return
        time.sleep(0.01)
    raise TimeoutError(f"{pattern} never appeared in {path}")


def process_tree(pid):
    """pid and all its descendants (torchrun starts its workers in their own sessions)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree
