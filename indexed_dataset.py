"""Megatron-Core indexed datasets and GPT sampling in plain numpy: the same .bin/.idx bytes, and the same samples in
the same order, as megatron-core 0.16.1's IndexedDataset, GPTDataset and BlendedDataset (tests/ compare them).
The .idx (little-endian, packed): magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count S u64
| document count D u64 (with a leading 0) | sequence lengths i32[S] | their byte offsets in the .bin i64[S] | document
boundaries i64[D]; the .bin is the tokens. `python indexed_dataset.py info|verify PREFIX_OR_GLOB` inspects files."""
import argparse
import concurrent.futures
import ctypes
import glob
import hashlib
import itertools
import json
import math
import os
import re
import struct
import sys
import threading
import time
from array import array

import numpy as np

from atomic_io import WriteError, atomic_write

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
DTYPE_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
SPLITS = ("train", "valid", "test")
EOT = 50256  # GPT-2's <|endoftext|>, which ends every document of prepare_fineweb.py's files
CACHE_FORMAT = 3  # bump when the cached arrays or their key change meaning (3: keyed by the data's fingerprint)
CHUNK, WARM_UP = 2048, 64  # blending_indices works in chunks of CHUNK steps, each started WARM_UP steps early


def distributed():
    """(rank, world size) of the initialized torch.distributed group, else (0, 1); never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def node_leader():
    """Whether this process builds and writes the index cache for its node: torchrun's local rank 0 (every node has
    one, whether or not the nodes share a filesystem), else global rank 0."""
    rank, world_size = distributed()
    local_rank = os.environ.get("LOCAL_RANK")
    return rank == 0 if world_size == 1 or local_rank is None else local_rank == "0"


def usable_cores():
    """The CPU cores this process may run on (its affinity, which a scheduler or taskset may narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def log(message):
    if distributed()[0] == 0:
        print(f"indexed_dataset: {message}", file=sys.stderr, flush=True)


# what a missing dataset's error adds
MISSING_DATA = "write the token files with prepare_fineweb.py (see its --help), or check the path"


# The .bin/.idx files
def file_sha256(path):
    """The SHA-256 of a file, read in blocks rather than mapped, so its pages stay out of this process."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class IndexedDataset:
    """Memory-mapped `<path_prefix>.bin` + `.idx`: `ds[i]` is a read-only view of sequence i; opening checks them."""

    def __init__(self, path_prefix, check=True):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                hint = " (give the prefix, without .bin/.idx)" if self.path_prefix.endswith((".bin", ".idx")) else \
                    f"; {MISSING_DATA}"
                raise FileNotFoundError(f"{path}: no such file{hint}")
        self.sizes = {suffix: os.path.getsize(self.path_prefix + suffix) for suffix in (".bin", ".idx")}  # changed()
        self._fingerprint = None
        bin_size, idx_size = self.sizes.values()
        with open(idx_path, "rb") as f:
            header = f.read(HEADER.size)
        if not (header.startswith(INDEX_MAGIC) or INDEX_MAGIC.startswith(header)):  # a cut-off magic is truncation
            raise ValueError(f"{idx_path}: not a Megatron indexed dataset index (it starts with {header[:9]!r})")
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
            raise ValueError(f"{idx_path}: truncated: its header announces {counts}: {expected} bytes, not {idx_size}")
        if idx_size not in (expected, expected + count):  # + S: the per-sequence modes of multimodal data
            raise ValueError(f"{idx_path}: {idx_size - expected} bytes after the document boundaries ({counts})")
        self.dtype, self.num_documents = np.dtype(DTYPES[code]), num_boundaries - 1
        self._index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(self._index, "<i4", count, HEADER.size)
        self.sequence_pointers = np.frombuffer(self._index, "<i8", count, HEADER.size + 4 * count)
        self.document_indices = np.frombuffer(self._index, "<i8", num_boundaries, HEADER.size + 12 * count)
        if self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(f"{idx_path}: corrupt: document boundaries run from {self.document_indices[0]} to "
                             f"{self.document_indices[-1]}, not from 0 to the sequence count {count}")
        if check:
            self.check()
        # the .bin holds exactly every sequence: it ends where the last one does (check() vouches for its pointer)
        expected = count and int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if bin_size % self.dtype.itemsize:
            raise ValueError(f"{bin_path}: {bin_size} bytes is not a whole number of {self.dtype} tokens")
        if bin_size != expected:
            raise ValueError(f"{bin_path}: {bin_size} bytes, {'shorter' if bin_size < expected else 'longer'} than "
                             f"the {expected} bytes its index {idx_path} says")
        # every token in file order, a plain view (a memmap's slices cost more); an empty file cannot be mapped
        self.tokens = np.memmap(bin_path, self.dtype, "r").view(np.ndarray) if bin_size else np.empty(0, self.dtype)

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, i, offset=0, length=None):
        """`length` tokens (default: to the end) of sequence i, starting `offset` tokens into it."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + int(offset)
        length = int(self.sequence_lengths[i]) - int(offset) if length is None else int(length)
        return self.tokens[start:start + length]

    __getitem__ = get

    @property
    def num_tokens(self):
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def fingerprint(self):
        """What changes when the data is replaced: a hash of the index and the .bin's size (the tokens are not read).
        Kept once known; not a functools.cached_property, whose lock (Python < 3.12) lets one file at a time hash."""
        if self._fingerprint is None:
            self._fingerprint = f"{file_sha256(self.path_prefix + '.idx')[:32]}-{self.sizes['.bin']}"
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value):
        self._fingerprint = value

    def version(self):
        """What tells one version of the files from another without reading them, as make and git judge a file
        unchanged: each file's size, modification and change times (ns) and inode."""
        stats = [os.stat(self.path_prefix + suffix) for suffix in (".idx", ".bin")]
        return {"prefix": os.path.abspath(self.path_prefix),
                "files": [[st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for st in stats]}

    def documents(self, sequences):
        """The documents holding tokens of `sequences` (an array), "documents 7, 3", numbered from 0 in file order."""
        held = np.searchsorted(self.document_indices, sequences[self.sequence_lengths[sequences] > 0], "right") - 1
        return "documents " + ", ".join(map(str, dict.fromkeys(held.tolist())))

    def changed(self, why):
        """The error for files rewritten in place while open (a sample of the wrong length), naming the prefix."""
        for suffix, size in self.sizes.items():
            now = os.path.getsize(self.path_prefix + suffix) if os.path.exists(self.path_prefix + suffix) else 0
            if now != size:
                why += f"; its {suffix} had {size} bytes, now {now}"
        return ValueError(f"{self.path_prefix}: changed on disk since it was opened ({why})")

    def check(self, block=1 << 20):
        """Raise ValueError naming the .idx unless boundaries never fall and each pointer sums the lengths before it.
        The pointers and boundaries are read `block` at a time, not through the mapping, whose pages would otherwise
        stay in this process's memory (16 bytes a sequence) though nothing else reads them."""
        idx_path, count = self.path_prefix + ".idx", len(self.sequence_lengths)
        pointers_at, boundaries_at = HEADER.size + 4 * count, HEADER.size + 12 * count
        with open(idx_path, "rb") as f:
            def int64s(offset, n):
                return np.frombuffer(os.pread(f.fileno(), 8 * n, offset), "<i8")

            previous = 0
            for first in range(0, len(self.document_indices), block):
                boundaries = int64s(boundaries_at + 8 * first, min(block, len(self.document_indices) - first))
                if boundaries[0] < previous or (np.diff(boundaries) < 0).any():
                    raise ValueError(f"{idx_path}: corrupt: document boundaries decrease")
                previous = boundaries[-1]
            start = 0
            for first in range(0, count, block):
                sizes = self.sequence_lengths[first:first + block].astype(np.int64)
                if sizes.min() < 0:
                    raise ValueError(f"{idx_path}: corrupt: sequence {first + np.argmin(sizes)} has a negative length "
                                     f"{sizes.min()}")
                sizes *= self.dtype.itemsize
                starts = np.cumsum(sizes) - sizes + start
                start = int(starts[-1] + sizes[-1])
                pointers = int64s(pointers_at + 8 * first, len(sizes))
                for k in np.flatnonzero(pointers != starts)[:1]:  # the first wrong pointer, if any
                    raise ValueError(f"{idx_path}: corrupt: sequence {first + k} starts at byte {pointers[k]} of the "
                                     f".bin, but the lengths before it put it at byte {starts[k]} ({self.dtype} "
                                     f"tokens): a wrong dtype code or damaged pointers")


class IndexedDatasetBuilder:
    """Writer of `<prefix>.bin` and, at `finalize`, `<prefix>.idx`, byte for byte as megatron-core's."""

    def __init__(self, bin_path, dtype=np.uint16):
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype)  # one of DTYPES
        if self.bin_path.endswith(".bin") and os.path.exists(self.bin_path[:-4] + ".idx"):
            os.remove(self.bin_path[:-4] + ".idx")  # no reader accepts the .bin of an interrupted build without it
        self._bin = open(self.bin_path, "wb")
        self.sequence_lengths, self.document_indices = array("q"), array("q", [0])

    def add_document(self, tokens, lengths=None):
        """Append 1-D `tokens` as a document of sequences of `lengths` (default: one, none if empty, as Megatron)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.bin_path}: a document must be a 1-D token array, got shape {tokens.shape}")
        # the range check costs more than the write: skip it when every value of the input dtype fits (uint16 -> uint16)
        if tokens.size and self.dtype.kind in "iu" and not np.can_cast(tokens.dtype, self.dtype):
            if tokens.dtype.kind not in "iub":
                raise ValueError(f"{self.bin_path}: tokens must be integers, got {tokens.dtype}")
            bad = tokens[tokens.astype(self.dtype) != tokens]
            if bad.size:
                raise ValueError(f"{self.bin_path}: token {bad[0]} does not fit this dataset's dtype {self.dtype}")
        lengths = ([tokens.size] if tokens.size else []) if lengths is None else [int(n) for n in lengths]
        if any(n < 0 for n in lengths) or sum(lengths) != tokens.size:
            raise ValueError(f"{self.bin_path}: sequence lengths {lengths} do not add up to the {tokens.size} tokens")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path):
        """Close the .bin and write the index to `idx_path`."""
        self._bin.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        boundaries = np.frombuffer(self.document_indices, dtype=np.int64)
        with atomic_write(idx_path) as f:
            f.write(HEADER.pack(INDEX_MAGIC, 1, DTYPE_CODES[self.dtype], len(lengths), len(boundaries)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(((np.cumsum(lengths) - lengths) * self.dtype.itemsize).astype("<i8").tobytes())  # the pointers
            f.write(boundaries.astype("<i8").tobytes())


# Which prefixes, which weights, which part of each, and the index arrays of each dataset
def resolve_blend(paths):
    """(prefixes, weights or None) for a prefix, a list of them, a Megatron blend list like ["30", p0, "70", p1] or a
    glob, which gives the sorted prefixes of the .bin/.idx files or the prefixes it matches (as NeMo AutoModel)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = str(paths)
        if not glob.has_magic(paths):
            return [paths], None
        matches = glob.glob(paths) + glob.glob(paths + ".bin") + glob.glob(paths + ".idx")
        prefixes = sorted({m[:-4] for m in matches if m.endswith((".bin", ".idx"))})
        if not prefixes:
            raise FileNotFoundError(f"{paths}: the glob matches no .bin/.idx files; {MISSING_DATA}")
        return prefixes, None
    entries, numbers = [str(p).strip() for p in paths], []
    if not entries:
        raise ValueError("the blend list is empty")
    for entry in entries:
        try:
            numbers.append(float(entry))
        except ValueError:
            numbers.append(None)
    if numbers.count(None) == len(numbers):
        return entries, None
    weights = numbers[0::2]
    if len(entries) % 2 or None in weights:
        why = (f"{len(entries)} entries" if len(entries) % 2 else
               f"weight {entries[2 * weights.index(None)]!r} is not a number")
        raise ValueError(f"blend list {entries}: {why}; it must alternate weight, prefix (or list only prefixes)")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"blend list {entries}: weights must be positive finite numbers, got {entries[0::2]}")
    if not math.isfinite(sum(weights)):  # normalizing would divide by inf: every share 0
        raise ValueError(f"blend list {entries}: the weights {entries[0::2]} add up to more than a float holds; "
                         f"scale them down (only their ratios count)")
    return entries[1::2], weights


