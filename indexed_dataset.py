"""Megatron-Core indexed datasets and GPT sampling in plain numpy: the same .bin/.idx bytes, and the same samples in
the same order, as megatron-core 0.16.1's IndexedDataset, GPTDataset and BlendedDataset (tests/ compare them).

The .idx file (little-endian, packed):
    magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count S u64 | document count D u64
    | sequence lengths i32[S] | byte offset of each sequence in .bin i64[S] | document boundaries i64[D]
and the .bin file is the tokens themselves (D counts a leading 0). GPTDataset follows megatron-core's gpt_dataset.py.

    python indexed_dataset.py info   'data/processed_data_*_text_document'    # documents, sequences, tokens, dtype
    python indexed_dataset.py verify 'data/processed_data_*_text_document' --vocab-size 50257   # read every token
"""
import argparse
import glob
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from array import array

import numpy as np
from tqdm import tqdm

from atomic_io import atomic_write

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
DTYPE_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
SPLITS = ("train", "valid", "test")
EOT = 50256  # GPT-2's <|endoftext|>, which ends every document of prepare_fineweb.py's files
TOKENS_PER_STEP = 1 << 26  # tokens per step of the token-range pass: bounds its memory
CACHE_FORMAT = 2  # bump when the cached arrays or their key change meaning (2: keyed by the .idx's size and mtime)
# blending_indices works in chunks of CHUNK steps, each started WARM_UP steps early from a guess; one numpy operation
# handles at most SIDE_BY_SIDE_CELLS datasets x chunks, which keeps its arrays in the CPU cache
CHUNK, WARM_UP, SIDE_BY_SIDE_CELLS = 512, 64, 1 << 17


def _check_seq_length(seq_length):
    if not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")


def _wrap(i, length):
    """Sample i of `length` as a non-negative index, negative i counting from the end."""
    if not -length <= i < length:
        raise IndexError(f"sample {i} out of range for {length} samples")
    return i % length


def distributed():
    """(rank, world size) of the initialized torch.distributed group, else (0, 1); never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def log(message):
    if distributed()[0] == 0:
        print(f"indexed_dataset: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------------
# The .bin/.idx files


class IndexedDataset:
    """Memory-mapped reader of `<path_prefix>.bin` + `<path_prefix>.idx`; `ds[i]` is sequence i's tokens.

    Opening checks the header against the file sizes and, with `check`, the whole index (see `check()`), so a damaged
    or mismatched pair fails here, naming the file. `ds[i]` are read-only views into the memory map."""

    def __init__(self, path_prefix, check=True):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                hint = " (give the prefix, without .bin/.idx)" if self.path_prefix.endswith((".bin", ".idx")) else ""
                raise FileNotFoundError(f"{path}: no such file{hint}")
        self.idx_stat, self.bin_stat = os.stat(idx_path), os.stat(bin_path)  # they key the index cache
        code, count, num_boundaries = _read_header(idx_path, self.idx_stat.st_size)
        self.dtype = np.dtype(DTYPES[code])
        self._index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(self._index, "<i4", count, HEADER.size)
        self.sequence_pointers = np.frombuffer(self._index, "<i8", count, HEADER.size + 4 * count)
        self.document_indices = np.frombuffer(self._index, "<i8", num_boundaries, HEADER.size + 12 * count)
        if self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(f"{idx_path}: corrupt: document boundaries run from {self.document_indices[0]} to "
                             f"{self.document_indices[-1]}, not from 0 to the sequence count {count}")
        if check:
            self.check()
        else:  # the .bin's size from the last sequence alone (0 without one)
            last = count and int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            self._check_bin_size(last)
        # every token of the .bin in file order; numpy cannot map an empty file, which has no tokens to map anyway
        size = self.bin_stat.st_size
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if size else np.empty(0, self.dtype)

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, i, offset=0, length=None):
        """`length` tokens (default: to the end) of sequence i, starting `offset` tokens into it."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range: {self.path_prefix} has {len(self)} sequences")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + int(offset)
        length = int(self.sequence_lengths[i]) - int(offset) if length is None else int(length)
        return self.tokens[start:start + length]

    __getitem__ = get

    @property
    def num_documents(self):
        return len(self.document_indices) - 1

    @property
    def num_tokens(self):
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def check(self):
        """Raise ValueError naming the file unless boundaries never decrease, lengths are >= 0, each pointer is the sum
        of the lengths before it and the .bin holds exactly every sequence."""
        idx_path = self.path_prefix + ".idx"
        if (np.diff(self.document_indices) < 0).any():
            raise ValueError(f"{idx_path}: corrupt: document boundaries decrease")
        sizes = self.sequence_lengths.astype(np.int64)
        if sizes.size and sizes.min() < 0:
            raise ValueError(f"{idx_path}: corrupt: sequence {int(np.argmin(sizes))} has a negative length "
                             f"{sizes.min()}")
        sizes *= self.dtype.itemsize
        starts = np.cumsum(sizes) - sizes
        bad = np.flatnonzero(self.sequence_pointers != starts)
        if bad.size:
            k = int(bad[0])
            raise ValueError(f"{idx_path}: corrupt: sequence {k} starts at byte {self.sequence_pointers[k]} of the "
                             f".bin, but the lengths before it put it at byte {starts[k]} ({self.dtype} tokens): a "
                             f"wrong dtype code or damaged pointers")
        self._check_bin_size(int(sizes.sum()))

    def _check_bin_size(self, expected):
        bin_path, idx_path, size = self.path_prefix + ".bin", self.path_prefix + ".idx", self.bin_stat.st_size
        if size % self.dtype.itemsize:
            raise ValueError(f"{bin_path}: {size} bytes is not a whole number of {self.dtype} tokens")
        if size != expected:
            relation, cause = ("shorter", "a truncated") if size < expected else ("longer", "a damaged")
            raise ValueError(f"{bin_path}: {size} bytes, {relation} than the {expected} bytes its index {idx_path} "
                             f"says ({cause} .bin, or an index of another file)")


