"""indexed_dataset.py under torch.distributed (gloo, 2 ranks): rank 0 builds the index cache, the other rank loads
it, both see the same samples, a failure on rank 0 reaches every rank, and the sampler splits the global order."""
import glob
import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np

from conftest import ROOT
from indexed_dataset import build_gpt_datasets
from conftest import random_documents, write_ours

SCRIPT = textwrap.dedent("""
    import datetime, hashlib, sys
    import numpy as np
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from indexed_dataset import PretrainingSampler, build_gpt_datasets, resolve_blend

    data, cache = sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # rank 0's error reaches the other rank instead of leaving it waiting
    weighted = [x for prefix in resolve_blend(data)[0] for x in ("1", prefix)]
    try:
        build_gpt_datasets(weighted, seq_length=16, split="969,30,1", sizes=(100, 10, 10), cache_dir=cache + "2")
        raise AssertionError("an empty test split with a size must fail")
    except ValueError as error:
        assert rank == 0 and "has no tokens" in str(error), error
    except RuntimeError as error:
        assert rank != 0 and "rank 0 could not build the datasets: ValueError" in str(error), error

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