def normalize(weights):
    """Weights divided by their sum in float64, as megatron normalizes (bit for bit)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split):
    """Megatron's [(start, end) or None] * 3 fractions of each prefix for train/valid/test, from e.g. "969,30,1"."""
    numbers = re.findall(r"[.0-9]+", split)
    try:
        ratios = [float(n) for n in numbers] + [0.0] * (3 - len(numbers))
        if not 1 <= len(numbers) <= 3 or sum(ratios) <= 0 or re.sub(r"[.0-9]+", "", split).strip(" ,/:\t"):
            raise ValueError
    except ValueError:
        raise ValueError(f"split {split!r}: expected up to three non-negative numbers like '969,30,1'") from None
    bookends = [0, *itertools.accumulate(normalize(ratios))]  # Python float sums, as megatron's
    return [(a, b) if b > a else None for a, b in zip(bookends[:-1], bookends[1:])]


def split_range(num_sequences, bookends):
    """The [begin, end) sequence range that a split's (start, end) fractions cover (Python's round, half to even)."""
    return tuple(int(round(fraction * float(num_sequences))) for fraction in bookends)


def token_weighted_blend(paths):
    """The blend [str(tokens of p0), p0, ...] of `paths`: unlike an unweighted list, it goes past an epoch."""
    prefixes, weights = resolve_blend(paths)
    if weights is not None:
        raise ValueError(f"{paths}: already weighted; token_weighted_blend weights a list of prefixes")
    blend = []
    for prefix in prefixes:
        tokens = IndexedDataset(prefix, check=False).num_tokens  # the build checks each index, once per version
        if tokens == 0:
            raise ValueError(f"{prefix}.bin: holds no tokens, so it cannot take part in a token-weighted blend")
        blend += [str(tokens), prefix]
    return blend


