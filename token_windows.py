"""In-order windows of a token stream, the validation views of indexed_dataset.py (llm.c's, and one split's).

Unlike GPT samples they are neither shuffled nor repeated: window k is simply the k-th slice of the stream."""
import numpy as np


class TokenWindows:
    """Windows of a token stream in order: window k is stream[k*T : k*T + T + 1], returned as {"tokens": its first T,
    "labels": its last T} (int64), so consecutive windows share one token, as llm.c's loader reads.

    pieces: [(dataset, sequence ids), ...] that make the stream, in order; a dataset needs only sequence_lengths and
    get(i, offset, length)."""

    def __init__(self, pieces, seq_length, length):
        self.pieces, self.seq_length, self.length = pieces, seq_length, length
        self.piece_starts = []  # token offsets in the stream of each piece's sequences, plus its end
        total = 0
        for dataset, sequences in pieces:
            starts = np.empty(len(sequences) + 1, dtype=np.int64)
            starts[0] = total
            np.cumsum(dataset.sequence_lengths[sequences], dtype=np.int64, out=starts[1:])
            starts[1:] += total
            total = int(starts[-1])
            self.piece_starts.append(starts)
        self.num_tokens = total

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        start, stop = i * self.seq_length, i * self.seq_length + self.seq_length + 1
        parts = []
        for (dataset, sequences), starts in zip(self.pieces, self.piece_starts):
            if starts[-1] <= start or starts[0] >= stop:
                continue
            first = max(np.searchsorted(starts, start, side="right") - 1, 0)
            last = min(np.searchsorted(starts, stop, side="left"), len(sequences))
            for k in range(first, last):
                begin = max(start - starts[k], 0)
                parts.append(dataset.get(sequences[k], begin, min(stop, starts[k + 1]) - starts[k] - begin))
        text = np.concatenate(parts).astype(np.int64)
        return {"tokens": text[:-1], "labels": text[1:]}


class Tokens:
    """A few tokens posing as a one-sequence dataset, to lead a TokenWindows stream."""

    def __init__(self, tokens):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.sequence_lengths = np.array([len(self.tokens)], dtype=np.int64)

    def get(self, i, offset=0, length=None):
        return self.tokens[offset:None if length is None else offset + length]