def _read_header(idx_path, idx_size):
    """(dtype code, sequence count, document boundary count) of an index, checked against its file size."""
    with open(idx_path, "rb") as f:
        header = f.read(HEADER.size)
    if not (header.startswith(INDEX_MAGIC) or INDEX_MAGIC.startswith(header)):  # a cut-off magic is truncation
        raise ValueError(f"{idx_path}: not a Megatron indexed dataset index: it starts with {header[:9]!r}, "
                         f"not {INDEX_MAGIC!r}")
    if len(header) < HEADER.size:
        raise ValueError(f"{idx_path}: truncated: {idx_size} bytes, less than the {HEADER.size}-byte header")
    _, version, code, count, num_boundaries = HEADER.unpack(header)
    if version != 1:
        raise ValueError(f"{idx_path}: unsupported index version {version} (only version 1 exists)")
    if code not in DTYPES:
        raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    if num_boundaries < 1:
        raise ValueError(f"{idx_path}: document count is 0; it must count at least the leading boundary 0")
    expected = HEADER.size + 12 * count + 8 * num_boundaries
    counts = f"{count} sequences and {num_boundaries - 1} documents"
    if idx_size < expected:
        raise ValueError(f"{idx_path}: truncated: its header announces {counts}, which take {expected} bytes, but the "
                         f"file has {idx_size}")
    if idx_size not in (expected, expected + count):  # + S: the per-sequence modes of multimodal data
        raise ValueError(f"{idx_path}: {idx_size - expected} bytes after the document boundaries; the header's "
                         f"counts ({counts}) do not fit the file")
    return code, count, num_boundaries


