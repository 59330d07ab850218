"""indexed_dataset.py against megatron-core 0.16.1: the .bin/.idx bytes, and GPT sampling and blending (the same index
arrays, the same samples, the same order); bad input named in one line, the index cache, the validation views, the
sampler, the source of a sample, data fingerprints and the info / verify command line."""
import errno
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import indexed_dataset
from conftest import ROOT, corrupt, deny_writes, random_documents, write_ours
from indexed_dataset import (BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetBuilder,
                             LLMCValWindows, PretrainingSampler, blending_indices, build_gpt_datasets,
                             first_samples_agree, gpt_indices, one_epoch_samples, resolve_blend, sequential_samples,
                             split_matrix, split_range, token_weighted_blend)

with warnings.catch_warnings():  # megatron-core warns at import that Transformer Engine and Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers as megatron_helpers
    from megatron.core.datasets.blended_dataset import BlendedDataset as MegatronBlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import DType
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder
    from megatron.core.datasets.utils import Split, get_blend_from_list


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
    with pytest.raises(ValueError, match=r"x\.bin: tokens int64 \[70000\] do not fit .*uint16"):
        builder.add_document([1, 70000])
    with pytest.raises(ValueError, match=r"x\.bin: tokens int64 \[-1\] do not fit"):
        builder.add_document([-1, 2])
    with pytest.raises(ValueError, match="do not add up"):
        builder.add_document([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match="1-D"):
        builder.add_document([[1, 2]])
    with pytest.raises(ValueError, match="do not fit"):
        builder.add_document([1.5])


def test_rebuilding_a_prefix_removes_its_old_index_first(dataset):
    IndexedDatasetBuilder(dataset + ".bin")  # interrupted before finalize
    assert not os.path.exists(dataset + ".idx")
    with pytest.raises(FileNotFoundError, match=r"data_text_document\.idx: no such file"):
        IndexedDataset(dataset)


# ----------------------------------------------------------------------------------------------------------------------
# Bad files: a clear error naming the file


@pytest.mark.parametrize("damage, error", [
    (dict(suffix=".idx", offset=0, data=b"NOTANIDX!"), r"data_text_document\.idx: not a Megatron indexed dataset"),
    (dict(suffix=".idx", offset=9, data=struct.pack("<Q", 2)), r"\.idx: not a Megatron .* version 2"),
    (dict(suffix=".idx", offset=17, data=bytes([9])), r"\.idx: not a Megatron .* dtype code 9"),
    (dict(suffix=".idx", size=20), r"\.idx: truncated: 20 bytes, less than the 34-byte header"),
    (dict(suffix=".idx", size=0), r"\.idx: truncated: 0 bytes"),
    (dict(suffix=".idx", size=1000), r"\.idx: truncated or corrupt: its header announces \d+ sequences .* not 1000"),
    (dict(suffix=".idx", append=b"xx"), r"\.idx: truncated or corrupt: .*, (\d+) bytes, not (?!\1)\d+"),
    (dict(suffix=".idx", offset=18, data=struct.pack("<Q", 10)), r"\.idx: truncated or corrupt: .*10 sequences"),
    (dict(suffix=".bin", size=100), r"data_text_document\.bin: 100 bytes, not the \d+ bytes its .*\.idx says"),
    (dict(suffix=".bin", size=101), r"\.bin: 101 bytes, not the \d+ bytes its .*\.idx says"),
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
                   r"before it say \d+ \(uint8 tokens\): a wrong dtype"),
    ("length", r"\.idx: corrupt: sequence 4 starts at byte \d+ of the \.bin, but the lengths before it say"),
    ("pointer", r"\.idx: corrupt: sequence 7 starts at byte 1 of the \.bin"),
    ("negative length", r"\.idx: corrupt: sequence 3 starts at byte \d+ of the \.bin"),
    ("longer bin", r"data_text_document\.bin: \d+ bytes, not the \d+ bytes its .*\.idx says"),
    ("document count", r"data_text_document\.idx: truncated or corrupt: its header announces \d+ sequences and \d+ "
                       r"documents"),
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
    with pytest.raises(FileNotFoundError, match=r"data_text_document\.bin: no such file; write the token files with "
                                                r"prepare_fineweb\.py"):
        IndexedDataset(dataset)
    with pytest.raises(FileNotFoundError, match=r"nope_\*: the glob matches no \.bin/\.idx files; write the token "
                                                r"files with prepare_fineweb\.py"):
        resolve_blend(str(tmp_path / "nope_*"))
    with pytest.raises(FileNotFoundError, match=r"nope\.bin\.idx: no such file; .* \(a prefix, no \.bin\)"):
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
    with pytest.raises(ValueError, match=r"alternate weight, prefix"):
        resolve_blend(["30", "p0", "x", "p1"])
    with pytest.raises(ValueError, match="each weight a positive number"):
        resolve_blend(["30", "p0", "-5", "p1"])
    with pytest.raises(ValueError, match="needs a size for every split"):
        build_gpt_datasets(["1", str(tmp_path / "a_text_document")], seq_length=4, split="1,1", sizes=(4, None, None))


@pytest.mark.parametrize("blend", [["0.3", "a", "0.7"], ["0.5", "a", "b"], ["a", "30", "b", "70"]])
def test_a_blend_list_that_does_not_alternate_is_one_error_naming_it(blend):
    with pytest.raises(ValueError, match=re.escape(f"blend list {blend}: it must alternate weight, prefix")):
        resolve_blend(blend)


@pytest.mark.parametrize("split", ["a,b", "1,2,3,4", "-1,2", "0,0,0", "1..2", "", "1e-3"])
def test_bad_split_strings(split):
    with pytest.raises(ValueError, match="split"):
        split_matrix(split)


# ----------------------------------------------------------------------------------------------------------------------
# GPT sampling and blending: megatron-core's index arrays, samples and order


class Tokenizer:
    """All megatron-core needs of a tokenizer here; without a pad token nothing is padded or masked."""
    vocab_size = 1000
    eod = 999
    unique_identifiers = {"class": "TestTokenizer"}


def megatron_config(seq_length, seed=1234, add_extra_token=True, **options):
    return GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, tokenizer=Tokenizer(),
                            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                            create_attention_mask=False, add_extra_token_to_sequence=add_extra_token, **options)


def megatron_build(blend, sizes, split, seq_length, seed=1234, add_extra_token=True):
    # without path_to_cache it caches under <prefix>/cache/, inside the test's tmp_path; its cache key leaves out
    # add_extra_token, so each test uses prefixes of its own
    config = megatron_config(seq_length, seed, add_extra_token, blend=get_blend_from_list(blend), split=split)
    return BlendedMegatronDatasetBuilder(MegatronGPTDataset, list(sizes), lambda: True, config).build()


def assert_same_gpt_indices(theirs, ours):
    for name in ("document_index", "sample_index", "shuffle_index"):
        expected, actual = getattr(theirs, name), getattr(ours, name)
        assert actual.dtype == expected.dtype, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)


