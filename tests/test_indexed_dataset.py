"""indexed_dataset.py: the .bin/.idx files against megatron-core 0.16.1, bad input, the index cache, the sampler and
the validation views (the command line: test_dataset_tools.py). GPT sampling and blending against megatron-core:
test_indexed_megatron.py."""
import glob
import json
import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

from conftest import ROOT, corrupt, deny_writes, random_documents, write_ours
from indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, LLMCValWindows, PretrainingSampler,
                             build_gpt_datasets, resolve_blend, sequential_samples, split_matrix)

with warnings.catch_warnings():  # megatron-core warns at import that Transformer Engine and Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder


def write_megatron(prefix, documents, dtype=np.uint16):
    builder = MegatronBuilder(prefix + ".bin", dtype=dtype)
    for tokens, lengths in documents:
        builder.add_document(tokens, lengths)
    builder.finalize(prefix + ".idx")
    return prefix


def read_bytes(prefix):
    return tuple(open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx"))


@pytest.fixture
def dataset(tmp_path):
    return write_ours(str(tmp_path / "data_text_document"), random_documents(np.random.default_rng(0), 300))


# ----------------------------------------------------------------------------------------------------------------------
# Files: byte for byte with megatron-core, and each reads the other's


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_builder_writes_megatron_bytes(tmp_path, dtype):
    documents = random_documents(np.random.default_rng(1), 200, vocab=120)
    ours = write_ours(str(tmp_path / "ours"), documents, dtype)
    theirs = write_megatron(str(tmp_path / "theirs"), documents, dtype)
    assert read_bytes(ours) == read_bytes(theirs)


def test_default_dtype_and_plain_documents_match_preprocess_data(tmp_path):
    # preprocess_data.py: one sequence per document, an empty document adds only a boundary; uint16 for GPT-2
    documents = [[5, 6, 7], [], [8], list(range(100))]
    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"))
    assert builder.dtype == np.uint16 and DType.optimal_dtype(50257) is np.uint16
    assert DType.optimal_dtype(128256) is np.int32
    for tokens in documents:
        builder.add_document(tokens)
    builder.finalize(str(tmp_path / "ours.idx"))
    theirs = write_megatron(str(tmp_path / "theirs"), [(t, [len(t)] if t else []) for t in documents], np.uint16)
    assert read_bytes(str(tmp_path / "ours")) == read_bytes(theirs)
    assert IndexedDataset(str(tmp_path / "ours")).document_indices.tolist() == [0, 1, 1, 2, 3]


def test_merge_writes_megatron_bytes(tmp_path):
    rng = np.random.default_rng(2)
    parts = [write_ours(str(tmp_path / f"part{i}"), random_documents(rng, 50)) for i in range(3)]
    ours = IndexedDatasetBuilder(str(tmp_path / "ours.bin"))
    theirs = MegatronBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    ours.add_document([1, 2, 3])
    theirs.add_document([1, 2, 3], [3])
    for part in parts:
        ours.add_index(part)
        theirs.add_index(part)
    ours.finalize(str(tmp_path / "ours.idx"))
    theirs.finalize(str(tmp_path / "theirs.idx"))
    assert read_bytes(str(tmp_path / "ours")) == read_bytes(str(tmp_path / "theirs"))


def test_reader_reads_megatron_files_and_megatron_reads_ours(tmp_path):
    documents = random_documents(np.random.default_rng(3), 150)
    for write in (write_ours, write_megatron):
        prefix = write(str(tmp_path / write.__name__), documents)
        ours, theirs = IndexedDataset(prefix), MegatronIndexedDataset(prefix)
        assert len(ours) == len(theirs) == sum(len(lengths) for _, lengths in documents)
        assert ours.num_documents == len(documents) and ours.dtype == np.uint16
        assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
        assert np.array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
        assert np.array_equal(ours.document_indices, theirs.document_indices)
        for i in range(len(ours)):
            assert np.array_equal(ours[i], theirs[i])
            n = int(ours.sequence_lengths[i])
            assert np.array_equal(ours.get(i, n // 3, n // 2), theirs.get(i, n // 3, n // 2))
            assert np.array_equal(ours.get(i, n // 3), theirs.get(i, n // 3))
        assert ours.num_tokens == sum(len(tokens) for tokens, _ in documents)


def test_arrays_outlive_the_dataset_object(dataset):
    sequence = IndexedDataset(dataset)[3]
    lengths = IndexedDataset(dataset).sequence_lengths
    assert sequence.sum() >= 0 and lengths.sum() > 0  # the maps stay open while views of them live
    with pytest.raises(IndexError):
        IndexedDataset(dataset)[len(lengths)]


def test_empty_dataset(tmp_path):
    IndexedDatasetBuilder(str(tmp_path / "empty.bin")).finalize(str(tmp_path / "empty.idx"))
    ds = IndexedDataset(str(tmp_path / "empty"))
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def test_builder_rejects_bad_documents(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match=r"x\.bin: token 70000 does not fit .*uint16"):
        builder.add_document([1, 70000])
    with pytest.raises(ValueError, match=r"x\.bin: token -1 does not fit"):
        builder.add_document([-1, 2])
    with pytest.raises(ValueError, match="do not add up"):
        builder.add_document([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match="1-D"):
        builder.add_document([[1, 2]])
    with pytest.raises(ValueError, match="integers"):
        builder.add_document([1.5])
    write_ours(str(tmp_path / "wide"), [([1, 2], [2])], np.int32)
    with pytest.raises(ValueError, match=r"wide: dtype int32 differs from .*x\.bin's uint16"):
        builder.add_index(str(tmp_path / "wide"))


def test_rebuilding_a_prefix_removes_its_old_index_first(dataset):
    IndexedDatasetBuilder(dataset + ".bin")  # interrupted before finalize
    assert not os.path.exists(dataset + ".idx")
    with pytest.raises(FileNotFoundError, match=r"data_text_document\.idx: no such file"):
        IndexedDataset(dataset)


# ----------------------------------------------------------------------------------------------------------------------
# Bad files: a clear error naming the file


@pytest.mark.parametrize("damage, error", [
    (dict(suffix=".idx", offset=0, data=b"NOTANIDX!"), r"data_text_document\.idx: not a Megatron indexed dataset"),
    (dict(suffix=".idx", offset=9, data=struct.pack("<Q", 2)), r"\.idx: unsupported index version 2"),
    (dict(suffix=".idx", offset=17, data=bytes([9])), r"\.idx: unknown dtype code 9"),
    (dict(suffix=".idx", size=20), r"\.idx: truncated: 20 bytes, less than the 34-byte header"),
    (dict(suffix=".idx", size=0), r"\.idx: truncated: 0 bytes"),
    (dict(suffix=".idx", size=1000), r"\.idx: truncated: its header announces \d+ sequences"),
    (dict(suffix=".idx", append=b"xx"), r"\.idx: 2 bytes after the document boundaries"),
    (dict(suffix=".idx", offset=18, data=struct.pack("<Q", 10)), r"\.idx: \d+ bytes after .* \(10 sequences"),
    (dict(suffix=".bin", size=100), r"data_text_document\.bin: 100 bytes, shorter than the \d+ bytes its index"),
    (dict(suffix=".bin", size=101), r"\.bin: 101 bytes is not a whole number of uint16 tokens"),
])
def test_bad_files_raise_naming_the_file(dataset, damage, error):
    corrupt(dataset, **damage)
    with pytest.raises(ValueError, match=error):
        IndexedDataset(dataset)


def index_layout(prefix):
    """(sequence count, document boundary count) and the byte offsets of the lengths, pointers and boundaries."""
    ds = IndexedDataset(prefix)
    count, boundaries = len(ds), len(ds.document_indices)
    del ds
    return count, boundaries, 34, 34 + 4 * count, 34 + 12 * count


# one defect each: the index disagrees with itself or with the .bin, which would otherwise train silently
@pytest.mark.parametrize("defect, error", [
    ("dtype code", r"data_text_document\.idx: corrupt: sequence \d+ starts at byte \d+ of the \.bin, but the lengths "
                   r"before it put it at byte \d+ \(uint8 tokens\): a wrong dtype code"),
    ("length", r"\.idx: corrupt: sequence 4 starts at byte \d+ of the \.bin, but the lengths before it put it at"),
    ("pointer", r"\.idx: corrupt: sequence 7 starts at byte 1 of the \.bin"),
    ("negative length", r"\.idx: corrupt: sequence 2 has a negative length -5"),
    ("longer bin", r"data_text_document\.bin: \d+ bytes, longer than the \d+ bytes its index .*\.idx says"),
    ("document count", r"data_text_document\.idx: truncated: its header announces \d+ sequences and \d+ documents"),
    ("decreasing boundaries", r"\.idx: corrupt: document boundaries decrease"),
])
def test_inconsistent_index_raises_on_open(dataset, defect, error):
    count, boundaries, lengths_at, pointers_at, boundaries_at = index_layout(dataset)
    length_3 = struct.unpack_from("<i", open(dataset + ".idx", "rb").read(), lengths_at + 12)[0]
    damage = {
        "dtype code": dict(suffix=".idx", offset=17, data=bytes([1])),
        "length": dict(suffix=".idx", offset=lengths_at + 12, data=struct.pack("<i", length_3 + 1)),
        "pointer": dict(suffix=".idx", offset=pointers_at + 7 * 8, data=struct.pack("<q", 1)),
        "negative length": dict(suffix=".idx", offset=lengths_at + 8, data=struct.pack("<i", -5)),
        "longer bin": dict(suffix=".bin", append=b"\0\0"),
        "document count": dict(suffix=".idx", offset=26, data=struct.pack("<Q", boundaries + 1)),
        "decreasing boundaries": dict(suffix=".idx", offset=boundaries_at + 16, data=struct.pack("<q", count)),
    }[defect]
    corrupt(dataset, **damage)
    with pytest.raises(ValueError, match=error):
        IndexedDataset(dataset)


def test_corrupt_document_boundaries(dataset):
    ds = IndexedDataset(dataset)
    last_boundary = 34 + 12 * len(ds) + 8 * ds.num_documents
    del ds
    corrupt(dataset, ".idx", offset=last_boundary, data=struct.pack("<q", 5))
    with pytest.raises(ValueError, match=r"\.idx: corrupt: document boundaries run from 0 to 5"):
        IndexedDataset(dataset)


def test_missing_files(dataset, tmp_path):
    os.remove(dataset + ".bin")
    with pytest.raises(FileNotFoundError, match=r"data_text_document\.bin: no such file"):
        IndexedDataset(dataset)
    with pytest.raises(FileNotFoundError, match=r"nope\.bin\.idx: no such file \(give the prefix, without"):
        IndexedDataset(str(tmp_path / "nope.bin"))


def test_paths_glob_and_blend_list(tmp_path):
    rng = np.random.default_rng(4)
    for name in ("b_text_document", "a_text_document", "c_other"):
        write_ours(str(tmp_path / name), random_documents(rng, 5))
    os.makedirs(tmp_path / "a_text_document" / "cache")  # megatron's default cache directory looks like a prefix
    assert resolve_blend(str(tmp_path / "*_text_document*")) == (
        [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")], None)
    assert resolve_blend(str(tmp_path / "*_text_document")) == (  # a glob of prefixes, as configs/ write it
        [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")], None)
    with pytest.raises(FileNotFoundError, match=r"nothing\*: the glob matches no \.bin/\.idx files"):
        resolve_blend(str(tmp_path / "nothing*"))
    assert resolve_blend(["30", " p0", "70", "p1 "]) == (["p0", "p1"], [30.0, 70.0])
    assert resolve_blend(["p0", "p1"]) == (["p0", "p1"], None)
    assert resolve_blend(["p0", "p1", "p2"]) == (["p0", "p1", "p2"], None)
    with pytest.raises(ValueError, match=r"weight 'x' is not a number"):
        resolve_blend(["30", "p0", "x", "p1"])
    with pytest.raises(ValueError, match="positive finite"):
        resolve_blend(["30", "p0", "-5", "p1"])
    with pytest.raises(ValueError, match="needs a size for every split"):
        build_gpt_datasets(["1", str(tmp_path / "a_text_document")], seq_length=4, split="1,1", sizes=(4, None, None))


@pytest.mark.parametrize("split", ["a,b", "1,2,3,4", "-1,2", "0,0,0", "1..2", "", "1e-3"])
def test_bad_split_strings(split):
    with pytest.raises(ValueError, match="split"):
        split_matrix(split)


def test_bad_arguments(dataset):
    with pytest.raises(ValueError, match="seq_length"):
        build_gpt_datasets(dataset, seq_length=0)
    with pytest.raises(ValueError, match="sizes"):
        build_gpt_datasets(dataset, seq_length=8, sizes=(10, -1, None))
    with pytest.raises(ValueError, match="seed"):
        build_gpt_datasets(dataset, seq_length=8, seed=-1)


# ----------------------------------------------------------------------------------------------------------------------
# The index cache


def build(prefix, cache_dir, **options):
    options = dict(seq_length=16, split="90,8,2", sizes=(2000, 100, 30), cache_dir=cache_dir) | options
    return build_gpt_datasets(prefix, **options)


def same_samples(a, b):
    return len(a) == len(b) and all(np.array_equal(a[i]["tokens"], b[i]["tokens"]) and
                                    np.array_equal(a[i]["labels"], b[i]["labels"]) for i in range(len(a)))


def test_cache_is_built_once_then_loaded(dataset, tmp_path, capfd):
    cache = str(tmp_path / "cache")
    fresh = build(dataset, None)
    capfd.readouterr()
    first = build(dataset, cache)
    assert capfd.readouterr().err.count("built in") == 3
    second = build(dataset, cache)
    assert capfd.readouterr().err == ""
    assert isinstance(second[0].sample_index, np.memmap)
    for a, b, c in zip(fresh, first, second):
        assert same_samples(a, b) and same_samples(a, c)
    names = os.listdir(cache)
    # 3 splits x (a description and 3 arrays), and the record that the index was checked
    assert len(names) == 3 * 4 + 1 and not [n for n in names if n.endswith(".tmp")]
    # another request is another cache entry; the old one stays valid
    build(dataset, cache, sizes=(3000, 100, 30))
    assert len(os.listdir(cache)) == 3 * 4 + 1 + 4


@pytest.mark.parametrize("damage", ["truncate", "description", "missing"])
def test_damaged_cache_is_rebuilt(dataset, tmp_path, capfd, damage):
    cache = str(tmp_path / "cache")
    expected = build(dataset, None)
    build(dataset, cache)
    capfd.readouterr()
    [sample_index] = glob.glob(os.path.join(cache, "*-GPTDataset-train-sample_index.npy"))
    if damage == "truncate":
        corrupt(sample_index[:-len(".npy")], ".npy", size=os.path.getsize(sample_index) // 2)
    elif damage == "description":
        description_path = sample_index.replace("-sample_index.npy", ".json")
        description = json.load(open(description_path))
        description["key"]["seed"] += 1
        json.dump(description, open(description_path, "w"))
    else:
        os.remove(sample_index)
    rebuilt = build(dataset, cache)
    err = capfd.readouterr().err
    assert "ignoring the cached indices" in err and err.count("built in") == 1
    assert all(same_samples(a, b) for a, b in zip(expected, rebuilt))
    build(dataset, cache)
    assert capfd.readouterr().err == ""  # the repaired entry is used


def test_the_index_is_checked_once_per_file_version(dataset, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    _, _, _, pointers_at, _ = index_layout(dataset)
    checks = []
    real_check = IndexedDataset.check
    monkeypatch.setattr(IndexedDataset, "check", lambda self: checks.append(self) or real_check(self))
    build(dataset, cache)
    assert len(checks) == 1
    build(dataset, cache)
    assert len(checks) == 1  # a warm start trusts the check made on these very files
    corrupt(dataset, ".idx", offset=pointers_at + 5 * 8, data=struct.pack("<q", 3))  # a new mtime: checked again
    with pytest.raises(ValueError, match=r"\.idx: corrupt: sequence 5 starts at byte 3 of the \.bin"):
        build(dataset, cache)
    assert len(checks) == 2


def test_cache_is_rebuilt_when_the_data_changes(tmp_path, capfd):
    prefix, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    write_ours(prefix, random_documents(np.random.default_rng(5), 300))
    build(prefix, cache)
    write_ours(prefix, random_documents(np.random.default_rng(6), 300))  # new data under the same name
    capfd.readouterr()
    rebuilt = build(prefix, cache)
    assert capfd.readouterr().err.count("built in") == 3
    assert all(same_samples(a, b) for a, b in zip(build(prefix, None), rebuilt))


def test_blend_cache(tmp_path, capfd):
    rng = np.random.default_rng(7)
    blend = ["1", write_ours(str(tmp_path / "a"), random_documents(rng, 200)),
             "3", write_ours(str(tmp_path / "b"), random_documents(rng, 300))]
    cache = str(tmp_path / "cache")
    expected = build(blend, None)
    build(blend, cache)
    capfd.readouterr()
    cached = build(blend, cache)
    assert capfd.readouterr().err == "" and isinstance(cached[0].dataset_index, np.memmap)
    assert all(same_samples(a, b) for a, b in zip(expected, cached))


def cache_entries(directory):
    """The index cache's entries in `directory`, less the records that an index was checked."""
    return sorted(p for p in glob.glob(os.path.join(directory, "*.json")) if not p.endswith("-checked.json"))


def test_cache_dir_none_keeps_the_indices_beside_the_data(tmp_path, capfd):
    rng = np.random.default_rng(10)
    prefixes = [write_ours(str(tmp_path / f"p{i}_text_document"), random_documents(rng, 300)) for i in range(2)]
    fresh = build(prefixes, None)
    # megatron-core's default place for a GPTDataset's indices; the blend's go beside the first prefix
    assert len(cache_entries(os.path.join(prefixes[0], "cache", "GPTDataset_indices"))) == 3
    assert len(cache_entries(os.path.join(prefixes[1], "cache", "GPTDataset_indices"))) == 3
    assert len(cache_entries(os.path.join(prefixes[0], "cache", "BlendedDataset_indices"))) == 3
    capfd.readouterr()
    again = build(prefixes, None)
    assert "built in" not in capfd.readouterr().err  # loaded, not rebuilt
    assert all(same_samples(a, b) for a, b in zip(fresh, again))


@pytest.mark.parametrize("fallback", [True, False])
def test_read_only_data_dir_uses_the_fallback_cache_dir(tmp_path, capfd, monkeypatch, fallback):
    data = tmp_path / "data"
    data.mkdir()
    prefix = write_ours(str(data / "d_text_document"), random_documents(np.random.default_rng(11), 300))
    os.chmod(data, 0o555)
    deny_writes(monkeypatch, data)
    try:
        fallback_dir = str(tmp_path / "out") if fallback else None
        datasets = build_gpt_datasets(prefix, seq_length=16, split="90,8,2", sizes=(2000, 100, 30),
                                      fallback_cache_dir=fallback_dir)
    finally:
        os.chmod(data, 0o755)
    assert not os.path.exists(os.path.join(prefix, "cache"))
    err = capfd.readouterr().err
    assert err.count("built in") == 3
    if fallback:
        assert len(cache_entries(fallback_dir)) == 3
    else:
        assert "not writable and no fallback cache directory" in err
    assert all(same_samples(a, b) for a, b in zip(datasets, build(prefix, str(tmp_path / "cache"))))


# ----------------------------------------------------------------------------------------------------------------------
# The validation view


def test_sequential_samples_read_the_split_in_order(tmp_path):
    rng = np.random.default_rng(8)
    prefixes = [write_megatron(str(tmp_path / f"p{i}_text_document"), random_documents(rng, 120)) for i in range(2)]
    stream = []
    for prefix in prefixes:  # the valid split of each prefix, read by megatron-core
        theirs = MegatronIndexedDataset(prefix)
        begin, end = int(round(0.7 * len(theirs))), int(round(1.0 * len(theirs)))
        stream += [theirs[i].copy() for i in range(begin, end)]  # its arrays die with it
    stream = np.concatenate(stream).astype(np.int64)
    L = 24
    samples = sequential_samples(str(tmp_path / "p*_text_document*"), seq_length=L, split="70,30")
    assert len(samples) == (len(stream) - 1) // L
    for i in range(len(samples)):
        assert np.array_equal(samples[i]["tokens"], stream[i * L:i * L + L])
        assert np.array_equal(samples[i]["labels"], stream[i * L + 1:i * L + L + 1])
        assert samples[i]["tokens"].dtype == np.int64
    assert len(sequential_samples(prefixes, seq_length=L, split="70,30", max_samples=5)) == 5
    assert sequential_samples(prefixes, seq_length=L, split="70,30", split_index=2) is None
    with pytest.raises(ValueError, match=r"p0_text_document, .*p1_text_document: the valid split .* holds"):
        sequential_samples(prefixes, seq_length=10**6, split="70,30")
    with pytest.raises(IndexError):
        samples[len(samples)]


def test_llmc_val_windows_read_the_eot_led_stream(tmp_path):
    rng = np.random.default_rng(12)
    documents = [np.append(rng.integers(0, 50256, rng.integers(1, 40)), 50256) for _ in range(30)]
    prefix = str(tmp_path / "val_text_document")
    write_ours(prefix, [(d, [len(d)]) for d in documents])
    stream = np.concatenate([[50256]] + documents).astype(np.int64)  # llm.c's val shard: EOT, then each document
    T = 16
    windows = LLMCValWindows(prefix, T, num_tokens=len(stream) - 1 - 3 * T)
    assert len(windows) == (len(stream) - 1 - 3 * T) // T
    for k in range(len(windows)):
        assert windows[k]["tokens"].dtype == windows[k]["labels"].dtype == np.int64
        assert np.array_equal(windows[k]["tokens"], stream[T * k:T * k + T])
        assert np.array_equal(windows[k]["labels"], stream[T * k + 1:T * k + T + 1])
    assert len(LLMCValWindows(prefix, T, num_tokens=(len(stream) - 1) // T * T)) == (len(stream) - 1) // T
    too_many = ((len(stream) - 1) // T + 1) * T
    with pytest.raises(ValueError, match=rf"val_text_document\.bin: the stream holds {len(stream)} tokens .*fewer "
                                         rf"than the {too_many + 1} that {too_many // T} windows of {T} need"):
        LLMCValWindows(prefix, T, num_tokens=too_many)


# ----------------------------------------------------------------------------------------------------------------------
# The sampler


def test_sampler_slices_global_batches_and_resumes_on_another_world_size():
    total, mbs = 103, 4

    def run(world_size, consumed, steps, accumulation):
        samplers = [iter(PretrainingSampler(total, consumed, mbs, rank, world_size)) for rank in range(world_size)]
        order = []
        for _ in range(steps * accumulation):
            for sampler in samplers:
                order += next(sampler)
        return order

    # 2 ranks, 2 micro-batches per step: a step reads the next 16 indices, rank r the r-th 4 of each 8
    first = run(2, 0, 3, 2)
    assert first == list(range(48))
    assert list(PretrainingSampler(total, 0, mbs, 1, 2))[:2] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    # resume after 3 steps (48 samples) on 3 ranks: the global order goes on where it stopped
    assert run(3, 48, 2, 1) == list(range(48, 72))
    # an incomplete last global batch is dropped
    batches = list(PretrainingSampler(total, 48, mbs, 0, 3))
    assert len(batches) == (total - 48) // 12 == 4 and batches[-1] == [84, 85, 86, 87]
    with pytest.raises(ValueError):
        PretrainingSampler(total, 0, mbs, 2, 2)
    with pytest.raises(ValueError):
        PretrainingSampler(total, total + 1, mbs, 0, 1)


def test_sampler_drives_a_dataloader(dataset):
    import torch

    train, _, _ = build_gpt_datasets(dataset, seq_length=16, split="1", sizes=(64, None, None))
    loader = torch.utils.data.DataLoader(train, batch_sampler=PretrainingSampler(len(train), 8, 4, 1, 2))
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, 16) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"][0], torch.from_numpy(train[12]["tokens"]))


def test_indexed_dataset_imports_without_torch():
    code = "import sys, indexed_dataset; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
