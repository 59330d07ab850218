"""indexed_dataset.py under torch.distributed (gloo, 2 ranks): rank 0 builds the index cache, the other rank loads
it, both see the same samples, a failure on rank 0 reaches every rank, and the sampler splits the global order; on two
nodes whose caches are apart, each node's local rank 0 writes the cache its ranks read."""
import glob
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch.distributed

import indexed_dataset
from conftest import ROOT
from indexed_dataset import build_gpt_datasets
from conftest import random_documents, write_ours

SCRIPT = textwrap.dedent("""
    import datetime, hashlib, sys
    import numpy as np
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from indexed_dataset import PretrainingSampler, build_gpt_datasets, build_in_turns, resolve_blend

    data, cache = sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # rank 0's error reaches the other rank instead of leaving it waiting: on every rank a ValueError or OSError of
    # one line naming the file, which the trainer prints as one line per rank
    prefixes = resolve_blend(data)[0]
    weighted = [x for prefix in prefixes for x in ("1", prefix)]
    open(cache + "-file", "w").close()
    for paths, cache_dir, kind, names in [(weighted, cache + "2", ValueError, prefixes[0] + ": its test split"),
                                          (data, cache + "-file/cache", OSError, cache + "-file/cache")]:
        try:
            build_gpt_datasets(paths, seq_length=16, split="969,30,1", sizes=(100, 10, 10), cache_dir=cache_dir)
            raise AssertionError("the build must fail")
        except kind as error:
            assert names in str(error) and len(str(error).splitlines()) == 1, (rank, error)
    # an error without a text (a bare assert in a build) reaches the other rank too, by its kind
    def fails():
        raise AssertionError()
    try:
        build_in_turns(fails)
        raise RuntimeError("the build must fail")
    except (AssertionError, ValueError) as error:
        assert rank == 0 or str(error) == "AssertionError (on rank 0)", (rank, error)

    datasets = build_gpt_datasets(data, seq_length=16, split="90,8,2", sizes=(3000, 100, None), cache_dir=cache)
    train = datasets[0]
    # rank 0 built the indices and wrote them; the other rank mapped them from the cache
    arrays = [train.dataset_index, train.datasets[0].sample_index, datasets[1].datasets[1].shuffle_index]
    assert all(isinstance(a, np.memmap) for a in arrays) == (rank != 0), rank
    digest = hashlib.sha256()
    for dataset in datasets:
        for i in range(len(dataset)):
            digest.update(dataset[i]["tokens"].tobytes() + dataset[i]["labels"].tobytes())
    digests = [None] * world_size
    dist.all_gather_object(digests, digest.hexdigest())
    assert len(set(digests)) == 1, digests

    # with 2 micro-batches of 4 per step, each rank takes its slice; together they read the samples in order
    consumed = 48
    mine = list(PretrainingSampler(len(train), consumed, 4, rank, world_size))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    merged = [i for step in zip(*everyone) for batch in step for i in batch]
    assert merged == list(range(consumed, consumed + len(merged))), merged[:20]
    assert len(merged) == (len(train) - consumed) // 8 * 8
    if rank == 0:
        print("digest", digests[0], flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_rank0_builds_the_cache_and_the_other_rank_loads_it(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(2):
        write_ours(str(tmp_path / f"part_{i}_text_document"), random_documents(rng, 400))
    data, cache = str(tmp_path / "part_*_text_document*"), str(tmp_path / "cache")
    script = tmp_path / "check_ranks.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), ROOT,
         data, cache], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    expected = hashlib.sha256()
    for dataset in build_gpt_datasets(data, seq_length=16, split="90,8,2", sizes=(3000, 100, None)):
        for i in range(len(dataset)):
            expected.update(dataset[i]["tokens"].tobytes() + dataset[i]["labels"].tobytes())
    assert f"digest {expected.hexdigest()}" in result.stdout
    # one description per dataset: 2 prefixes x 3 splits and 3 blends; nothing half-written
    assert len(glob.glob(os.path.join(cache, "*-GPTDataset-*.json"))) == 6
    assert len(glob.glob(os.path.join(cache, "*-BlendedDataset-*.json"))) == 3
    assert len(glob.glob(os.path.join(cache, "*-IndexedDataset-checked.json"))) == 2
    assert not glob.glob(os.path.join(cache, ".*.tmp"))


NODE_SCRIPT = textwrap.dedent("""
    import datetime, hashlib, json, os, sys
    import numpy as np
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from indexed_dataset import build_gpt_datasets

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    # "cache" is relative: each node's working directory holds its own, as on nodes that share no filesystem
    train = build_gpt_datasets(sys.argv[2], seq_length=16, split="90,8,2", sizes=(3000, 100, None),
                               cache_dir="cache")[0]
    digest = hashlib.sha256()
    for i in range(len(train)):
        digest.update(train[i]["tokens"].tobytes())
    mapped = all(isinstance(a, np.memmap) for a in (train.dataset_index, train.datasets[1].sample_index))
    # one write() per rank: the ranks share a pipe, and print() may split a line between two writes
    line = json.dumps(dict(rank=dist.get_rank(), local_rank=int(os.environ["LOCAL_RANK"]), mapped=mapped,
                           digest=digest.hexdigest()))
    os.write(1, (line + "\\n").encode())
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_every_node_builds_the_index_cache_it_reads(tmp_path):
    # two nodes of two ranks (two torchrun agents, node ranks 0 and 1) whose index caches are different directories
    rng = np.random.default_rng(1)
    for i in range(2):
        write_ours(str(tmp_path / f"part_{i}_text_document"), random_documents(rng, 400))
    data = str(tmp_path / "part_*_text_document*")
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    for node in range(2):
        os.makedirs(tmp_path / f"node{node}")
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--node_rank",
             str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), ROOT, data],
            cwd=tmp_path / f"node{node}", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for process in nodes:
            out, err = process.communicate(timeout=300)
            assert process.returncode == 0, out[-3000:] + err[-3000:]
            outputs += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for process in nodes:
            process.kill()
    assert sorted(o["rank"] for o in outputs) == [0, 1, 2, 3]
    assert len({o["digest"] for o in outputs}) == 1
    assert all(o["mapped"] for o in outputs if o["local_rank"] == 1)  # the node's leader wrote what they read
    for node in range(2):
        cache = tmp_path / f"node{node}" / "cache"
        assert len(glob.glob(str(cache / "*-GPTDataset-*.json"))) == 6, node
        assert len(glob.glob(str(cache / "*-BlendedDataset-*.json"))) == 3, node
        assert len(glob.glob(str(cache / "*-IndexedDataset-checked.json"))) == 2, node