class IndexedDatasetBuilder:
    """Writer of `<prefix>.bin` (as documents are added) and `<prefix>.idx` (at `finalize`), byte for byte as
    megatron-core's; an interrupted build leaves a .bin without an index, which no reader accepts."""

    def __init__(self, bin_path, dtype=np.uint16):
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"{self.bin_path}: dtype {self.dtype} has no Megatron dtype code; use one of "
                             f"{sorted(str(np.dtype(d)) for d in DTYPES.values())}")
        stale_index = self.bin_path[:-len(".bin")] + ".idx" if self.bin_path.endswith(".bin") else None
        if stale_index and os.path.exists(stale_index):
            os.remove(stale_index)  # it describes the tokens this builder is about to overwrite
        self._bin = open(self.bin_path, "wb")
        self.sequence_lengths = array("q")
        self.document_indices = array("q", [0])

    def add_document(self, tokens, lengths=None):
        """Append one document of 1-D `tokens` made of sequences of `lengths` tokens (default: one sequence, none
        for an empty document, as Megatron's preprocess_data.py does)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.bin_path}: a document must be a 1-D token array, got shape {tokens.shape}")
        # the range check costs more than the write: skip it when every value of the input dtype fits (uint16 -> uint16)
        if tokens.size and self.dtype.kind in "iu" and not np.can_cast(tokens.dtype, self.dtype):
            if tokens.dtype.kind not in "iub":
                raise ValueError(f"{self.bin_path}: tokens must be integers, got {tokens.dtype}")
            low, high = tokens.min(), tokens.max()
            info = np.iinfo(self.dtype)
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise ValueError(f"{self.bin_path}: token {bad} does not fit this dataset's dtype {self.dtype}")
        if lengths is None:
            lengths = [tokens.size] if tokens.size else []
        else:
            lengths = [int(n) for n in lengths]
            if any(n < 0 for n in lengths) or sum(lengths) != tokens.size:
                raise ValueError(f"{self.bin_path}: sequence lengths {lengths} do not add up to the document's "
                                 f"{tokens.size} tokens")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix):
        """Append every document of the dataset at `path_prefix` (same dtype), as megatron's merge does."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{path_prefix}: dtype {other.dtype} differs from {self.bin_path}'s {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(other.sequence_lengths.astype(np.int64).tobytes())
        self.document_indices.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        with open(other.path_prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._bin)

    def finalize(self, idx_path):
        """Close the .bin and write the index to `idx_path`."""
        self._bin.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{self.bin_path}: a sequence of {lengths.max()} tokens does not fit the index's int32")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        boundaries = np.frombuffer(self.document_indices, dtype=np.int64)
        with atomic_write(idx_path) as f:
            f.write(HEADER.pack(INDEX_MAGIC, 1, DTYPE_CODES[self.dtype], len(lengths), len(boundaries)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(boundaries.astype("<i8").tobytes())


# ----------------------------------------------------------------------------------------------------------------------
# Which prefixes, which weights, which part of each


def resolve_blend(paths):
    """(prefixes, weights or None) for a prefix, a glob, or a Megatron blend list like ["30", p0, "70", p1].

    A glob gives the sorted prefixes of the .bin/.idx files it matches ("processed_data_*_text_document*", as NeMo
    AutoModel reads it) or of the prefixes it matches. A list of odd length or without numbers lists prefixes."""
    if isinstance(paths, (str, os.PathLike)):
        paths = str(paths)
        if not glob.has_magic(paths):
            return [paths], None
        matches = glob.glob(paths) + glob.glob(paths + ".bin") + glob.glob(paths + ".idx")
        prefixes = sorted({m[:-4] for m in matches if m.endswith((".bin", ".idx"))})
        if not prefixes:
            raise FileNotFoundError(f"{paths}: the glob matches no .bin/.idx files"
                                    + (f" (it matches {len(matches)} other paths)" if matches else ""))
        return prefixes, None
    entries = [str(p) for p in paths]
    if not entries:
        raise ValueError("the blend list is empty")
    weights = []
    for w in entries[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if len(entries) % 2 == 1 or all(w is None for w in weights):
        return [p.strip() for p in entries], None
    if None in weights:
        raise ValueError(f"blend list {entries}: weight {entries[2 * weights.index(None)]!r} is not a number; a "
                         f"blend list alternates weight, prefix (or lists only prefixes)")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"blend list {entries}: weights must be positive finite numbers, got {entries[0::2]}")
    return [p.strip() for p in entries[1::2]], weights


def normalize(weights):
    """Weights divided by their sum in float64, as megatron normalizes (bit for bit)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split):
    """Megatron's [(start, end) or None] * 3 fractions of each prefix for train/valid/test, from e.g. "969,30,1"."""
    if not isinstance(split, str):
        raise ValueError(f"split must be a string like '969,30,1', got {split!r}")
    numbers = re.findall(r"[.0-9]+", split)
    separators = re.sub(r"[.0-9]+", "", split)
    if not numbers or len(numbers) > 3 or separators.strip(" ,/:\t"):
        raise ValueError(f"split {split!r}: expected up to three non-negative numbers like '969,30,1'")
    try:
        ratios = [float(n) for n in numbers] + [0.0] * (3 - len(numbers))
    except ValueError:
        raise ValueError(f"split {split!r}: {numbers} are not all numbers") from None
    if sum(ratios) <= 0:
        raise ValueError(f"split {split!r}: the ratios add up to 0")
    bookends = [0]
    for ratio in normalize(ratios):
        bookends.append(bookends[-1] + ratio)
    return [(a, b) if b > a else None for a, b in zip(bookends[:-1], bookends[1:])]


def split_range(num_sequences, bookends):
    """The [begin, end) sequence range that a split's (start, end) fractions cover (Python's round, half to even)."""
    start, end = bookends
    return int(round(start * float(num_sequences))), int(round(end * float(num_sequences)))


def token_weighted_blend(paths):
    """The blend list [str(tokens of p0), p0, ...] of the prefixes `paths` names: megatron-core blends an unweighted
    list one epoch of each at most, while this mixture of one epoch can be asked for any number of samples."""
    prefixes, weights = resolve_blend(paths)
    if weights is not None:
        raise ValueError(f"{paths}: already weighted; token_weighted_blend weights a list of prefixes")
    blend = []
    for prefix in prefixes:
        tokens = IndexedDataset(prefix).num_tokens
        if tokens == 0:
            raise ValueError(f"{prefix}.bin: holds no tokens, so it cannot take part in a token-weighted blend")
        blend += [str(tokens), prefix]
    return blend


# ----------------------------------------------------------------------------------------------------------------------
# GPTDataset and BlendedDataset indices


def gpt_indices(sequence_lengths, begin, end, *, seq_length, num_samples, seed, add_extra_token=True):
    """megatron-core GPTDataset's (document_index, sample_index, shuffle_index) for sequences [begin, end): whole
    epochs, as many as `num_samples` need (None: one)."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.sum(sequence_lengths[begin:end], dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"sequences [{begin}, {end}) hold no tokens to sample from")
    num_epochs = 1 if num_samples is None else max(1, -(-(num_samples * seq_length + extra) // tokens_per_epoch))
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        samples_per_epoch = (tokens_per_epoch - extra) // seq_length
        separate_final_epoch = num_samples - samples_before_final_epoch < int(0.80 * samples_per_epoch)

    rng = np.random.RandomState(seed)  # drawn in this order: document shuffle(s), then sample shuffle(s)

    def shuffled(values):
        rng.shuffle(values)
        return values

    sequences = np.arange(begin, end, dtype=np.int32)
    if separate_final_epoch:
        document_index = np.concatenate([shuffled(np.tile(sequences, num_epochs - 1)), shuffled(sequences.copy())])
    else:
        document_index = shuffled(np.tile(sequences, num_epochs))

    total_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    int32_fits = max(len(document_index), int(sequence_lengths.max())) <= np.iinfo(np.int32).max
    range_lengths = np.array(sequence_lengths[begin:end], dtype=np.int32)  # an aligned copy gathers faster
    sample_index = _sample_index(range_lengths[document_index - begin], seq_length, total_samples, extra,
                                 np.int32 if int32_fits else np.int64)

    samples = np.arange(total_samples, dtype=np.uint32 if total_samples < np.iinfo(np.uint32).max - 1 else np.int64)
    if separate_final_epoch:
        shuffle_index = np.concatenate([shuffled(samples[:samples_before_final_epoch]),
                                        shuffled(samples[samples_before_final_epoch:])])
    else:
        shuffle_index = shuffled(samples)
    return document_index, sample_index, shuffle_index


def _sample_index(sizes, seq_length, num_samples, extra, dtype):
    """Rows (position in the document index, token offset in that sequence) where each sample starts, computed at once
    instead of by Megatron's C++ walk: row k lies in the last sequence starting at or before token k * seq_length +
    extra - 1 (empty ones are stepped over), i.e. the count of sequences whose first row is <= k, minus one."""
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=starts[1:])
    first_rows = starts + (seq_length - extra)
    first_rows //= seq_length
    sample_index = np.zeros((num_samples + 1, 2), dtype=dtype)
    block = 1 << 18  # rows at a time: bounds the temporaries
    for first in range(1, num_samples + 1, block):
        last = min(first + block, num_samples + 1)
        begun_before, begun_by_last = np.searchsorted(first_rows, [first, last])
        sequence = np.cumsum(np.bincount(first_rows[begun_before:begun_by_last] - first, minlength=last - first))
        sequence += begun_before - 1
        offsets = np.arange(first, last, dtype=np.int64) * seq_length
        offsets -= starts[sequence]
        sample_index[first:last, 0] = sequence
        sample_index[first:last, 1] = offsets
    return sample_index


def blending_indices(weights, size=None):
    """megatron-core BlendedDataset's (dataset_index int16, dataset_sample_index int64).

    With `size`: step s draws the dataset maximising weights[d] * max(s, 1) - draws[d] (first on ties, float64 as in
    megatron's C++). Without: `weights` are integer counts, drawn exactly (a dataset drops out once used up).
    The greedy is sequential, so chunks of it run side by side, one numpy operation per step of all. Each chunk starts
    from a guess (weights * step by largest remainder, then WARM_UP greedy steps) and is rerun from where the chunk
    before it really ended until none differs, so the result is exact whatever the guesses."""
    if size is None:
        quotas = np.asarray(weights, dtype=np.int64)
        size = int(quotas.sum())
        weights = quotas / float(size)
    else:
        quotas = None
        weights = np.asarray(weights, dtype=np.float64)
    num_chunks = -(-size // CHUNK)
    first_steps = np.arange(num_chunks, dtype=np.int64) * CHUNK
    start_draws = np.zeros((num_chunks, len(weights)), dtype=np.int64)  # exact for chunk 0
    guess_steps = first_steps[1:] - WARM_UP
    guess = _largest_remainder(weights * (guess_steps - 1)[:, None], guess_steps)
    if quotas is not None:
        np.minimum(guess, quotas, out=guess)
    start_draws[1:] = _greedy(weights, quotas, guess_steps, guess, WARM_UP)

    dataset_index = np.empty((num_chunks, CHUNK), dtype=np.int16)
    dataset_sample_index = np.empty((num_chunks, CHUNK), dtype=np.int64)
    end_draws = np.empty_like(start_draws)
    todo = np.arange(num_chunks)
    while todo.size:
        end_draws[todo] = _greedy(weights, quotas, first_steps[todo], start_draws[todo], CHUNK,
                                  (dataset_index, dataset_sample_index, todo))
        todo = np.flatnonzero((start_draws[1:] != end_draws[:-1]).any(axis=1)) + 1
        start_draws[todo] = end_draws[todo - 1]
    return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]


def _largest_remainder(ideal, totals):
    """Integer rows near `ideal` that add up to `totals`: floors, plus one for the largest fractional parts."""
    counts = np.floor(ideal).astype(np.int64)
    missing = totals - counts.sum(axis=1)
    rank = np.argsort(np.argsort(counts - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    return counts + (rank < missing[:, None])


def _greedy(weights, quotas, first_steps, draws, steps, record=None):
    """The draws after `steps` greedy steps from each row of `draws` (those before step `first_steps[row]`); with
    record = (dataset_index, dataset_sample_index, rows), row i's step t goes to column t of row rows[i] of both."""
    num_datasets = len(weights)
    weight_column = weights[:, None]
    quota_column = None if quotas is None else quotas[:, None]
    first_on_ties = (num_datasets - np.arange(num_datasets, dtype=np.int16))[:, None]
    end_draws = np.empty_like(draws)
    per_group = max(1, SIDE_BY_SIDE_CELLS // num_datasets)
    for group_start in range(0, len(draws), per_group):
        group = slice(group_start, group_start + per_group)
        chunks = len(draws[group])
        counts = np.ascontiguousarray(draws[group].T, dtype=np.float64)  # (datasets, chunks): reduce along rows
        flat_counts = counts.reshape(-1)
        columns = np.arange(chunks)
        if record is not None:
            rows = record[2][group]
            in_place = rows[-1] - rows[0] + 1 == chunks  # consecutive rows: write straight into the output
            picks = record[0][rows[0]:rows[-1] + 1] if in_place else np.empty((chunks, steps), np.int16)
            samples = record[1][rows[0]:rows[-1] + 1] if in_place else np.empty((chunks, steps), np.int64)
        step = np.empty(chunks)
        error = np.empty((num_datasets, chunks))
        largest = np.empty(chunks)
        is_largest = np.empty((num_datasets, chunks), dtype=bool)
        ranked = np.empty((num_datasets, chunks), dtype=np.int16)
        for t in range(steps):
            np.add(first_steps[group], t, out=step)
            np.maximum(step, 1.0, out=step)
            np.multiply(weight_column, step, out=error)
            np.subtract(error, counts, out=error)
            if quota_column is not None:
                np.putmask(error, counts >= quota_column, -np.inf)
            if num_datasets == 2:
                pick = (error[1] > error[0]).astype(np.int64)
            else:  # argmax over datasets, first on ties; np.argmax along axis 0 is several times slower
                np.max(error, axis=0, out=largest)
                np.equal(error, largest, out=is_largest)
                np.multiply(is_largest, first_on_ties, out=ranked)
                pick = num_datasets - ranked.max(axis=0).astype(np.int64)
            where = pick * chunks + columns
            if record is not None:
                picks[:, t] = pick
                samples[:, t] = flat_counts[where]
            flat_counts[where] += 1
        if record is not None and not in_place:
            record[0][rows], record[1][rows] = picks, samples
        end_draws[group] = counts.T
    return end_draws


# ----------------------------------------------------------------------------------------------------------------------
# The index cache


def cached(cache_dir, name, key, build, write):
    """The arrays `build()` returns, kept in `cache_dir` as `{hash of key}-{name}-{array}.npy`.

    `key` holds every parameter and each source .idx's path, size and mtime. The description `{hash}-{name}.json`,
    written last, records the key and each array's dtype and shape; a load checks them and the sizes, or rebuilds."""
    if cache_dir is None:
        return build()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    base = os.path.join(cache_dir, f"{digest}-{name}")
    if os.path.exists(base + ".json"):
        try:
            return _load_cached(base, key)
        except Exception as error:  # whatever is wrong with it, a rebuild is the cure
            log(f"{base}.json: ignoring the cached indices ({type(error).__name__}: {error}); rebuilding")
    arrays = build()
    if write:
        os.makedirs(cache_dir, exist_ok=True)
        description = {"key": key, "arrays": {}}
        for array_name, values in arrays.items():
            with atomic_write(f"{base}-{array_name}.npy") as f:
                np.save(f, values)
            description["arrays"][array_name] = {"dtype": values.dtype.str, "shape": list(values.shape)}
        with atomic_write(base + ".json", "w") as f:
            json.dump(description, f, indent=1)
    return arrays


def _load_cached(base, key):
    with open(base + ".json") as f:
        description = json.load(f)
    if description["key"] != key:
        raise ValueError("its key differs")
    arrays = {}
    for array_name, expected in description["arrays"].items():
        path = f"{base}-{array_name}.npy"
        values = np.load(path, mmap_mode="r")
        if values.dtype.str != expected["dtype"] or list(values.shape) != expected["shape"]:
            raise ValueError(f"{path} holds {values.dtype.str}{list(values.shape)}, not "
                             f"{expected['dtype']}{expected['shape']}")
        if os.path.getsize(path) != values.offset + values.nbytes:
            raise ValueError(f"{path}: {os.path.getsize(path)} bytes, not {values.offset + values.nbytes}")
        arrays[array_name] = values
    return arrays


def source_key(dataset):
    """What identifies an IndexedDataset's contents in a cache key: its index's path, size and mtime."""
    return [os.path.abspath(dataset.path_prefix + ".idx"), dataset.idx_stat.st_size, dataset.idx_stat.st_mtime_ns]


def cache_dirs(prefixes, cache_dir, fallback_cache_dir, blended):
    """(a directory per prefix, one for the blends if `blended`): `cache_dir`; else beside the data as megatron-core
    keeps them (the blends beside the first prefix); where that is read-only, `fallback_cache_dir` (None: in memory)."""
    if cache_dir is not None:
        return [cache_dir] * len(prefixes), cache_dir

    def beside(prefix, kind):
        path = os.path.join(prefix, "cache", f"{kind}_indices")
        if _writable(path):
            return path
        if fallback_cache_dir is None:
            log(f"{path}: not writable and no fallback cache directory: the indices are not kept")
        return fallback_cache_dir

    return ([beside(prefix, "GPTDataset") for prefix in prefixes],
            beside(prefixes[0], "BlendedDataset") if blended else None)


def _writable(path):
    """Whether `path` can be created or written: its nearest existing ancestor is a writable directory."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


# ----------------------------------------------------------------------------------------------------------------------
# Datasets


class GPTDataset:
    """megatron-core's GPTDataset over the sequences [begin, end) of one IndexedDataset. Without `add_extra_token` a
    sample reads seq_length tokens and the last label, which megatron pads and masks out, is -100."""

    def __init__(self, dataset, begin, end, *, seq_length, num_samples, seed, add_extra_token=True,
                 split="train", cache_dir=None, write_cache=True):
        self.dataset, self.seq_length, self.extra = dataset, seq_length, int(add_extra_token)
        key = {"format": CACHE_FORMAT, "class": "GPTDataset", "split": split, "source": source_key(dataset),
               "sequences": [begin, end], "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
               "add_extra_token": bool(self.extra)}

        def build():
            t0 = time.time()
            document_index, sample_index, shuffle_index = gpt_indices(
                dataset.sequence_lengths, begin, end, seq_length=seq_length, num_samples=num_samples, seed=seed,
                add_extra_token=add_extra_token)
            log(f"{dataset.path_prefix}: {split} indices, {len(shuffle_index)} samples of {seq_length} tokens from "
                f"{len(document_index)} sequences, built in {time.time() - t0:.2f}s")
            return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

        arrays = cached(cache_dir, f"GPTDataset-{split}", key, build, write_cache)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, i):
        j = self.shuffle_index[_wrap(i, len(self))]
        first, first_offset = self.sample_index[j]
        last, last_offset = self.sample_index[j + 1]
        get, documents = self.dataset.get, self.document_index
        if first == last:
            text = get(documents[first], first_offset, last_offset - first_offset + self.extra)
        else:
            pieces = [get(documents[first], first_offset)]
            pieces += [get(documents[k]) for k in range(first + 1, last)]
            pieces.append(get(documents[last], 0, last_offset + self.extra))
            text = np.concatenate(pieces)
        text = text.astype(np.int64)
        if self.extra:
            return {"tokens": text[:-1], "labels": text[1:]}
        labels = np.empty_like(text)
        labels[:-1], labels[-1] = text[1:], -100
        return {"tokens": text, "labels": labels}


class BlendedDataset:
    """megatron-core's BlendedDataset: sample i is sample `dataset_sample_index[i]` of `datasets[dataset_index[i]]`.
    With `size`, float `weights` are normalized (again, as megatron does); without, they are exact integer counts."""

    def __init__(self, datasets, weights, size, *, split="train", cache_dir=None, write_cache=True):
        self.datasets = datasets
        if size is not None:
            weights = normalize(weights)
        key = {"format": CACHE_FORMAT, "class": "BlendedDataset", "split": split, "weights": list(weights),
               "size": size}

        def build():
            t0 = time.time()
            dataset_index, dataset_sample_index = blending_indices(weights, size)
            draws = sum((np.bincount(dataset_index[i:i + (1 << 20)], minlength=len(datasets))  # bounded temporaries
                         for i in range(0, len(dataset_index), 1 << 20)), np.zeros(len(datasets), np.int64))
            log(f"{split} blend of {len(datasets)} datasets, {len(dataset_index)} samples, built in "
                f"{time.time() - t0:.2f}s")
            return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index, "draws": draws}

        arrays = cached(cache_dir, f"BlendedDataset-{split}", key, build, write_cache)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for dataset, drawn in zip(datasets, arrays["draws"]):
            if drawn > len(dataset):
                raise ValueError(f"{dataset.dataset.path_prefix}: the {split} blend draws {drawn} samples from it, "
                                 f"more than its {len(dataset)} (megatron-core raises IndexError here too)")

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        i = _wrap(i, len(self))
        return self.datasets[self.dataset_index[i]][self.dataset_sample_index[i]]


def build_gpt_datasets(paths, *, seq_length, split="969,30,1", seed=1234, sizes=(None, None, None), cache_dir=None,
                       fallback_cache_dir=None):
    """(train, valid, test) as megatron-core's BlendedMegatronDatasetBuilder(GPTDataset, sizes, ...).build() makes
    them; each None when that split has no samples (a zero ratio, or nothing in it and no size asked).

    paths: a prefix, a glob (its sorted prefixes, unweighted) or a Megatron blend list ["30", p0, "70", p1]. An
      unweighted list of several prefixes is one epoch of each at most, as in megatron (token_weighted_blend: more).
    sizes: samples per split, None = one epoch; built in whole epochs, so usually more. A weighted blend needs a size
      for each split with a non-zero ratio. cache_dir, fallback_cache_dir: where the indices are kept (cache_dirs);
      under torch.distributed, rank 0 builds and writes them while the others wait, then load them."""
    _check_seq_length(seq_length)
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    sizes = list(sizes)
    if len(sizes) != 3 or not all(s is None or (isinstance(s, (int, np.integer)) and s >= 0) for s in sizes):
        raise ValueError(f"sizes must be (n_train, n_valid, n_test), each a non-negative int or None; got {sizes}")
    seq_length, seed, sizes = int(seq_length), int(seed), [None if s is None else int(s) for s in sizes]
    prefixes, weights = resolve_blend(paths)
    matrix = split_matrix(split)
    datasets = [IndexedDataset(prefix, check=False) for prefix in prefixes]  # checked in build(), once per file
    if weights is not None:
        missing = [SPLITS[i] for i in range(3) if matrix[i] is not None and sizes[i] is None]
        if missing:
            raise ValueError(f"a weighted blend needs a size for every split it builds; {missing} have None")
        sizes = [0 if s is None else s for s in sizes]
    dirs, blend_dir = cache_dirs(prefixes, cache_dir, fallback_cache_dir, len(prefixes) > 1 or weights is not None)

    def build(write_cache):
        for dataset, directory in zip(datasets, dirs):
            _check_once(dataset, directory, write_cache)
        options = dict(seq_length=seq_length, seed=seed, write_cache=write_cache, split_string=split)
        if weights is None and len(prefixes) == 1:
            return tuple(_gpt_split(datasets[0], matrix, i, sizes[i], cache_dir=dirs[0], **options) for i in range(3))
        return tuple(_blend_split(datasets, weights, matrix, i, sizes[i], dirs, blend_dir, **options) for i in range(3))

    rank, world_size = distributed()
    if world_size == 1 or all(d is None for d in dirs + [blend_dir]):
        return build(write_cache=True)
    import torch.distributed as dist  # a process group exists, so torch is already imported

    # rank 0 builds and writes first, then tells the others whether it failed, so that none waits forever
    failure = [None]
    if rank == 0:
        try:
            result = build(write_cache=True)
        except Exception as error:
            failure[0] = f"{type(error).__name__}: {error}"
            dist.broadcast_object_list(failure, src=0)
            raise
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise RuntimeError(f"rank 0 could not build the datasets: {failure[0]}")
    return result if rank == 0 else build(write_cache=False)


def _check_once(dataset, cache_dir, write):
    """dataset.check(), remembered in the index cache for these very files, so a warm start skips it."""
    key = {"format": CACHE_FORMAT, "class": "IndexCheck", "source": source_key(dataset),
           "bin": [dataset.bin_stat.st_size, dataset.bin_stat.st_mtime_ns]}
    cached(cache_dir, "IndexedDataset-checked", key, lambda: dataset.check() or {}, write)


def _blend_split(datasets, weights, matrix, i, size, dirs, blend_dir, *, split_string, **options):
    """Split i of a blend as megatron-core builds it, or None when the split is absent or has no samples."""
    if matrix[i] is None:
        return None
    if weights is not None:  # samples per dataset: blended (target), and built with megatron's 0.5% surplus
        weights = normalize(weights)
        targets = [math.ceil(size * w) for w in weights]
        parts = [_gpt_split(ds, matrix, i, math.ceil(target * (1 + 0.005)), split_string, cache_dir=d, **options)
                 for ds, target, d in zip(datasets, targets, dirs)]
        blend_weights, blend_size = weights, sum(targets)
    else:  # one epoch of each, in proportion to their samples
        parts = [_gpt_split(ds, matrix, i, None, split_string, cache_dir=d, **options)
                 for ds, d in zip(datasets, dirs)]
        blend_weights = [0 if part is None else len(part) for part in parts]
        blend_size = None if size is None else min(size, sum(blend_weights))
        if size is not None and blend_size < size:
            log(f"{SPLITS[i]}: an unweighted blend is one epoch of each prefix, {blend_size} samples, fewer than "
                f"the {size} asked (token_weighted_blend gives a blend that can be repeated)")
    if blend_size == 0 or (blend_size is None and sum(blend_weights) == 0):
        return None
    for ds, part in zip(datasets, parts):
        if part is None:  # megatron-core cannot blend an empty dataset either (it asserts)
            raise ValueError(f"{ds.path_prefix}: its {SPLITS[i]} split ({split_string!r}) has no samples of "
                             f"{options['seq_length']} tokens, so it cannot take part in the blend")
    return BlendedDataset(parts, blend_weights, blend_size, split=SPLITS[i], cache_dir=blend_dir,
                          write_cache=options["write_cache"])


def _gpt_split(dataset, matrix, i, num_samples, split_string, **options):
    """The GPTDataset of split i of one prefix, or None when the split is absent or yields no samples."""
    if matrix[i] is None:
        return None
    begin, end = split_range(len(dataset), matrix[i])
    if not dataset.sequence_lengths[begin:end].any():
        if num_samples:  # megatron-core loops forever here
            raise ValueError(f"{dataset.path_prefix}: its {SPLITS[i]} split ({split_string!r} of {len(dataset)} "
                             f"sequences: [{begin}, {end})) has no tokens, but {num_samples} samples were asked of it")
        return None
    ds = GPTDataset(dataset, begin, end, num_samples=num_samples, split=SPLITS[i], **options)
    return ds if len(ds) else None


# ----------------------------------------------------------------------------------------------------------------------
# Validation: windows of a token stream, in order, and the training sampler


class TokenWindows:
    """Window k of the stream `lead` + `pieces` [(dataset, sequence ids), ...] is stream[k*T : k*T + T + 1], as
    {"tokens": its first T, "labels": its last T}: consecutive windows share one token, as llm.c's loader reads."""

    def __init__(self, pieces, seq_length, length, lead=()):
        self.pieces, self.seq_length, self.length = pieces, seq_length, length
        self.lead = np.asarray(lead, dtype=np.int64)
        self.piece_starts = []  # token offsets in the stream of each piece's sequences, plus its end
        total = len(self.lead)
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
        i = _wrap(i, len(self))
        start, stop = i * self.seq_length, i * self.seq_length + self.seq_length + 1
        parts = [self.lead[start:stop]]
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


class LLMCValWindows(TokenWindows):
    """llm.c's validation batches: num_tokens // seq_length windows of [eot] + every document of `path_prefix` (a
    prefix or glob) in file order. llm.c puts the EOT before each document and we after, so this is its val shard."""

    def __init__(self, path_prefix, seq_length, num_tokens, eot=EOT):
        _check_seq_length(seq_length)
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        prefixes = resolve_blend(path_prefix)[0]
        pieces = [(ds, np.arange(len(ds))) for ds in map(IndexedDataset, prefixes)]
        windows = int(num_tokens) // int(seq_length)
        super().__init__(pieces, int(seq_length), windows, lead=[eot])
        need = windows * seq_length + 1
        if self.num_tokens < need:
            raise ValueError(f"{', '.join(p + '.bin' for p in prefixes)}: the stream holds {self.num_tokens} tokens "
                             f"with the leading EOT, fewer than the {need} that {windows} windows of {seq_length} need")


def sequential_samples(paths, *, seq_length, split="969,30,1", split_index=1, max_samples=None):
    """The validation view of one split: its sequences in order (blend weights ignored) cut into TokenWindows; None
    when the split has a zero ratio."""
    if split_index not in (0, 1, 2):
        raise ValueError(f"split_index must be 0 (train), 1 (valid) or 2 (test), got {split_index!r}")
    _check_seq_length(seq_length)
    if max_samples is not None and max_samples < 0:
        raise ValueError(f"max_samples must be None or >= 0, got {max_samples!r}")
    prefixes, _ = resolve_blend(paths)
    bookends = split_matrix(split)[split_index]
    if bookends is None:
        return None
    pieces = [(ds, np.arange(*split_range(len(ds), bookends))) for ds in map(IndexedDataset, prefixes)]
    samples = TokenWindows(pieces, int(seq_length), 0)
    if samples.num_tokens < seq_length + 1:
        raise ValueError(f"{', '.join(prefixes)}: the {SPLITS[split_index]} split ({split!r}) holds "
                         f"{samples.num_tokens} tokens, less than one window of seq_length + 1 = {seq_length + 1}")
    samples.length = (samples.num_tokens - 1) // seq_length
    if max_samples is not None:
        samples.length = min(samples.length, max_samples)
    return samples


class PretrainingSampler:
    """Micro-batches of dataset indices for one rank, as megatron's MegatronPretrainingSampler: global chunk k is
    [consumed + k*mbs*W, consumed + (k+1)*mbs*W), rank r takes its r-th mbs, an incomplete last chunk is dropped.
    So a restart from `consumed_samples`, on any world size, continues from the same place. A DataLoader batch_sampler.
    """

    def __init__(self, total_samples, consumed_samples, micro_batch_size, rank, world_size):
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= rank < world_size, got {micro_batch_size}, "
                             f"{rank}, {world_size}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside [0, total_samples={total_samples}]")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size

    def __len__(self):
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.world_size)

    def __iter__(self):
        global_batch = self.micro_batch_size * self.world_size
        for k in range(len(self)):
            first = self.consumed_samples + k * global_batch + self.rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))


# ----------------------------------------------------------------------------------------------------------------------
# Token ranges and the command line


def token_range(dataset):
    """(smallest, largest) token id of a dataset (an IndexedDataset or a prefix), (None, None) without tokens; kept in
    `<prefix>.stats.json` (where the directory is writable), so only the first call reads the .bin."""
    prefix = dataset.path_prefix if isinstance(dataset, IndexedDataset) else dataset
    try:
        stats = {name: os.stat(f"{prefix}.{name}") for name in ("bin", "idx")}
        key = {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}
    except OSError:  # missing files: opening the dataset names them
        key = None
    path = prefix + ".stats.json" if os.access(os.path.dirname(os.path.abspath(prefix)), os.W_OK) else None
    try:
        with open(path) as f:
            stats = json.load(f)
        if stats["key"] == key:
            return stats["min"], stats["max"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, unreadable or stale: compute it
    # only a miss opens the dataset (and checks its index): a warm start reads two stat()s and a small file
    low, high = _scan_range(dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(prefix))
    if path is not None and key is not None:
        try:
            with atomic_write(path, "w") as f:
                json.dump({"key": key, "min": low, "max": high}, f)
        except OSError:
            pass  # a cache we cannot write costs only the pass next time
    return low, high


def check_token_range(paths, vocab_size):
    """Raise ValueError naming the .bin if a dataset of `paths` (a prefix, glob or list) holds a token id outside
    [0, vocab_size). Cheap after the first call (token_range)."""
    for prefix in resolve_blend(paths)[0]:
        low, high = token_range(prefix)
        if high is not None and high >= vocab_size:
            raise ValueError(f"token id {high} in {prefix}.bin is outside the model's vocabulary "
                             f"(vocab_size {vocab_size})")
        if low is not None and low < 0:
            raise ValueError(f"token id {low} in {prefix}.bin is negative: outside the model's vocabulary "
                             f"(vocab_size {vocab_size})")


def _scan_range(ds):
    tokens, low, high = ds.tokens, None, None
    with tqdm(total=len(tokens), unit="tok", unit_scale=True, desc=os.path.basename(ds.path_prefix), file=sys.stderr,
              disable=len(tokens) < 10 * TOKENS_PER_STEP) as progress:
        for start in range(0, len(tokens), TOKENS_PER_STEP):
            part = tokens[start:start + TOKENS_PER_STEP]
            low = int(part.min()) if low is None else min(low, int(part.min()))
            high = int(part.max()) if high is None else max(high, int(part.max()))
            progress.update(len(part))
    return low, high


def info(paths):
    """One line per prefix (and a total): documents, sequences, tokens, dtype, file sizes."""
    prefixes = _cli_prefixes(paths)
    totals = np.zeros(3, dtype=np.int64)
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        lengths = ds.sequence_lengths
        counts = np.array([ds.num_documents, len(ds), ds.num_tokens])
        totals += counts
        spread = (f", sequence length min {lengths.min():,} mean {lengths.mean():,.1f} max {lengths.max():,}"
                  if len(lengths) else "")
        print(f"{prefix}: {counts[0]:,} documents, {counts[1]:,} sequences, {counts[2]:,} tokens ({ds.dtype}); "
              f".bin {os.path.getsize(prefix + '.bin'):,} bytes, .idx {os.path.getsize(prefix + '.idx'):,} bytes"
              + spread)
    if len(prefixes) > 1:
        print(f"total of {len(prefixes)} prefixes: {totals[0]:,} documents, {totals[1]:,} sequences, "
              f"{totals[2]:,} tokens")


def verify(paths, vocab_size=None):
    """Open every prefix (checking its index) and read every token (below `vocab_size` when given); the problems."""
    problems = []
    for prefix in _cli_prefixes(paths):
        try:
            ds = IndexedDataset(prefix)
        except (ValueError, FileNotFoundError) as error:
            problems.append(str(error))
            continue
        low, high = _scan_range(ds)  # read afresh: verifying trusts no cache
        ok = vocab_size is None or high is None or (high < vocab_size and low >= 0)
        if not ok:
            problems.append(f"{prefix}.bin: token ids span [{low}, {high}], outside the vocabulary [0, {vocab_size})")
        print(f"{prefix}: {'ok' if ok else 'PROBLEMS'}: {ds.num_documents:,} documents, "
              f"{len(ds):,} sequences, {ds.num_tokens:,} tokens, ids in [{low}, {high}]")
    return problems


def _cli_prefixes(paths):
    """Prefixes from the command line: one prefix or quoted glob, or the files an unquoted glob expanded to."""
    paths = [p[:-4] if p.endswith((".bin", ".idx")) else p for p in paths]
    return resolve_blend(paths[0])[0] if len(paths) == 1 else sorted(set(paths))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Inspect Megatron indexed datasets (<prefix>.bin + <prefix>.idx).")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="documents, sequences, tokens, dtype and sizes").add_argument(
        "paths", metavar="PREFIX_OR_GLOB", nargs="+")
    verify_parser = commands.add_parser("verify", help="check the index and read every token")
    verify_parser.add_argument("paths", metavar="PREFIX_OR_GLOB", nargs="+")
    verify_parser.add_argument("--vocab-size", type=int, default=None, help="fail on token ids >= this")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            info(args.paths)
            return 0
        problems = verify(args.paths, args.vocab_size)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