def epochs(tokens_per_epoch, *, seq_length, num_samples, extra):
    """(epochs, whether the last is shuffled apart) that megatron's GPTDataset builds for `num_samples`: with the
    data, the seed and the lengths, all that its index arrays depend on (num_samples matters only through them)."""
    num_epochs = 1 if num_samples is None else max(1, -(-(num_samples * seq_length + extra) // tokens_per_epoch))
    samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    samples_per_epoch = (tokens_per_epoch - extra) // seq_length
    separate_final_epoch = num_epochs > 1 and num_samples - samples_before_final_epoch < int(0.80 * samples_per_epoch)
    return num_epochs, separate_final_epoch


def one_epoch_samples(paths, *, seq_length, split, split_index=0, add_extra_token=True):
    """The samples of one epoch of split `split_index` of every prefix of `paths` together: all that an unweighted
    list of prefixes gives (megatron-core's cap), counted from the sequence lengths without building any index."""
    bookends = split_matrix(split)[split_index]
    total = 0
    for prefix in resolve_blend(paths)[0] if bookends is not None else []:
        dataset = IndexedDataset(prefix, check=False)
        begin, end = split_range(len(dataset), bookends)
        tokens = int(np.sum(dataset.sequence_lengths[begin:end], dtype=np.int64))
        total += max(0, (tokens - int(add_extra_token)) // seq_length)
    return total


def gpt_indices(sequence_lengths, begin, end, *, seq_length, num_samples, seed, add_extra_token=True):
    """megatron-core GPTDataset's {document_index, sample_index, shuffle_index} of sequences [begin, end), in epochs."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.sum(sequence_lengths[begin:end], dtype=np.int64))  # > 0: build_gpt_datasets checks
    num_epochs, separate_final_epoch = epochs(tokens_per_epoch, seq_length=seq_length, num_samples=num_samples,
                                              extra=extra)
    samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    total_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    # drawn in this order: the document shuffle(s), then the sample shuffle(s); a separate final epoch is shuffled
    # apart from the epochs before it (shuffling nothing draws nothing)
    rng = np.random.RandomState(seed)
    document_index = np.tile(np.arange(begin, end, dtype=np.int32), num_epochs)
    cut = (num_epochs - separate_final_epoch) * (end - begin)
    rng.shuffle(document_index[:cut])
    rng.shuffle(document_index[cut:])
    # sample_index: the (position in the document index, token offset in that sequence) where each sample starts, at
    # once instead of Megatron's C++ walk: row k lies in the last sequence starting at or before token k * seq_length +
    # extra - 1 (empty ones are stepped over), i.e. the count of sequences whose first row is <= k, minus one
    sizes = np.array(sequence_lengths[begin:end], dtype=np.int32)[document_index - begin]  # aligned: gathers faster
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=starts[1:])
    del sizes  # before the sample index is made
    first_rows = starts + (seq_length - extra)
    first_rows //= seq_length
    int32_fits = max(len(document_index), int(sequence_lengths.max())) <= np.iinfo(np.int32).max
    sample_index = np.zeros((total_samples + 1, 2), dtype=np.int32 if int32_fits else np.int64)
    block = 1 << 18  # rows at a time: bounds the temporaries
    for first in range(1, total_samples + 1, block):
        last = min(first + block, total_samples + 1)
        begun_before, begun_by_last = np.searchsorted(first_rows, [first, last])
        sequence = np.cumsum(np.bincount(first_rows[begun_before:begun_by_last] - first, minlength=last - first))
        sequence += begun_before - 1
        sample_index[first:last, 0] = sequence
        sample_index[first:last, 1] = np.arange(first, last, dtype=np.int64) * seq_length - starts[sequence]
    shuffle_index = np.arange(total_samples, dtype=np.uint32 if total_samples < 2**32 - 2 else np.int64)
    cut = samples_before_final_epoch if separate_final_epoch else total_samples
    rng.shuffle(shuffle_index[:cut])
    rng.shuffle(shuffle_index[cut:])
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class BuildStopped(Exception):
    """A blend's index build ended early because the build it was part of failed (the error worth reading)."""


def blending_indices(weights, size=None, stop=None):
    """megatron-core BlendedDataset's (dataset_index int16, dataset_sample_index int64): with `size`, step s draws the
    dataset maximising weights[d] * max(s, 1) - draws[d] (first on ties, in float64); without, `weights` are counts.
    Chunks of the greedy run side by side from a guess, each rerun from where the one before ended until exact.
    `stop`: a threading.Event that, once set, ends the build (BuildStopped) within a fraction of a second."""
    if size is None:
        quotas = np.asarray(weights, dtype=np.int64)
        size, weights = int(quotas.sum()), quotas / float(quotas.sum())
    else:
        quotas, weights = None, np.asarray(weights, dtype=np.float64)
    num_chunks = -(-size // CHUNK)
    first_steps = np.arange(num_chunks, dtype=np.int64) * CHUNK
    guess_steps = first_steps[1:] - WARM_UP
    ideal = weights * (guess_steps - 1)[:, None]  # the guess: floors, plus one for the largest fractional parts
    guess = np.floor(ideal).astype(np.int64)
    rank = np.argsort(np.argsort(guess - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    guess += rank < (guess_steps - guess.sum(axis=1))[:, None]
    del ideal, rank
    if quotas is not None:
        np.minimum(guess, quotas, out=guess)
    start_draws = np.zeros((num_chunks, len(weights)), dtype=np.int64)  # exact for chunk 0
    warm_up = np.empty((len(guess), WARM_UP), np.int16), np.empty((len(guess), WARM_UP), np.int64)
    start_draws[1:] = _greedy(weights, quotas, guess_steps, guess, *warm_up, stop=stop)
    del guess, warm_up
    dataset_index = np.empty((num_chunks, CHUNK), dtype=np.int16)
    dataset_sample_index = np.empty((num_chunks, CHUNK), dtype=np.int64)
    end_draws = _greedy(weights, quotas, first_steps, start_draws, dataset_index, dataset_sample_index, stop=stop)
    while True:  # a chunk that did not start where the one before ended is run again from there
        todo = np.flatnonzero((start_draws[1:] != end_draws[:-1]).any(axis=1)) + 1
        if not todo.size:
            return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]
        start_draws[todo] = end_draws[todo - 1]
        picks, samples = dataset_index[todo], dataset_sample_index[todo]
        end_draws[todo] = _greedy(weights, quotas, first_steps[todo], start_draws[todo], picks, samples, stop=stop)
        dataset_index[todo], dataset_sample_index[todo] = picks, samples


def _greedy(weights, quotas, first_steps, draws, picks, samples, block=1 << 19, flush=64, stop=None):
    """Run len(picks[0]) greedy steps from each row of `draws` (row r starting at step first_steps[r]): the datasets
    picked and their sample numbers into `picks` and `samples`; returns the draws after. Rows go up to `block`
    (datasets x rows) values at a time; with enough of them, blocks run side by side in threads, one a core (numpy
    lets go of the GIL in each step's arithmetic; small blocks would spend their time waiting for it)."""
    num_datasets = len(weights)
    threads = max(1, min(usable_cores(), 8, len(draws) * num_datasets // (1 << 17)))
    rows = max(8, min(block // num_datasets, -(-len(draws) // threads)))
    end_draws = np.empty_like(draws)

    def run(first):
        last = min(first + rows, len(draws))
        end_draws[first:last] = _greedy_rows(weights, quotas, first_steps[first:last], draws[first:last],
                                             picks[first:last], samples[first:last], flush, stop)

    if threads == 1:
        for first in range(0, len(draws), rows):
            run(first)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(0, len(draws), rows)))  # raises a block's error
    return end_draws


def _greedy_rows(weights, quotas, first_steps, draws, picks, samples, flush, stop):
    """_greedy on one block of rows, held as (datasets, rows) so that each step reduces over axis 0; each step's
    picks go to a contiguous scratch row, copied out every `flush` steps (a column write per step costs more than
    the step's arithmetic)."""
    num_datasets, steps, n = len(weights), picks.shape[1], len(draws)
    first_on_ties = (num_datasets - np.arange(num_datasets, dtype=np.int16))[:, None]
    column = weights[:, None]
    counts = np.ascontiguousarray(draws.T, dtype=np.float64)
    flat_counts = counts.reshape(-1)
    # row r's pick d is flat_counts[d * n + r], and d = num_datasets - (its value in first_on_ties)
    flat_end = num_datasets * n + np.arange(n)
    error, is_max, ties = np.empty(counts.shape), np.empty(counts.shape, bool), np.empty(counts.shape, np.int16)
    row_steps, x, next_sample = first_steps.astype(np.float64), np.empty(n), np.empty(n)
    where = np.empty(n, np.int64)
    tie_values, drawn = np.empty((flush, n), np.int16), np.empty((flush, n))
    for t in range(steps):
        np.add(row_steps, t, out=x)
        if t == 0:
            np.maximum(x, 1.0, out=x)  # step 0 weighs as step 1
        np.multiply(column, x, out=error)
        np.subtract(error, counts, out=error)
        if quotas is not None:
            np.putmask(error, counts >= quotas[:, None], -np.inf)
        # argmax over datasets, first on ties; np.argmax along axis 0 is several times slower
        np.equal(error, error.max(axis=0), out=is_max)
        np.multiply(is_max, first_on_ties, out=ties)
        top = ties.max(axis=0, out=tie_values[t % flush])
        np.multiply(top, np.int64(n), out=where)
        np.subtract(flat_end, where, out=where)
        sample = np.take(flat_counts, where, out=drawn[t % flush])
        np.add(sample, 1.0, out=next_sample)
        flat_counts[where] = next_sample
        if t % flush == flush - 1 or t == steps - 1:
            if stop is not None and stop.is_set():
                raise BuildStopped("the build this blend was part of failed")
            done = t % flush + 1
            picks[:, t + 1 - done:t + 1] = num_datasets - tie_values[:done].T
            samples[:, t + 1 - done:t + 1] = drawn[:done].T
    return counts.T


class CacheWrites:
    """While build_gpt_datasets builds, the cache's files are written by threads beside it: each publish waits for its
    fsyncs (several ms each), which then overlap each other and the next build instead of adding up."""
    pool = futures = paths = None

    def __enter__(self):
        CacheWrites.pool, CacheWrites.futures, CacheWrites.paths = concurrent.futures.ThreadPoolExecutor(8), [], set()
        return self

    def __exit__(self, *exc_info):
        pool, done = CacheWrites.pool, CacheWrites.futures
        CacheWrites.pool = CacheWrites.futures = CacheWrites.paths = None
        pool.shutdown(wait=True)  # every file is published (or failed) before the datasets are returned
        for future in done:
            future.result()  # raises the first write's error (a WriteError naming the file)

    @staticmethod
    def submit(write, path, *args):
        """write(path, *args), once per path: two prefixes holding the same data share their cache entry, whose
        files two threads of one process must not write at once (their temporaries are named per process)."""
        if CacheWrites.pool is None:
            write(path, *args)
        elif path not in CacheWrites.paths:
            CacheWrites.paths.add(path)
            CacheWrites.futures.append(CacheWrites.pool.submit(write, path, *args))


def publish(base, key, arrays):
    """The arrays, then the description that vouches for them: a description is never there without its arrays."""
    for array_name, values in arrays.items():
        with atomic_write(f"{base}-{array_name}.npy") as f:
            np.save(f, values)
    with atomic_write(base + ".json", "w") as f:
        json.dump({"key": key, "arrays": list(arrays)}, f, indent=1)


def cached(cache_dir, name, key, build):
    """The arrays `build()` returns, kept in `cache_dir` (by node_leader()) as `{hash}-{name}-{array}.npy` and, written
    last, `{hash}-{name}.json` holding `key` (every parameter, each source's fingerprint); what does not load is
    rebuilt."""
    if cache_dir is None:
        return build()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    base = os.path.join(cache_dir, f"{digest}-{name}")
    if os.path.exists(base + ".json"):
        try:
            with open(base + ".json") as f:
                description = json.load(f)
            if description["key"] != key:
                raise ValueError("its key differs")
            return {array: np.load(f"{base}-{array}.npy", mmap_mode="r") for array in description["arrays"]}
        except Exception as error:  # whatever is wrong with it, a rebuild is the cure
            log(f"{base}.json: ignoring the cached indices ({type(error).__name__}: {error}); rebuilding")
    arrays = build()
    if node_leader():  # the other ranks of its node load what it wrote
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as error:
            raise WriteError(error.errno, error.strerror, cache_dir) from None
        CacheWrites.submit(publish, base, key, arrays)
    return arrays


def check_once(dataset, cache_dir, racy_seconds=2.0):
    """Learn `dataset`'s fingerprint, and return the index check still owed (a function), or None when a record
    vouches for these files. `cache_dir` keeps a record `{hash}-IndexedDataset-checked.json` of each version of the
    files (sizes, times, inode) with its fingerprint, so a warm start hashes and checks nothing. A record made within
    `racy_seconds` of a file's last change might miss a rewrite in the same clock tick (git's "racy clean" files):
    its fingerprint is hashed again, and the index checked only if it differs. The fingerprint keys the cache, so
    the build waits for it; the check reads the index again and can run beside the build."""
    version = dataset.version()
    key = {"format": CACHE_FORMAT, "class": "IndexCheck", "version": version}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    path = None if cache_dir is None else os.path.join(cache_dir, f"{digest}-IndexedDataset-checked.json")
    try:
        with open(path) as f:
            record = json.load(f)
        if record["key"] == key:
            newest_change = max(max(times[1:3]) for times in version["files"]) / 1e9
            if record["written"] - newest_change > racy_seconds or dataset.fingerprint == record["fingerprint"]:
                dataset.fingerprint = record["fingerprint"]  # what the hash of these very files gave
                return None
    except (OSError, ValueError, KeyError, TypeError):  # no cache, no record, or one that does not load: check
        pass
    fingerprint = dataset.fingerprint  # hashed here, before the build asks for it

    def check_and_record():
        dataset.check()
        if path is not None and node_leader():
            try:
                os.makedirs(cache_dir, exist_ok=True)
            except OSError as error:
                raise WriteError(error.errno, error.strerror, cache_dir) from None
            CacheWrites.submit(write_json, path, {"key": key, "fingerprint": fingerprint, "written": time.time()})

    return check_and_record


def write_json(path, content):
    with atomic_write(path, "w") as f:
        json.dump(content, f, indent=1)


def cache_dirs(prefixes, cache_dir, fallback_cache_dir, blended):
    """(a directory per prefix, one for the blends if `blended`): `cache_dir`; else beside the data as megatron-core
    keeps them (the blends beside the first prefix); where that is read-only, `fallback_cache_dir` (None: in memory)."""
    if cache_dir is not None:
        return [cache_dir] * len(prefixes), cache_dir

    def beside(prefix, kind):
        path = parent = os.path.join(prefix, "cache", f"{kind}_indices")
        while not os.path.exists(parent):  # writable if its nearest existing ancestor is a writable directory
            parent = os.path.dirname(parent) or "."
        if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return path
        if fallback_cache_dir is None:
            log(f"{path}: not writable and no fallback cache directory: the indices are not kept")
        return fallback_cache_dir

    return [beside(p, "GPTDataset") for p in prefixes], beside(prefixes[0], "BlendedDataset") if blended else None


def release_free_memory():
    """Hand the free pages of the C heap back to the OS (glibc's malloc_trim; elsewhere nothing). glibc keeps much
    of what numpy frees, per thread: with a blend built in a thread beside the datasets, what one build freed would
    stay resident through the next and raise the peak (10BT: 515 -> 473 MiB)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # no such function, or no C library to ask (Windows)
        pass


# Datasets: training samples, validation windows in order, and the training sampler
class GPTDataset:
    """megatron-core's GPTDataset of sequences [begin, end); without `add_extra_token` the last label is -100."""

    def __init__(self, dataset, begin, end, *, seq_length, num_samples, seed, add_extra_token=True, split="train",
                 cache_dir=None):
        self.dataset, self.seq_length, self.extra = dataset, seq_length, int(add_extra_token)
        key = {"format": CACHE_FORMAT, "class": "GPTDataset", "split": split, "source": dataset.fingerprint,
               "sequences": [begin, end], "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
               "add_extra_token": bool(self.extra)}
        # the key less num_samples, plus what num_samples decides: equal orders are equal index arrays
        tokens_per_epoch = int(np.sum(dataset.sequence_lengths[begin:end], dtype=np.int64))
        num_epochs, separate = epochs(tokens_per_epoch, seq_length=seq_length, num_samples=num_samples, extra=self.extra)
        self.order = {k: v for k, v in key.items() if k not in ("format", "num_samples")}
        self.order.update(epochs=num_epochs, separate_final_epoch=separate)
        self.build_seconds = None  # how long the build took; None when the cache had it

        def build():
            t0 = time.perf_counter()
            arrays = gpt_indices(dataset.sequence_lengths, begin, end, seq_length=seq_length, num_samples=num_samples,
                                 seed=seed, add_extra_token=add_extra_token)
            release_free_memory()
            self.build_seconds = time.perf_counter() - t0
            return arrays

        arrays = cached(cache_dir, f"GPTDataset-{split}", key, build)
        self.document_index, self.sample_index, self.shuffle_index = arrays.values()

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, i):
        j = self.shuffle_index[i]
        (first, first_offset), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        pieces = [self.dataset.get(self.document_index[k]) for k in range(first, last + 1)]  # views: nothing is read
        pieces[-1] = pieces[-1][:last_offset + self.extra]  # the end first: the sample may lie in one sequence
        pieces[0] = pieces[0][first_offset:]
        text = np.concatenate(pieces, dtype=np.int64)
        if len(text) != self.seq_length + self.extra:  # the index under the sample changed
            raise self.dataset.changed(f"sample {i} has {len(text)} tokens, not {self.seq_length + self.extra}")
        labels = text[1:] if self.extra else np.append(text[1:], -100)  # megatron pads the last label and masks it
        return {"tokens": text[:len(labels)], "labels": labels}

    def describe(self, i):
        """Where sample i comes from, e.g. "data/a_text_document: documents 12, 7 (sample 77)"."""
        j = self.shuffle_index[i]
        (first, _), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        sequences = self.document_index[first:last + (last_offset + self.extra > 0)]
        return f"{self.dataset.path_prefix}: {self.dataset.documents(sequences)} (sample {i})"


def cached_blending_indices(weights, size, *, split="train", cache_dir=None, names=(), stop=None):
    """BlendedDataset's arrays (dataset_index, dataset_sample_index) for `weights` and `size` (without a size, the
    weights are exact counts), kept in `cache_dir`; the datasets are not needed, so they can be built beside it.
    `names`: the datasets' prefixes, for the log; `stop`: a threading.Event that ends the build (blending_indices)."""
    if size is not None:
        weights = normalize(weights)  # again, as megatron does
    key = {"format": CACHE_FORMAT, "class": "BlendedDataset", "split": split, "weights": weights, "size": size}

    def build():
        t0 = time.time()
        dataset_index, dataset_sample_index = blending_indices(weights, size, stop=stop)
        log(f"{split} blend of {len(weights)} datasets, {len(dataset_index)} samples, built in "
            f"{time.time() - t0:.2f}s")
        draws = sum(np.bincount(dataset_index[k:k + (1 << 20)], minlength=len(weights))  # bounded temporaries
                    for k in range(0, len(dataset_index), 1 << 20))
        if len(weights) <= 8:
            for name, weight, drawn in zip(names, normalize(weights), draws):
                log(f"{split} blend: {name}: weight {weight:.4g}, {drawn:,} samples")
        else:  # a few lines at any scale
            log(f"{split} blend: weights {min(normalize(weights)):.4g} to {max(normalize(weights)):.4g}, "
                f"{draws.min():,} to {draws.max():,} samples per dataset")
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    arrays = cached(cache_dir, f"BlendedDataset-{split}", key, build)
    return arrays["dataset_index"], arrays["dataset_sample_index"]


class BlendedDataset:
    """megatron-core's BlendedDataset: sample i is sample `dataset_sample_index[i]` of `datasets[dataset_index[i]]`."""

    def __init__(self, datasets, weights, size, *, split="train", cache_dir=None, indices=None):
        """`indices`: what cached_blending_indices(weights, size, ...) returned, when built beside the datasets."""
        self.datasets = datasets
        if indices is None:
            indices = cached_blending_indices(weights, size, split=split, cache_dir=cache_dir,
                                    names=[d.dataset.path_prefix for d in datasets])
        self.dataset_index, self.dataset_sample_index = indices
        # the size only cuts the greedy draw short (without one, the draw differs): what decides the first samples
        self.order = {"weights": normalize(weights) if size is not None else weights, "exhaustive": size is None,
                      "datasets": [d.order for d in datasets]}

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        return self.datasets[self.dataset_index[i]][self.dataset_sample_index[i]]

    def describe(self, i):
        """Where sample i comes from: a sample of one of the blended datasets."""
        return f"{self.datasets[self.dataset_index[i]].describe(self.dataset_sample_index[i])}, blend sample {i}"


def first_samples_agree(a, b, count, block=1 << 20):
    """Whether samples [0, count) of the GPT or blended datasets `a` and `b` are the same samples in the same order:
    the same datasets and sample numbers, and under them the same sequences at the same offsets (a comparison of the
    index entries those samples reach, `block` samples at a time: no tokens are read)."""
    if type(a) is not type(b) or min(len(a), len(b)) < count:
        return False
    if isinstance(a, BlendedDataset):
        if len(a.datasets) != len(b.datasets):
            return False
        draws = np.zeros(len(a.datasets), dtype=np.int64)
        for first in range(0, count, block):  # each dataset's samples are drawn in order: 0, 1, 2, ...
            last = min(first + block, count)
            if not (np.array_equal(a.dataset_index[first:last], b.dataset_index[first:last]) and
                    np.array_equal(a.dataset_sample_index[first:last], b.dataset_sample_index[first:last])):
                return False
            draws += np.bincount(a.dataset_index[first:last], minlength=len(a.datasets))
        return all(first_samples_agree(x, y, int(n)) for x, y, n in zip(a.datasets, b.datasets, draws, strict=True))
    if (a.dataset.fingerprint, a.seq_length, a.extra) != (b.dataset.fingerprint, b.seq_length, b.extra):
        return False
    for first in range(0, count, block):
        rows = []
        for ds in (a, b):  # each sample's first and last rows of the sample index, and the sequences between them
            j = np.asarray(ds.shuffle_index[first:min(first + block, count)], dtype=np.int64)
            starts, ends = np.asarray(ds.sample_index[j], np.int64), np.asarray(ds.sample_index[j + 1], np.int64)
            rows.append((starts, ends, ds.document_index))
        (starts_a, ends_a, documents_a), (starts_b, ends_b, documents_b) = rows
        if not (np.array_equal(starts_a[:, 1], starts_b[:, 1]) and np.array_equal(ends_a[:, 1], ends_b[:, 1]) and
                np.array_equal(ends_a[:, 0] - starts_a[:, 0], ends_b[:, 0] - starts_b[:, 0])):
            return False
        spans = ends_a[:, 0] - starts_a[:, 0] + 1  # positions start..end of each sample in either document index
        steps = np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans)
        if not np.array_equal(documents_a[np.repeat(starts_a[:, 0], spans) + steps],
                              documents_b[np.repeat(starts_b[:, 0], spans) + steps]):
            return False
    return True


def build_gpt_datasets(paths, *, seq_length, split="969,30,1", seed=1234, sizes=(None, None, None), cache_dir=None,
                       fallback_cache_dir=None):
    """(train, valid, test), each None without samples, as megatron-core's BlendedMegatronDatasetBuilder builds them
    from `paths` (resolve_blend) and `sizes` (samples per split, None: one epoch); cached (cache_dirs) by rank 0."""
    if not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
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
        weights = normalize(weights)
    dirs, blend_dir = cache_dirs(prefixes, cache_dir, fallback_cache_dir, len(prefixes) > 1 or weights is not None)
    rank, world_size = distributed()
    stop_building = threading.Event()

    def gpt_split(d, i, num_samples):
        """The GPTDataset of split i of datasets[d], or None when it yields no samples."""
        dataset = datasets[d]
        begin, end = split_range(len(dataset), matrix[i])
        if not dataset.sequence_lengths[begin:end].any():
            if num_samples:  # megatron-core loops forever here
                raise ValueError(f"{dataset.path_prefix}: its {SPLITS[i]} split ({split!r} of {len(dataset)} "
                                 f"sequences: [{begin}, {end})) has no tokens, but {num_samples} samples were asked")
            return None
        ds = GPTDataset(dataset, begin, end, seq_length=seq_length, num_samples=num_samples, seed=seed,
                        split=SPLITS[i], cache_dir=dirs[d])
        return ds if len(ds) else None

    def split_dataset(i, pool):
        if matrix[i] is None:
            return None
        t0 = time.perf_counter()
        blended = blended_split(i, pool)
        parts = getattr(blended, "datasets", [blended] if blended is not None else [])
        built = [part for part in parts if part.build_seconds is not None]
        if built:  # one line per split, whatever the number of prefixes
            where = built[0].dataset.path_prefix if len(parts) == 1 else f"{len(built)} of {len(parts)} prefixes"
            log(f"{where}: {SPLITS[i]} indices, {sum(len(p) for p in built):,} samples of {seq_length} tokens from "
                f"{sum(len(p.document_index) for p in built):,} sequences, built in "
                f"{sum(p.build_seconds for p in built):.2f}s ({time.perf_counter() - t0:.2f}s for the whole split)")
        return blended

    def blended_split(i, pool):
        if weights is None and len(prefixes) == 1:
            return gpt_split(0, i, sizes[i])
        indices = None
        if weights is not None:  # samples per dataset: blended (target), and built with megatron's 0.5% surplus
            targets = [math.ceil(sizes[i] * w) for w in weights]
            blend_weights, blend_size = weights, sum(targets)
            if blend_size:  # the blend's index needs no dataset: a thread builds it beside them
                indices = pool.submit(cached_blending_indices, blend_weights, blend_size, split=SPLITS[i],
                                      cache_dir=blend_dir, names=prefixes, stop=stop_building)
            parts = [gpt_split(d, i, math.ceil(target * (1 + 0.005))) for d, target in enumerate(targets)]
        else:  # one epoch of each, in proportion to their samples
            parts = [gpt_split(d, i, None) for d in range(len(datasets))]
            blend_weights = [0 if part is None else len(part) for part in parts]
            blend_size = None if sizes[i] is None else min(sizes[i], sum(blend_weights))
            if sizes[i] is not None and blend_size < sizes[i]:
                log(f"{SPLITS[i]}: an unweighted blend is one epoch of each prefix, {blend_size} samples, fewer than "
                    f"the {sizes[i]} asked (token_weighted_blend gives a blend that can be repeated)")
        if blend_size == 0 or sum(blend_weights) == 0:
            return None
        if None in parts:  # megatron-core cannot blend an empty dataset either (it asserts)
            raise ValueError(f"{prefixes[parts.index(None)]}: its {SPLITS[i]} split ({split!r}) has no samples of "
                             f"{seq_length} tokens, so it cannot take part in the blend")
        return BlendedDataset(parts, blend_weights, blend_size, split=SPLITS[i], cache_dir=blend_dir,
                              indices=None if indices is None else indices.result())

    def build():
        with CacheWrites(), concurrent.futures.ThreadPoolExecutor() as pool:
            # the files are hashed side by side (the fingerprints key the cache); the checks then run in a thread of
            # their own, and a weighted blend's index in another (blended_split), beside the datasets' builds
            owed = [check for check in pool.map(check_once, datasets, dirs) if check is not None]
            checks = pool.submit(lambda: [check() for check in owed])
            try:
                splits = tuple(split_dataset(i, pool) for i in range(3))
            except BaseException as error:  # also Ctrl-C
                stop_building.set()  # a blend being built beside stops within a fraction of a second, not minutes
                if isinstance(error, Exception):
                    checks.result()  # a corrupt index explains a failed build best
                raise
            checks.result()  # before any sample is read
            return splits

    if world_size == 1 or all(d is None for d in dirs + [blend_dir]):
        return build()
    # In turns, so that whatever a rank reads exists on its node: global rank 0 builds and writes the cache, then the
    # leader of every other node (local rank 0) loads it, or builds and writes it where the nodes share no
    # filesystem, then the other ranks map what their node's leader wrote. A failure reaches every rank: none waits.
    import torch.distributed as dist  # a process group exists, so torch is already imported
    turn = 0 if rank == 0 else 1 if node_leader() else 2
    result = raised = None
    for current in range(3):
        failure = None
        if turn == current:
            try:
                result = build()
            except Exception as error:
                failure, raised = f"{type(error).__name__}: {error}", error
        failures = [None] * world_size
        dist.all_gather_object(failures, failure)
        for other, message in enumerate(failures):
            if message is not None:
                raise raised if other == rank else RuntimeError(f"rank {other} could not build the datasets: "
                                                                f"{message}")
    return result


class TokenWindows:
    """Window k of the stream `lead` + `pieces` [(dataset, sequence ids), ...] is stream[k*T : k*T + T + 1] as
    {"tokens": its first T, "labels": its last T}, as llm.c reads; as many as the stream holds, at most `length`."""

    def __init__(self, pieces, seq_length, length=None, lead=()):
        self.pieces, self.seq_length, self.lead = pieces, seq_length, np.asarray(lead, dtype=np.int64)
        self.piece_starts, self.num_tokens = [], len(self.lead)  # where each piece's sequences start; the stream's end
        for dataset, sequences in pieces:
            starts = self.num_tokens + np.cumsum(np.r_[0, dataset.sequence_lengths[sequences]], dtype=np.int64)
            self.num_tokens = int(starts[-1])
            self.piece_starts.append(starts)
        self.length = min(max(0, (self.num_tokens - 1) // seq_length), math.inf if length is None else length)

    def __len__(self):
        return self.length

    def _window(self, i):
        """Window i's stream range [start, stop) and the (dataset, sequences, starts, positions in both) it reads."""
        start = range(self.length)[i] * self.seq_length  # an IndexError past the end; negative i counts from it
        stop, spans = start + self.seq_length + 1, []
        for (dataset, sequences), starts in zip(self.pieces, self.piece_starts):
            if starts[0] < stop and starts[-1] > start:
                first = max(np.searchsorted(starts, start, side="right") - 1, 0)
                last = min(np.searchsorted(starts, stop), len(sequences))
                spans.append((dataset, sequences, starts, range(first, last)))
        return start, stop, spans

    def __getitem__(self, i):
        start, stop, spans = self._window(i)
        parts = [self.lead[start:stop]]
        for dataset, sequences, starts, positions in spans:
            for k in positions:
                parts.append(dataset.get(sequences[k])[max(start - starts[k], 0):stop - starts[k]])
        text = np.concatenate(parts, dtype=np.int64)
        if len(text) != stop - start:  # the index under the window changed
            raise spans[-1][0].changed(f"window {i} has {len(text)} tokens, not {stop - start}")
        return {"tokens": text[:-1], "labels": text[1:]}

    def describe(self, i):
        """Where window i comes from, e.g. "data/val_text_document: documents 3, 4 (window 9)"."""
        spans = self._window(i)[2]
        where = "; ".join(f"{dataset.path_prefix}: {dataset.documents(sequences[positions.start:positions.stop])}"
                          for dataset, sequences, _, positions in spans)
        return f"{where} (window {i})"


class LLMCValWindows(TokenWindows):
    """llm.c's validation batches: num_tokens // seq_length windows of [eot] + every document of `path_prefix` (a
    prefix or glob) in file order. llm.c puts the EOT before each document and we after, so this is its val shard."""

    def __init__(self, path_prefix, seq_length, num_tokens, eot=EOT):
        prefixes, windows = resolve_blend(path_prefix)[0], num_tokens // seq_length
        super().__init__([(ds, np.arange(len(ds))) for ds in map(IndexedDataset, prefixes)], seq_length, windows, [eot])
        if len(self) < windows:
            raise ValueError(f"{', '.join(p + '.bin' for p in prefixes)}: the stream holds {self.num_tokens} tokens "
                             f"with the leading EOT, fewer than the {windows * seq_length + 1} that {windows} windows "
                             f"of {seq_length} need")


def sequential_samples(paths, *, seq_length, split="969,30,1", split_index=1, max_samples=None):
    """One split's sequences in order (blend weights ignored) as TokenWindows, to validate on; None for a zero ratio."""
    prefixes, _ = resolve_blend(paths)
    bookends = split_matrix(split)[split_index]
    if bookends is None:
        return None
    pieces = [(ds, np.arange(*split_range(len(ds), bookends))) for ds in map(IndexedDataset, prefixes)]
    samples = TokenWindows(pieces, seq_length, max_samples)
    if samples.num_tokens < seq_length + 1:
        raise ValueError(f"{', '.join(prefixes)}: the {SPLITS[split_index]} split ({split!r}) holds "
                         f"{samples.num_tokens} tokens, less than one window of seq_length + 1 = {seq_length + 1}")
    return samples


class PretrainingSampler:
    """One rank's micro-batches, as megatron's MegatronPretrainingSampler (a batch_sampler): rank r takes the r-th mbs
    of each full global batch of mbs*W after `consumed_samples`, so a restart on any world size continues in place."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, rank, world_size):
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= rank < world_size, got {micro_batch_size}, "
                             f"{rank}, {world_size}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside [0, total_samples={total_samples}]")
        self.micro_batch_size, self.global_batch = micro_batch_size, micro_batch_size * world_size
        self.first = consumed_samples + rank * micro_batch_size  # this rank's first sample of each global batch
        self.steps = (total_samples - consumed_samples) // self.global_batch

    def __iter__(self):
        for first in range(self.first, self.first + self.steps * self.global_batch, self.global_batch):
            yield list(range(first, first + self.micro_batch_size))


# The command line
def verify(prefixes, vocab_size=None, read_tokens=True):
    """Print each prefix's counts and sizes (opening checks its index) and with `read_tokens` its ids; the problems."""
    problems, totals = [], np.zeros(3, dtype=np.int64)
    for prefix in prefixes:
        try:
            ds = IndexedDataset(prefix)
            if read_tokens and not ds.num_tokens:
                raise ValueError(f"{prefix}.bin: no tokens ({ds.num_documents} documents): megatron-core cannot map "
                                 f"an empty .bin")
        except (ValueError, FileNotFoundError) as error:
            problems.append(str(error))
            continue
        counts, lengths = np.array([ds.num_documents, len(ds), ds.num_tokens]), ds.sequence_lengths
        totals += counts
        line = (f"{prefix}: {counts[0]:,} documents, {counts[1]:,} sequences, {counts[2]:,} tokens ({ds.dtype}); "
                f".bin {ds.sizes['.bin']:,} bytes, .idx {ds.sizes['.idx']:,} bytes")
        if len(lengths):
            line += f", sequence length min {lengths.min():,} mean {lengths.mean():,.1f} max {lengths.max():,}"
        if read_tokens:
            parts = np.array_split(ds.tokens, len(ds.tokens) // (1 << 26) + 1)  # each still cached for its max
            ranges = np.array([(part.min(), part.max()) for part in parts])
            low, high = int(ranges.min()), int(ranges.max())
            line += f", ids in [{low}, {high}]"
            if vocab_size is not None and not 0 <= low <= high < vocab_size:
                problems.append(f"{prefix}.bin: token ids span [{low}, {high}], outside the vocabulary "
                                f"[0, {vocab_size})")
        print(line)
    if len(prefixes) > 1:
        print(f"total of {len(prefixes)} prefixes: {totals[0]:,} documents, {totals[1]:,} sequences, "
              f"{totals[2]:,} tokens")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description="Inspect Megatron indexed datasets (<prefix>.bin + <prefix>.idx).")
    parser.add_argument("command", choices=["info", "verify"],
                        help="info: counts, dtype and sizes; verify: check the index and read every token")
    parser.add_argument("paths", metavar="PREFIX_OR_GLOB", nargs="+")
    parser.add_argument("--vocab-size", type=int, default=None, help="verify: fail on token ids >= this")
    args = parser.parse_args(argv)
    # one prefix or quoted glob, or the files an unquoted glob expanded to
    paths = [p[:-4] if p.endswith((".bin", ".idx")) else p for p in args.paths]
    try:
        prefixes = resolve_blend(paths[0])[0] if len(paths) == 1 else sorted(set(paths))
        problems = verify(prefixes, args.vocab_size, read_tokens=args.command == "verify")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