def test_a_failure_on_one_rank_is_one_line_naming_the_file_on_every_rank(tmp_path, monkeypatch):
    """The turns of build_gpt_datasets in one process: two threads stand for ranks 0 and 1 of a node, with
    all_gather_object between them. Rank 0 finds a damaged pointer in the .idx; both raise a ValueError of one line
    naming the file (the trainer prints one line per rank), neither waits."""
    prefix = write_ours(str(tmp_path / "d_text_document"), random_documents(np.random.default_rng(2), 300))
    with open(prefix + ".idx", "r+b") as f:  # sequence 5's pointer
        f.seek(34 + 4 * len(indexed_dataset.IndexedDataset(prefix)) + 5 * 8)
        f.write(struct.pack("<q", 3))
    ranks, slots, barrier = threading.local(), [None, None], threading.Barrier(2, timeout=60)

    def all_gather_object(out, value):
        slots[ranks.rank] = value
        barrier.wait()
        out[:] = list(slots)
        barrier.wait()

    monkeypatch.setattr(indexed_dataset, "distributed", lambda: (ranks.rank, 2))
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    errors = [None, None]

    def rank(r):
        ranks.rank = r
        try:
            build_gpt_datasets(prefix, seq_length=16, split="1", sizes=(100, None, None), cache_dir=str(tmp_path / "c"))
        except Exception as error:
            errors[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for error in errors:
        assert isinstance(error, ValueError) and "\n" not in str(error), errors
        assert str(error).startswith(f"{prefix}.idx: corrupt: sequence 5 starts at byte 3"), errors
