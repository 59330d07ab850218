"""GPT sampling and blending against megatron-core 0.16.1: the same index arrays, the same samples, the same order."""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from conftest import ROOT
from indexed_dataset import (BlendedDataset, GPTDataset, IndexedDataset, blending_indices, build_gpt_datasets,
                             gpt_indices, split_matrix, split_range, token_weighted_blend)
from conftest import random_documents, write_ours

with warnings.catch_warnings():  # megatron-core warns at import that Transformer Engine and Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers as megatron_helpers
    from megatron.core.datasets.blended_dataset import BlendedDataset as MegatronBlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split, get_blend_from_list


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
    capped = f"train: an unweighted blend is one epoch of each prefix, {len(ours[0])} samples, fewer than the 1000000"
    assert (capped in capfd.readouterr().err) == (sizes[0] == 10**6)


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


def test_blending_indices_at_scale():
    rng = np.random.default_rng(0)
    cases = [rng.random(d) for d in (2, 3, 7, 40)] + [np.ones(4)]  # equal weights: ties go to the first dataset
    for weights in cases:
        weights = weights / weights.sum()
        size = 300_000
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
    for name, actual in zip(("document_index", "sample_index", "shuffle_index"), ours):
        expected = getattr(theirs, name)
        assert actual.dtype == expected.dtype, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)


def test_split_without_tokens_raises_where_megatron_hangs(tmp_path):
    [prefix] = make_prefixes(tmp_path, 1)  # about 430 sequences: "969,30,1" leaves the test split empty
    script = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_indexed_megatron import megatron_build
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
    with pytest.raises(ValueError, match=r"part_0_text_document: its test split .* so it cannot take part"):
        build_gpt_datasets([prefix, blend[3]], seq_length=16, split="969,30,1", sizes=(100, 10, 10))