def assert_same(theirs, ours):
    """The same indices underneath and every sample's tokens and labels equal, in order."""
    if theirs is None or len(theirs) == 0:
        assert ours is None
        return
    assert len(ours) == len(theirs)
    if isinstance(theirs, MegatronBlendedDataset):
        assert isinstance(ours, BlendedDataset)
        np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
        np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
        assert ours.dataset_index.dtype == np.int16 and ours.dataset_sample_index.dtype == np.int64
        for their_part, our_part in zip(theirs.datasets, ours.datasets, strict=True):
            assert_same_gpt_indices(their_part, our_part)
    else:
        assert_same_gpt_indices(theirs, ours)
    for i in range(len(theirs)):
        expected, actual = theirs[i], ours[i]
        assert actual["tokens"].dtype == actual["labels"].dtype == np.int64
        np.testing.assert_array_equal(actual["tokens"], expected["tokens"].numpy(), err_msg=f"sample {i}")
        np.testing.assert_array_equal(actual["labels"], expected["labels"].numpy(), err_msg=f"sample {i}")


def make_prefixes(tmp_path, count, documents=400, max_length=60, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(tmp_path, exist_ok=True)
    return [write_ours(str(tmp_path / f"part_{i}_text_document"), random_documents(rng, documents, max_length))
            for i in range(count)]


@pytest.mark.parametrize("split", ["969,30,1", "0.99, 0.01, 0.00", "1,1", "1,1,2", "98,2", "1", "3,0,1", "99/1/0"])
def test_split_matrix_and_ranges(tmp_path, split):
    assert split_matrix(split) == convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for n in (5, 7, 2000):  # includes round-half-to-even cases, e.g. n=5 with "1,1"
        [prefix] = make_prefixes(tmp_path / str(n), 1, documents=n, max_length=2)
        n = len(IndexedDataset(prefix))
        theirs = megatron_build([prefix], [None] * 3, split, seq_length=2)
        for bookends, dataset in zip(split_matrix(split), theirs):
            assert (bookends is None) == (dataset is None)
            if bookends is not None:
                np.testing.assert_array_equal(np.arange(*split_range(n, bookends)), dataset.indices)


@pytest.mark.parametrize("split, sizes, seq_length", [
    ("969,30,1", (None, None, None), 16),  # one epoch per split; the test split is empty
    ("90,8,2", (3000, 200, 20), 16),  # several epochs; documents longer than a sample
    ("0.99, 0.01, 0.00", (500, 50, 0), 7),  # no test split at all
    ("1,1,2", (60, 60, 60), 1),  # one-token samples
    ("90,8,2", (100, 10, None), 200),  # samples longer than any document
])
def test_single_prefix(tmp_path, split, sizes, seq_length):
    [prefix] = make_prefixes(tmp_path, 1, documents=100 if seq_length == 1 else 400)
    theirs = megatron_build([prefix], sizes, split, seq_length)
    ours = build_gpt_datasets(prefix, seq_length=seq_length, split=split, sizes=sizes)
    for their_split, our_split in zip(theirs, ours):
        assert_same(their_split, our_split)


@pytest.mark.parametrize("epochs, separate", [(2.3, True), (2.95, False)])
def test_final_epoch_shuffled_apart_or_not(tmp_path, epochs, separate):
    [prefix] = make_prefixes(tmp_path, 1)
    one_epoch = len(megatron_build([prefix], [None] * 3, "1", 16)[0])
    sizes = (int(epochs * one_epoch), None, None)
    theirs = megatron_build([prefix], sizes, "1", 16)[0]
    ours = build_gpt_datasets(prefix, seq_length=16, split="1", sizes=sizes)[0]
    # a last epoch shuffled on its own is a permutation of the sequences at the end of the document index
    last_epoch = np.sort(theirs.document_index[-len(IndexedDataset(prefix)):])
    assert np.array_equal(last_epoch, np.arange(len(IndexedDataset(prefix)))) == separate
    assert_same(theirs, ours)


def test_without_extra_token(tmp_path):
    [prefix] = make_prefixes(tmp_path, 1, seed=1)
    sizes, split = (1000, 50, 10), "90,8,2"
    theirs = megatron_build([prefix], sizes, split, 16, add_extra_token=False)
    dataset = IndexedDataset(prefix)
    for i, (their_split, bookends) in enumerate(zip(theirs, split_matrix(split))):
        begin, end = split_range(len(dataset), bookends)
        ours = GPTDataset(dataset, begin, end, seq_length=16, num_samples=sizes[i], seed=1234, add_extra_token=False)
        assert_same_gpt_indices(their_split, ours)
        for k in range(len(their_split)):
            expected, actual = their_split[k], ours[k]
            np.testing.assert_array_equal(actual["tokens"], expected["tokens"].numpy())
            # megatron pads the last label and masks it out of the loss; ours is the ignore index -100
            counted = expected["loss_mask"].numpy() == 1
            np.testing.assert_array_equal(actual["labels"][counted], expected["labels"].numpy()[counted])
            assert list(actual["labels"][~counted]) == [-100]


@pytest.mark.parametrize("weights, sizes, split", [
    (["30", "70"], (1000, 100, 20), "90,8,2"),
    (["2", "1", "0.5"], (2000, 100, 0), "98,2,0"),
    (["1"], (500, 50, 5), "90,8,2"),  # one prefix with a weight still goes through a blend
])
def test_weighted_blends(tmp_path, weights, sizes, split):
    prefixes = make_prefixes(tmp_path, len(weights))
    blend = [x for pair in zip(weights, prefixes) for x in pair]
    theirs = megatron_build(blend, sizes, split, 16)
    ours = build_gpt_datasets(blend, seq_length=16, split=split, sizes=sizes)
    for their_split, our_split in zip(theirs, ours):
        assert_same(their_split, our_split)


@pytest.mark.parametrize("sizes", [(None, None, None), (700, 40, None), (10**6, 10, 3)])
def test_unweighted_glob(tmp_path, capfd, sizes):
    # NeMo AutoModel turns the glob into the sorted prefixes without weights: one epoch of each, in proportion
    prefixes = make_prefixes(tmp_path, 3)
    theirs = megatron_build(sorted(prefixes), sizes, "90,8,2", 16)
    ours = build_gpt_datasets(str(tmp_path / "part_*_text_document*"), seq_length=16, split="90,8,2", sizes=sizes)
    for their_split, our_split in zip(theirs, ours):
        assert_same(their_split, our_split)
    if sizes[0] == 10**6:  # an unweighted blend is at most one epoch of each prefix, as megatron-core's
        assert len(ours[0]) == len(theirs[0]) < sizes[0]

@pytest.mark.slow
def test_token_weighted_blend_trains_past_one_epoch(tmp_path, capfd):
    # megatron-core caps an unweighted list of prefixes at one epoch of each; a Megatron user wanting more weights
    # the prefixes, here by their token counts, and then gets as many samples as asked, from whole epochs of each
    prefixes = make_prefixes(tmp_path, 3)
    glob_of_prefixes = str(tmp_path / "part_*_text_document*")
    one_epoch = len(megatron_build(prefixes, (None, None, None), "90,8,2", 16)[0])
    sizes = (3 * one_epoch + 17, 100, 20)
    capped = megatron_build(prefixes, sizes, "90,8,2", 16)[0]
    assert len(capped) == one_epoch  # megatron's unweighted list: one epoch, not the size asked
    blend = token_weighted_blend(glob_of_prefixes)
    assert blend == [x for prefix in prefixes for x in (str(IndexedDataset(prefix).num_tokens), prefix)]
    theirs = megatron_build(blend, sizes, "90,8,2", 16)
    ours = build_gpt_datasets(blend, seq_length=16, split="90,8,2", sizes=sizes)
    assert len(ours[0]) >= sizes[0]
    for their_split, our_split in zip(theirs, ours):
        assert_same(their_split, our_split)
    with pytest.raises(ValueError, match="already weighted"):
        token_weighted_blend(blend)

@pytest.mark.slow
def test_blending_indices_at_scale():
    rng = np.random.default_rng(0)
    cases = [rng.random(d) for d in (2, 3, 7, 40)] + [np.ones(4)]  # equal weights: ties go to the first dataset
    cases.append(1 + 0.01 * rng.random(140))  # FineWeb-Edu 100BT's 140 files: enough rows for blocks side by side
    for weights in cases:
        weights = weights / weights.sum()
        size = 300_000 if len(weights) < 140 else 2_000_000
        dataset_index, dataset_sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
        megatron_helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size,
                                                False)
        ours = blending_indices(weights.tolist(), size)
        np.testing.assert_array_equal(ours[0], dataset_index)
        np.testing.assert_array_equal(ours[1], dataset_sample_index)
    for counts in ([120_000, 80_001], [5, 100_000, 3_000, 77_777], rng.integers(1, 20_000, 25)):
        counts = np.array(counts, dtype=np.int64)
        dataset_index, dataset_sample_index = np.zeros(counts.sum(), np.int16), np.zeros(counts.sum(), np.int64)
        megatron_helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, counts, len(counts))
        ours = blending_indices(counts.tolist())
        np.testing.assert_array_equal(ours[0], dataset_index)
        np.testing.assert_array_equal(ours[1], dataset_sample_index)


