"""batches.py: each step's micro-batches read ahead on the host, their token ids checked before a GPU would stop on a
device-side assert, and a failure handed to the step in place of its batches."""
import types

import numpy as np
import pytest
import torch

from batches import host_batch, prefetch


class Samples:
    """A dataset of `count` samples of 4 tokens, sample i holding ids i..i+4 (one of them `bad` in sample 2)."""

    def __init__(self, count, bad=None):
        self.count, self.bad = count, bad

    def __getitem__(self, i):
        text = np.arange(i, i + 5, dtype=np.int64)
        if i == 2 and self.bad is not None:
            text[3] = self.bad
        return {"tokens": text[:-1], "labels": text[1:]}

    def describe(self, i):
        return f"samples.bin: sample {i}"


def test_a_batch_is_its_samples_stacked_and_an_id_outside_the_vocabulary_names_its_sample():
    tokens, labels = host_batch(Samples(4), [0, 3], vocab_size=100, pin=False)
    assert torch.equal(tokens, torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]]))
    assert torch.equal(labels, torch.tensor([[1, 2, 3, 4], [4, 5, 6, 7]]))
    for bad in (100, -3):  # past the vocabulary, or a signed dataset's negative id
        with pytest.raises(ValueError, match=rf"token id {bad} in samples\.bin: sample 2 is outside the model's "
                                             r"vocabulary \(vocab_size 100\)"):
            host_batch(Samples(4, bad=bad), [1, 2], vocab_size=100, pin=False)


def test_the_reading_thread_queues_each_steps_micro_batches_then_a_failure_in_their_place():
    stop = types.SimpleNamespace(ended=False, error=None)
    sampler = iter([[0], [1], [2], [3]])
    ready = prefetch(Samples(4, bad=999), sampler, grad_accum_steps=2, vocab_size=100, pin=False, stop=stop)
    first = ready.get(timeout=30)
    assert [tokens.tolist() for tokens, _ in first] == [[[0, 1, 2, 3]], [[1, 2, 3, 4]]]
    failure = ready.get(timeout=30)  # sample 2 holds id 999: the step gets the error, and so does the stop
    assert isinstance(failure, ValueError) and stop.error is failure
    stop.ended = True
