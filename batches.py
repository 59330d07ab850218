"""Each step's micro-batches on the host: read from the dataset, their token ids checked, pinned
for the copy to the GPU, by a thread that reads ahead of the step, so that the step never waits
for the data. train_gpt2.py's loop takes them from the queue prefetch() returns."""
import contextlib
import queue
import threading

import numpy as np
import torch


def host_batch(dataset, indices, vocab_size, pin):
    """Samples `indices` as (tokens, labels) on the host. An id outside the vocabulary is named
    here, before the GPU would stop on a device-side assert."""
    samples = [dataset[i] for i in indices]
    tokens = np.stack([s["tokens"] for s in samples])
    labels = np.stack([s["labels"] for s in samples])
    # Ids below 0 come from signed (int32) datasets and would index the embedding from its end.
    top = np.maximum(tokens.max(axis=1), labels.max(axis=1))
    bottom = np.minimum(tokens.min(axis=1), labels.min(axis=1))
    for ids, row in ((top, int(top.argmax())), (bottom, int(bottom.argmin()))):
        if not 0 <= ids[row] < vocab_size:
            raise ValueError(f"token id {ids[row]} in {dataset.describe(indices[row])} is outside "
                             f"the model's vocabulary (vocab_size {vocab_size})")
    tokens, labels = torch.from_numpy(tokens), torch.from_numpy(labels)
    if pin:  # so that the copy to the GPU does not wait
        return tokens.pin_memory(), labels.pin_memory()
    return tokens, labels


def prefetch(dataset, sampler, grad_accum_steps, vocab_size, pin, stop, depth=2):
    """A queue of each step's host micro-batches, read ahead by a thread started now. A failure
    (a token id outside the vocabulary, a data file cut short) is queued in place of the batches
    and also given to `stop`, so that every rank stops at the same step and saves it."""
    ready = queue.Queue(maxsize=depth)

    def produce():
        try:
            while not stop.ended:
                batches = [host_batch(dataset, next(sampler), vocab_size, pin)
                           for _ in range(grad_accum_steps)]
                # A run that ended (an error in a notebook, say) leaves no thread blocked here.
                while not stop.ended:
                    with contextlib.suppress(queue.Full):
                        ready.put(batches, timeout=1)
                        break
        except StopIteration:
            return  # every step's samples were read
        except BaseException as e:
            stop.error = e
            ready.put(e)

    threading.Thread(target=produce, name="prefetch", daemon=True).start()
    return ready