@pytest.mark.slow
@pytest.mark.parametrize("num_samples, add_extra_token", [(None, True), (1_200_000, True), (500_000, False)])
def test_gpt_indices_at_scale(tmp_path, num_samples, add_extra_token):
    class Lengths:  # all megatron's GPTDataset reads of its low-level dataset here
        path_prefix = str(tmp_path / "lengths")
        sequence_lengths = np.random.default_rng(1).integers(0, 3000, 400_000).astype(np.int32)

    begin, end = 1000, 390_000
    config = megatron_config(1024, seed=77, add_extra_token=add_extra_token, path_to_cache=str(tmp_path / "cache"),
                             blend=get_blend_from_list([Lengths.path_prefix]), split="1")
    theirs = MegatronGPTDataset(Lengths, Lengths.path_prefix, np.arange(begin, end, dtype=np.int32), num_samples,
                                Split.train, config)
    ours = gpt_indices(Lengths.sequence_lengths, begin, end, seq_length=1024, num_samples=num_samples, seed=77,
                       add_extra_token=add_extra_token)
    for name in ("document_index", "sample_index", "shuffle_index"):
        expected, actual = getattr(theirs, name), ours[name]
        assert actual.dtype == expected.dtype, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)

@pytest.mark.slow
def test_split_without_tokens_raises_where_megatron_hangs(tmp_path):
    [prefix] = make_prefixes(tmp_path, 1)  # about 430 sequences: "969,30,1" leaves the test split empty
    script = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_indexed_dataset import megatron_build
        print("building", flush=True)
        megatron_build([{prefix!r}], [100, 10, 10], "969,30,1", 16)
        print("returned", flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "building\n"
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=3)
    finally:
        process.kill()
        process.wait()
    with pytest.raises(ValueError, match=r"part_0_text_document: its test split .*\[(\d+), \1\)\) has no tokens, "
                                         r"but 10 samples were asked"):
        build_gpt_datasets(prefix, seq_length=16, split="969,30,1", sizes=(100, 10, 10))
    assert build_gpt_datasets(prefix, seq_length=16, split="969,30,1", sizes=(100, 10, None))[2] is None
    blend = ["1", prefix, "1", make_prefixes(tmp_path / "more", 1, documents=3000, seed=5)[0]]
    with pytest.raises(ValueError, match=r"part_0_text_document: its test split"):
        build_gpt_datasets(blend, seq_length=16, split="969,30,1", sizes=(100, 10, 10))
    with pytest.raises(ValueError, match=r"part_0_text_document: its test split .* to take part in the blend"):
        build_gpt_datasets([prefix, blend[3]], seq_length=16, split="969,30,1", sizes=(100, 10, 10))


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


def damage_cache_entry(cache, damage):
    """Damage the train split's cache entry as a crash, a full disk or a stray tool might."""
    [sample_index] = glob.glob(os.path.join(cache, "*-GPTDataset-train-sample_index.npy"))
    base = sample_index[:-len("-sample_index.npy")]
    description = json.load(open(base + ".json"))
    if damage == "truncate":
        corrupt(base, "-sample_index.npy", size=os.path.getsize(sample_index) // 2)
    elif damage == "key":
        description["key"]["seed"] += 1
    elif damage == "missing":
        os.remove(sample_index)
    elif damage == "short shuffle_index":  # a whole .npy of the wrong length
        np.save(base + "-shuffle_index.npy", np.arange(10, dtype=np.uint32))
    elif damage == "zeroed payload":  # the .npy header intact, the values gone
        header = len(open(sample_index, "rb").read()) - np.load(sample_index).nbytes
        corrupt(base, "-sample_index.npy", offset=header, data=bytes(np.load(sample_index).nbytes))
    elif damage == "two of three arrays":
        del description["arrays"]["document_index"]
    elif damage == "not json":
        corrupt(base, ".json", size=10)
    if damage in ("key", "two of three arrays"):
        json.dump(description, open(base + ".json", "w"))


@pytest.mark.parametrize("damage", ["truncate", "key", "missing", "short shuffle_index", "zeroed payload",
                                    "two of three arrays", "not json"])
def test_damaged_cache_is_rebuilt(dataset, tmp_path, capfd, damage):
    """Whatever is wrong with an entry, the run rebuilds it with one log line: never a traceback, never wrong
    samples (docs/data.md promises it)."""
    cache = str(tmp_path / "cache")
    expected = build(dataset, None)
    build(dataset, cache)
    capfd.readouterr()
    damage_cache_entry(cache, damage)
    rebuilt = build(dataset, cache)
    err = capfd.readouterr().err
    assert err.count("ignoring the cached indices") == 1 and err.count("built in") == 1, err
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
    corrupt(dataset, ".idx", offset=pointers_at + 5 * 8, data=struct.pack("<q", 3))  # other bytes: checked again
    with pytest.raises(ValueError, match=r"\.idx: corrupt: sequence 5 starts at byte 3 of the \.bin"):
        build(dataset, cache)
    assert len(checks) == 2


def test_cache_is_rebuilt_when_the_data_changes(tmp_path, capfd):
    prefix, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    write_ours(prefix, random_documents(np.random.default_rng(5), 300))
    build(prefix, cache)
    write_ours(prefix, random_documents(np.random.default_rng(5), 300))  # the same data written again: still cached
    capfd.readouterr()
    build(prefix, cache)
    assert "built in" not in capfd.readouterr().err
    write_ours(prefix, random_documents(np.random.default_rng(6), 300))  # new data under the same name
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


CACHE_WRITE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
from indexed_dataset import build_gpt_datasets
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
build_gpt_datasets(sys.argv[1], seq_length=16, split="90,8,2", sizes=(2000, 100, 30), cache_dir=sys.argv[2])
"""


def test_a_failed_cache_write_is_one_line_naming_the_file(dataset, tmp_path):
    cache = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", CACHE_WRITE_UNDER_A_SIZE_LIMIT, dataset, cache], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and re.fullmatch(rf"atomic_io\.WriteError: cannot write {re.escape(cache)}/\w+-"
                                                   r"GPTDataset-train-\w+\.npy: .+", last), result.stderr
    assert not [name for name in os.listdir(cache) if name.endswith(".tmp")]
    assert all(same_samples(a, b) for a, b in zip(build(dataset, None), build(dataset, cache)))  # the cache recovers
    open(tmp_path / "file", "w").close()
    with pytest.raises(NotADirectoryError) as raised:  # the trainer prints "<filename>: <strerror>"
        build(dataset, str(tmp_path / "file" / "cache"))
    assert raised.value.filename == str(tmp_path / "file" / "cache")


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
    assert len(sequential_samples(prefixes, seq_length=10**6, split="70,30")) == 0  # the trainer refuses it
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
                                         rf"than the {too_many + 1} that {too_many // T} windows need"):
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
        PretrainingSampler(total, total + 1, mbs, 0, 1)


def test_sampler_drives_a_dataloader(dataset):
    import torch

    train, _, _ = build_gpt_datasets(dataset, seq_length=16, split="1", sizes=(64, None, None))
    loader = torch.utils.data.DataLoader(train, batch_sampler=PretrainingSampler(len(train), 8, 4, 1, 2))
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, 16) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"][0], torch.from_numpy(train[12]["tokens"]))


# ----------------------------------------------------------------------------------------------------------------------
# Naming the source of a sample, data changed under a run, fingerprints


def labelled_documents(rng, count, label=0):
    """Documents whose every token is `label` + the document's number: a sample's tokens name their documents."""
    documents = []
    for d, (tokens, lengths) in enumerate(random_documents(rng, count)):
        documents.append((np.full(len(tokens), label + d), lengths))
    return documents


def named_documents(description, prefix):
    """The document numbers a describe() string gives for `prefix`."""
    match = re.search(rf"{re.escape(prefix)}: documents ([\d, ]+)", description)
    return {int(d) for d in match.group(1).split(", ")}


def test_describe_names_the_documents_of_a_sample(tmp_path):
    rng = np.random.default_rng(20)
    a = write_ours(str(tmp_path / "a_text_document"), labelled_documents(rng, 300))
    b = write_ours(str(tmp_path / "b_text_document"), labelled_documents(rng, 200, label=10_000))
    train = build_gpt_datasets(a, seq_length=24, split="1", sizes=(600, None, None))[0]  # 2+ epochs
    for i in range(len(train)):
        description, text = train.describe(i), np.concatenate([train[i]["tokens"], train[i]["labels"]])
        assert description.endswith(f"(sample {i})") and named_documents(description, a) == set(text.tolist())
    blend = build_gpt_datasets(["1", a, "3", b], seq_length=24, split="1", sizes=(300, 0, 0))[0]
    for i in range(len(blend)):
        description, text = blend.describe(i), np.concatenate([blend[i]["tokens"], blend[i]["labels"]])
        prefix, label = (a, 0) if blend.dataset_index[i] == 0 else (b, 10_000)
        assert re.fullmatch(rf"{re.escape(prefix)}: documents [\d, ]+ \(sample {blend.dataset_sample_index[i]}\), "
                            rf"blend sample {i}", description)
        assert {d + label for d in named_documents(description, prefix)} == set(text.tolist())
    windows = sequential_samples([a, b], seq_length=24, split="1", split_index=0)
    for k in range(len(windows)):
        description, text = windows.describe(k), set(windows[k]["tokens"].tolist() + windows[k]["labels"].tolist())
        named = {d for d in text if d < 10_000}, {d - 10_000 for d in text if d >= 10_000}
        for prefix, documents in zip((a, b), named):
            assert (named_documents(description, prefix) if documents else set()) == documents
        assert description.endswith(f"(window {k})")
    windows = LLMCValWindows(a, 24, num_tokens=240)
    assert named_documents(windows.describe(0), a) == set(windows[0]["labels"].tolist())  # tokens[0] is the EOT


def overwrite_in_place(prefix, other):
    """Rewrite prefix's files with other's bytes, as `cp other.* prefix.*` does: the same inodes, new contents."""
    for suffix in (".bin", ".idx"):
        data = open(other + suffix, "rb").read()
        with open(prefix + suffix, "r+b") as f:
            f.write(data)
            f.truncate()


def test_data_overwritten_in_place_is_named(tmp_path):
    rng = np.random.default_rng(21)
    documents = random_documents(rng, 300)
    prefix = write_ours(str(tmp_path / "d_text_document"), documents)
    # the same documents twice as long: the same index size, a longer .bin (a shorter one would fault on reading)
    other = write_ours(str(tmp_path / "other"), [(np.tile(t, 2), [2 * n for n in lengths]) for t, lengths in documents])
    train = build_gpt_datasets(prefix, seq_length=16, split="1", sizes=(200, None, None))[0]
    windows = sequential_samples(prefix, seq_length=16, split="1", split_index=0)
    overwrite_in_place(prefix, other)
    with pytest.raises(ValueError, match=rf"{re.escape(prefix)}: changed on disk since it was opened \(sample \d+ "
                                         rf"has \d+ tokens, not 17\)"):
        for i in range(len(train)):
            train[i]
    with pytest.raises(ValueError, match=rf"{re.escape(prefix)}: changed on disk since it was opened \(window \d+ "
                                         rf"has \d+ tokens, not 17\)"):
        for k in range(len(windows)):
            windows[k]


def data_fingerprints(paths):
    """{prefix: fingerprint} of the train split's files, as a resume reads them."""
    train = build_gpt_datasets(paths, seq_length=16, split="1", sizes=(10, None, None))[0]
    return {part.dataset.path_prefix: part.dataset.fingerprint for part in getattr(train, "datasets", [train])}


def test_data_fingerprints_change_with_the_data_only(tmp_path):
    rng = np.random.default_rng(22)
    documents = random_documents(rng, 100)
    prefixes = [write_ours(str(tmp_path / f"p{i}_text_document"), documents) for i in range(2)]
    fingerprints = data_fingerprints(str(tmp_path / "p*_text_document"))
    assert list(fingerprints) == prefixes and len(set(fingerprints.values())) == 1  # the same data, the same print
    assert json.loads(json.dumps(fingerprints)) == fingerprints
    assert data_fingerprints(["1", prefixes[0], "2", prefixes[1]]) == fingerprints
    write_ours(prefixes[0], documents)  # rewritten alike: a new mtime, the same data
    assert data_fingerprints(prefixes) == fingerprints
    write_ours(prefixes[0], random_documents(rng, 100))  # other data at the same path
    changed = data_fingerprints(prefixes)
    assert changed[prefixes[0]] != fingerprints[prefixes[0]] and changed[prefixes[1]] == fingerprints[prefixes[1]]


def test_each_index_built_is_one_log_line(tmp_path, capfd):
    rng = np.random.default_rng(23)
    a = write_ours(str(tmp_path / "a"), random_documents(rng, 200))
    b = write_ours(str(tmp_path / "b"), random_documents(rng, 300))
    capfd.readouterr()
    train = build_gpt_datasets(["1", a, "3", b], seq_length=16, split="1", sizes=(500, 0, 0))[0]
    lines = capfd.readouterr().err.splitlines()
    lines = sorted(re.sub(r"built in [\d.]+s", "built in Xs", line) for line in lines)
    sizes = [len(part) for part in train.datasets]
    assert lines == [f"indexed_dataset: {a}: train indices of {sizes[0]:,} samples, built in Xs",
                     f"indexed_dataset: {b}: train indices of {sizes[1]:,} samples, built in Xs",
                     "indexed_dataset: train blend of 500 samples from 2 datasets, built in Xs"]


# ----------------------------------------------------------------------------------------------------------------------
# The command line


def cli(capsys, *args):
    """(exit status, stdout, stderr) of `python indexed_dataset.py ARGS`, run in this process."""
    status = indexed_dataset.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_info_and_verify(tmp_path, capsys):
    rng = np.random.default_rng(9)
    documents = random_documents(rng, 50, vocab=500)
    prefixes = [write_ours(str(tmp_path / f"d{i}_text_document"), documents) for i in range(2)]
    tokens = sum(len(t) for t, _ in documents)
    sequences = sum(len(lengths) for _, lengths in documents)
    status, out, err = cli(capsys, "info", str(tmp_path / "d*_text_document*"))
    assert status == 0, err
    assert f"{prefixes[0]}: 50 documents, {sequences} sequences, {tokens:,} tokens (uint16)" in out
    expanded = subprocess.run([sys.executable, os.path.join(ROOT, "indexed_dataset.py"), "info",
                               *sorted(glob.glob(str(tmp_path / "d*_text_document*")))],  # an unquoted glob
                              capture_output=True, text=True, timeout=120)
    assert expanded.returncode == 0 and expanded.stdout == out

    status, out, err = cli(capsys, "verify", str(tmp_path / "d*_text_document*"), "--vocab-size", "500")
    assert status == 0 and out.strip().endswith("OK"), out + err
    status, out, err = cli(capsys, "verify", prefixes[0], "--vocab-size", "100")
    assert status == 1 and "outside [0, 100)" in err

    corrupt(prefixes[1], ".bin", append=b"\0\0")
    status, out, err = cli(capsys, "verify", prefixes[1])
    assert status == 1
    assert f"{prefixes[1]}.bin: {2 * tokens + 2} bytes, not the {2 * tokens} bytes its " in err

    status, out, err = cli(capsys, "info", str(tmp_path / "missing"))
    assert status == 1 and "missing.idx: no such file" in err


def test_verify_reads_every_token(tmp_path):
    prefix = write_ours(str(tmp_path / "d_text_document"), [([1, 2, 3], [3])])
    with open(prefix + ".bin", "r+b") as f:  # bit rot: the same size, the index still fits
        f.seek(2)
        f.write(struct.pack("<H", 999))
    assert indexed_dataset.verify([prefix], vocab_size=100) == [
        f"{prefix}.bin: token ids span [1, 999], outside [0, 100)"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # megatron-core's __del__
def test_verify_fails_on_empty_files(tmp_path, capsys):
    no_documents = write_ours(str(tmp_path / "none_text_document"), [])
    empty_documents = write_ours(str(tmp_path / "blank_text_document"), [([], []), ([], [0])])
    no_index = write_ours(str(tmp_path / "noidx_text_document"), [([1, 2], [2])])
    open(no_index + ".idx", "wb").close()
    for prefix in (no_documents, empty_documents):  # 0-byte .bin files, which megatron-core cannot map
        assert os.path.getsize(prefix + ".bin") == 0
        with pytest.raises(ValueError, match="cannot mmap an empty file"):
            MegatronIndexedDataset(prefix)
    status, out, err = cli(capsys, "verify", str(tmp_path / "*_text_document"))
    assert status == 1 and out.strip().endswith("3 problem(s)"), out + err
    assert err.splitlines() == [
        f"problem: {empty_documents}.bin: no tokens (2 documents): megatron cannot map it",
        f"problem: {no_index}.idx: truncated: 0 bytes, less than the 34-byte header",
        f"problem: {no_documents}.bin: no tokens (0 documents): megatron cannot map it"]


def test_indexed_dataset_imports_without_torch():
    code = "import sys, indexed_dataset; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


# ----------------------------------------------------------------------------------------------------------------------
# What a resume compares, and a warm start


def test_plans_of_other_sizes_share_their_first_samples_exactly_when_their_orders_agree(tmp_path):
    prefixes = make_prefixes(tmp_path, 2)
    glob_of_prefixes = str(tmp_path / "part_*_text_document*")
    epoch = one_epoch_samples(glob_of_prefixes, seq_length=16, split="90,8,2")
    assert epoch == len(build_gpt_datasets(glob_of_prefixes, seq_length=16, split="90,8,2")[0])
    blend = token_weighted_blend(glob_of_prefixes)
    plans = {(paths, size): build_gpt_datasets(paths, seq_length=16, split="90,8,2", sizes=(size, 0, 0))[0]
             for paths, size in [(glob_of_prefixes, 80), (glob_of_prefixes, 112), (tuple(blend), 5 * epoch // 2),
                                 (tuple(blend), 5 * epoch // 2 + 20), (tuple(blend), 9 * epoch), (prefixes[0], 100),
                                 (prefixes[0], 4000)]}
    consumed = 80
    for (a_paths, a_size), a in plans.items():
        for (_, b_size), b in plans.items():
            same_order = a.order == b.order
            agree = first_samples_agree(a, b, consumed)
            assert agree == same_order, (a_paths, a_size, b_size)
            first = [(a[i]["tokens"].tolist(), b[i]["tokens"].tolist()) for i in range(consumed)]
            assert agree == all(x == y for x, y in first)
    # a size only cuts the plan short, epochs and blend weights change it
    assert plans[glob_of_prefixes, 80].order == plans[glob_of_prefixes, 112].order
    assert plans[tuple(blend), 5 * epoch // 2].order == plans[tuple(blend), 5 * epoch // 2 + 20].order
    assert plans[tuple(blend), 5 * epoch // 2].order != plans[tuple(blend), 9 * epoch].order


def test_a_warm_start_hashes_no_index(tmp_path, monkeypatch, capfd):
    prefixes = make_prefixes(tmp_path, 2)
    cache = str(tmp_path / "cache")
    first = build(prefixes, cache, sizes=(1000, 50, 10))
    hashed = []
    real_file_sha256 = indexed_dataset.file_sha256
    monkeypatch.setattr(indexed_dataset, "file_sha256", lambda path: hashed.append(path) or real_file_sha256(path))
    capfd.readouterr()
    second = build(prefixes, cache, sizes=(1000, 50, 10))
    assert hashed == [] and capfd.readouterr().err == ""
    assert all(same_samples(a, b) for a, b in zip(first, second, strict=True))
    assert [p.dataset.fingerprint for p in second[0].datasets] == [p.dataset.fingerprint for p in first[0].datasets]
    corrupt(prefixes[1], ".idx", offset=index_layout(prefixes[1])[3] + 5 * 8, data=struct.pack("<q", 3))
    with pytest.raises(ValueError, match=r"\.idx: corrupt: sequence 5 starts at byte 3"):  # a new version: checked
        build(prefixes, cache, sizes=(1000, 50, 10))


def test_prefixes_holding_the_same_data_share_one_cache_entry(tmp_path):
    documents = random_documents(np.random.default_rng(30), 300)
    prefixes = [write_ours(str(tmp_path / f"copy_{i}_text_document"), documents) for i in range(2)]
    cache = str(tmp_path / "cache")
    built, loaded = build(prefixes, cache), build(prefixes, cache)  # one entry, written once, read by both
    assert all(same_samples(a, b) for a, b in zip(built, loaded, strict=True))
    assert all(same_samples(a, b) for a, b in zip(built, build(prefixes, None), strict=True))
    assert len(glob.glob(os.path.join(cache, "*-GPTDataset-train.json"))) == 1


# ----------------------------------------------------------------------------------------------------------------------
# Faults: a .bin cut short while read, writers in other containers, killed writers, a full disk


def test_a_bin_cut_short_while_the_run_reads_it_is_an_error_naming_it(tmp_path):
    prefix = write_ours(str(tmp_path / "d_text_document"), random_documents(np.random.default_rng(40), 300))
    train = build_gpt_datasets(prefix, seq_length=16, split="1", sizes=(200, None, None))[0]
    windows = sequential_samples(prefix, seq_length=16, split="1", split_index=0)
    train[0], windows[0]
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", 100)  # in place, as `truncate` or `cp new.bin old.bin` do; unread, it is SIGBUS
    error = rf"{re.escape(prefix)}\.bin: shrank from {size} to 100 bytes while the run read it"
    with pytest.raises(ValueError, match=error):
        for i in range(len(train)):
            train[i]
    with pytest.raises(ValueError, match=error):
        windows[len(windows) - 1]


TWO_CONTAINERS = """
import sys
sys.path.insert(0, sys.argv[1])
from indexed_dataset import build_gpt_datasets
assert __import__("os").getpid() == 1  # as in a container: both writers have pid 1
for seed in range(4):
    build_gpt_datasets(sys.argv[2], seq_length=16, split="90,8,2", sizes=(20000, 1000, 300), seed=seed,
                       cache_dir=sys.argv[3])
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_two_runs_in_their_own_pid_namespaces_share_a_cold_cache(tmp_path):
    prefix = write_ours(str(tmp_path / "d_text_document"), random_documents(np.random.default_rng(41), 3000))
    cache = str(tmp_path / "cache")
    command = ["unshare", "--pid", "--fork", sys.executable, "-c", TWO_CONTAINERS, ROOT, prefix, cache]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0 and out.strip() == "ok", err[-3000:]
    assert not [name for name in os.listdir(cache) if name.endswith(".tmp")]
    for seed in range(4):
        built = build_gpt_datasets(prefix, seq_length=16, split="90,8,2", sizes=(20000, 1000, 300), seed=seed)
        cached = build_gpt_datasets(prefix, seq_length=16, split="90,8,2", sizes=(20000, 1000, 300), seed=seed,
                                    cache_dir=cache)
        assert isinstance(cached[0].sample_index, np.memmap) and same_samples(built[1], cached[1])
        assert np.array_equal(built[0].shuffle_index, cached[0].shuffle_index)


KILLED_WRITER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from atomic_io import atomic_write
with atomic_write(sys.argv[2]) as f:
    f.write(bytes(1 << 20))
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


def test_temporaries_of_a_killed_writer_are_removed_at_the_next_build(dataset, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", KILLED_WRITER, ROOT, str(cache / f"{name}.npy")],
                                stdout=subprocess.PIPE, text=True) for name in ("killed", "alive")]
    try:
        for writer in writers:
            assert writer.stdout.readline() == "writing\n"
        writers[0].kill()  # kill -9 while the cache is written
        writers[0].wait()
        assert len([name for name in os.listdir(cache) if name.endswith(".tmp")]) == 2
        build(dataset, str(cache))
        left = [name for name in os.listdir(cache) if name.endswith(".tmp")]
        assert len(left) == 1 and left[0].startswith(".alive.npy."), left  # a live writer's stays
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_full_disk_while_the_cache_is_written_names_the_file_and_says_so(dataset, tmp_path):
    cache = tmp_path / "small"
    cache.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(cache)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(OSError) as raised:
            build(dataset, str(cache), sizes=(40000, 100, 30))
        assert raised.value.errno == errno.ENOSPC and raised.value.filename.startswith(str(cache))
        assert re.fullmatch(rf"cannot write {re.escape(str(cache))}/\w+-GPTDataset-train-\w+\.npy: No space left on "
                            r"device", str(raised.value))
        assert not [name for name in os.listdir(cache) if name.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(cache)], check=True)
