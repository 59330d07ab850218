"""Megatron-Core indexed datasets and GPT sampling in plain numpy: the same .bin/.idx bytes, and the
same samples in the same order, as megatron-core 0.16.1's IndexedDataset, GPTDataset and
BlendedDataset (tests/ compare them).

The .idx (little-endian, packed): magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 |
sequence count S u64 | document count D u64 (with a leading 0) | sequence lengths i32[S] | their byte
offsets in the .bin i64[S] | document boundaries i64[D]; the .bin is the tokens.
`python indexed_dataset.py info|verify PREFIX_OR_GLOB` inspects files. docs/data.md says more."""
import argparse
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import re
import struct
import sys
import time
import zlib
from array import array

import numpy as np

from atomic_io import WriteError, atomic_write, remove_stale_temporaries

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
DTYPE_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
SPLITS = ("train", "valid", "test")
EOT = 50256  # GPT-2's <|endoftext|>, which ends every document of prepare_fineweb.py's files
# Bump when the cached arrays, their key or their description change meaning, so old entries are
# rebuilt rather than misread.
CACHE_FORMAT = 4
# blending_indices works in chunks of CHUNK steps, each started WARM_UP steps early.
CHUNK, WARM_UP = 2048, 64
# What an error about missing data adds.
MISSING_DATA = "write the token files with prepare_fineweb.py (see its --help), or check the path"


def distributed():
    """(rank, world size) of the initialized torch.distributed group, else (0, 1). It never
    imports torch itself, so that the data tools start without it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def node_leader():
    """Whether this process builds and writes the index cache for its node: torchrun's local rank 0
    (every node has one, whether or not the nodes share a filesystem), else global rank 0."""
    rank, world_size = distributed()
    local_rank = os.environ.get("LOCAL_RANK")
    if world_size == 1 or local_rank is None:
        return rank == 0
    return local_rank == "0"


def usable_cores():
    """The CPU cores this process may run on (its affinity, which a scheduler may narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def log(message):
    if distributed()[0] == 0:
        print(f"indexed_dataset: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# The .bin/.idx files

def file_sha256(path):
    """The SHA-256 of a file, read in blocks rather than mapped, so that its pages do not stay in
    this process's memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def check_header(idx_path, header, idx_size):
    """(dtype code, sequence count, boundary count) of a .idx header; ValueError naming the file
    unless the header is whole and its counts fit the file's size."""
    # A magic cut short is a truncated file, not a foreign one.
    if not (header.startswith(INDEX_MAGIC) or INDEX_MAGIC.startswith(header)):
        raise ValueError(f"{idx_path}: not a Megatron indexed dataset index "
                         f"(it starts with {header[:9]!r})")
    if len(header) < HEADER.size:
        raise ValueError(f"{idx_path}: truncated: {idx_size} bytes, "
                         f"less than the {HEADER.size}-byte header")
    _, version, code, count, num_boundaries = HEADER.unpack(header)
    if version != 1:
        raise ValueError(f"{idx_path}: unsupported index version {version} (only version 1 exists)")
    if code not in DTYPES:
        raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    if num_boundaries < 1:
        raise ValueError(f"{idx_path}: document count is 0; it must count at least the leading "
                         f"boundary 0")
    expected = HEADER.size + 12 * count + 8 * num_boundaries
    counts = f"{count} sequences and {num_boundaries - 1} documents"
    if idx_size < expected:
        raise ValueError(f"{idx_path}: truncated: its header announces {counts}: "
                         f"{expected} bytes, not {idx_size}")
    # Multimodal data adds one mode byte per sequence after the boundaries.
    if idx_size not in (expected, expected + count):
        raise ValueError(f"{idx_path}: {idx_size - expected} bytes after the document boundaries "
                         f"({counts})")
    return code, count, num_boundaries


class IndexedDataset:
    """Memory-mapped `<path_prefix>.bin` + `.idx`: `ds[i]` is a read-only view of sequence i.
    Opening checks that the files agree; `check` also checks every pointer of the index."""

    def __init__(self, path_prefix, check=True):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        for path in (idx_path, bin_path):
            if os.path.isfile(path):
                continue
            if self.path_prefix.endswith((".bin", ".idx")):
                raise FileNotFoundError(f"{path}: no such file (give the prefix, without .bin/.idx)")
            raise FileNotFoundError(f"{path}: no such file; {MISSING_DATA}")
        # The .bin stays open so that every read can ask its size without a path lookup.
        self.bin_file = open(bin_path, "rb")
        bin_size = os.fstat(self.bin_file.fileno()).st_size
        idx_size = os.path.getsize(idx_path)
        self.sizes = {".bin": bin_size, ".idx": idx_size}
        with open(idx_path, "rb") as f:
            header = f.read(HEADER.size)
        code, count, num_boundaries = check_header(idx_path, header, idx_size)
        self.dtype, self.num_documents = np.dtype(DTYPES[code]), num_boundaries - 1
        self._index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(self._index, "<i4", count, HEADER.size)
        self.sequence_pointers = np.frombuffer(self._index, "<i8", count, HEADER.size + 4 * count)
        self.document_indices = np.frombuffer(self._index, "<i8", num_boundaries,
                                              HEADER.size + 12 * count)
        if self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(f"{idx_path}: corrupt: document boundaries run from "
                             f"{self.document_indices[0]} to {self.document_indices[-1]}, "
                             f"not from 0 to the sequence count {count}")
        if check:
            self.check()
        self.check_bin_size(bin_size)
        if bin_size:
            # Every token in file order, as a plain view: slicing a memmap costs more.
            self.tokens = np.memmap(bin_path, self.dtype, "r").view(np.ndarray)
        else:
            self.tokens = np.empty(0, self.dtype)  # an empty file cannot be mapped

    def check_bin_size(self, bin_size):
        """ValueError unless the .bin holds exactly every sequence: it ends where the last one
        does (check() vouches for the last pointer)."""
        bin_path = self.path_prefix + ".bin"
        if bin_size % self.dtype.itemsize:
            raise ValueError(f"{bin_path}: {bin_size} bytes is not a whole number of "
                             f"{self.dtype} tokens")
        expected = 0
        if len(self):
            last_length = int(self.sequence_lengths[-1]) * self.dtype.itemsize
            expected = int(self.sequence_pointers[-1]) + last_length
        if bin_size < expected:
            raise ValueError(f"{bin_path}: {bin_size} bytes, shorter than the {expected} bytes "
                             f"its index {self.path_prefix}.idx says")
        if bin_size > expected:
            raise ValueError(f"{bin_path}: {bin_size} bytes, longer than the {expected} bytes "
                             f"its index {self.path_prefix}.idx says")

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, i, offset=0, length=None):
        """`length` tokens (default: to the end) of sequence i, starting `offset` tokens into it."""
        # A read past the end of a .bin cut short under its mapping kills the process (SIGBUS);
        # one fstat per read turns that into an error naming the file.
        size = os.fstat(self.bin_file.fileno()).st_size
        if size < self.sizes[".bin"]:
            raise ValueError(f"{self.path_prefix}.bin: shrank from {self.sizes['.bin']} to {size} "
                             f"bytes while the run read it; restore the file (or write new data "
                             f"under a new name) and resume from the last checkpoint")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + int(offset)
        if length is None:
            length = int(self.sequence_lengths[i]) - int(offset)
        return self.tokens[start:start + int(length)]

    __getitem__ = get

    @property
    def num_tokens(self):
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @functools.cached_property
    def fingerprint(self):
        """What changes when the data is replaced: a hash of the index and the .bin's size (the
        tokens are not read). check_once may set it from a record of these very files."""
        return f"{file_sha256(self.path_prefix + '.idx')[:32]}-{self.sizes['.bin']}"

    def version(self):
        """What tells one version of the files from another without reading them, as make and git
        judge a file unchanged: each file's size, modification and change times (ns) and inode."""
        stats = [os.stat(self.path_prefix + suffix) for suffix in (".idx", ".bin")]
        files = [[st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for st in stats]
        return {"prefix": os.path.abspath(self.path_prefix), "files": files}

    def documents(self, sequences):
        """The documents holding tokens of `sequences` (an array), as "documents 7, 3", numbered
        from 0 in file order."""
        nonempty = sequences[self.sequence_lengths[sequences] > 0]
        held = np.searchsorted(self.document_indices, nonempty, "right") - 1
        return "documents " + ", ".join(map(str, dict.fromkeys(held.tolist())))

    def changed(self, why):
        """The error for files rewritten in place while open (a sample of the wrong length)."""
        for suffix, size in self.sizes.items():
            path = self.path_prefix + suffix
            now = 0
            if os.path.exists(path):
                now = os.path.getsize(path)
            if now != size:
                why += f"; its {suffix} had {size} bytes, now {now}"
        return ValueError(f"{self.path_prefix}: changed on disk since it was opened ({why})")

    def _int64s(self, f, offset, count):
        return np.frombuffer(os.pread(f.fileno(), 8 * count, offset), "<i8")

    def check(self, block=1 << 20):
        """ValueError naming the .idx unless the document boundaries never fall and each pointer is
        the sum of the lengths before it. The pointers and boundaries are read `block` at a time
        rather than through the mapping, whose pages would otherwise stay in memory (16 bytes a
        sequence) though nothing else reads them."""
        idx_path, count = self.path_prefix + ".idx", len(self.sequence_lengths)
        pointers_at, boundaries_at = HEADER.size + 4 * count, HEADER.size + 12 * count
        num_boundaries = len(self.document_indices)
        with open(idx_path, "rb") as f:
            previous = 0
            for first in range(0, num_boundaries, block):
                size = min(block, num_boundaries - first)
                boundaries = self._int64s(f, boundaries_at + 8 * first, size)
                if boundaries[0] < previous or (np.diff(boundaries) < 0).any():
                    raise ValueError(f"{idx_path}: corrupt: document boundaries decrease")
                previous = boundaries[-1]
            start = 0
            for first in range(0, count, block):
                sizes = self.sequence_lengths[first:first + block].astype(np.int64)
                if sizes.min() < 0:
                    raise ValueError(f"{idx_path}: corrupt: sequence {first + np.argmin(sizes)} "
                                     f"has a negative length {sizes.min()}")
                sizes *= self.dtype.itemsize
                starts = np.cumsum(sizes) - sizes + start
                start = int(starts[-1] + sizes[-1])
                pointers = self._int64s(f, pointers_at + 8 * first, len(sizes))
                wrong = np.flatnonzero(pointers != starts)
                if wrong.size:
                    k = wrong[0]
                    raise ValueError(f"{idx_path}: corrupt: sequence {first + k} starts at byte "
                                     f"{pointers[k]} of the .bin, but the lengths before it put it "
                                     f"at byte {starts[k]} ({self.dtype} tokens): a wrong dtype "
                                     f"code or damaged pointers")


class IndexedDatasetBuilder:
    """Writer of `<prefix>.bin` and, at `finalize`, `<prefix>.idx`, byte for byte as
    megatron-core's."""

    def __init__(self, bin_path, dtype=np.uint16):
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype)  # one of DTYPES
        # No reader accepts the .bin of an interrupted build without its old index.
        if self.bin_path.endswith(".bin") and os.path.exists(self.bin_path[:-4] + ".idx"):
            os.remove(self.bin_path[:-4] + ".idx")
        self._bin = open(self.bin_path, "wb")
        self.sequence_lengths, self.document_indices = array("q"), array("q", [0])

    def add_document(self, tokens, lengths=None):
        """Append 1-D `tokens` as a document of sequences of `lengths` (default: one sequence, or
        none if the document is empty, as Megatron does)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.bin_path}: a document must be a 1-D token array, "
                             f"got shape {tokens.shape}")
        # The range check costs more than the write: skip it when every value of the input dtype
        # fits (uint16 into uint16).
        if tokens.size and self.dtype.kind in "iu" and not np.can_cast(tokens.dtype, self.dtype):
            if tokens.dtype.kind not in "iub":
                raise ValueError(f"{self.bin_path}: tokens must be integers, got {tokens.dtype}")
            bad = tokens[tokens.astype(self.dtype) != tokens]
            if bad.size:
                raise ValueError(f"{self.bin_path}: token {bad[0]} does not fit this dataset's "
                                 f"dtype {self.dtype}")
        if lengths is not None:
            lengths = [int(n) for n in lengths]
        elif tokens.size:
            lengths = [tokens.size]
        else:
            lengths = []
        if any(n < 0 for n in lengths) or sum(lengths) != tokens.size:
            raise ValueError(f"{self.bin_path}: sequence lengths {lengths} do not add up to the "
                             f"{tokens.size} tokens")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path):
        """Close the .bin and write the index to `idx_path`."""
        self._bin.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        boundaries = np.frombuffer(self.document_indices, dtype=np.int64)
        pointers = (np.cumsum(lengths) - lengths) * self.dtype.itemsize
        header = HEADER.pack(INDEX_MAGIC, 1, DTYPE_CODES[self.dtype], len(lengths), len(boundaries))
        with atomic_write(idx_path) as f:
            f.write(header)
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(boundaries.astype("<i8").tobytes())


# ------------------------------------------------------------------------------------------------
# Which prefixes, which weights, which part of each, and the index arrays of each dataset

def resolve_blend(paths):
    """(prefixes, weights or None) for a prefix, a list of them, a Megatron blend list like
    ["30", p0, "70", p1], or a glob, which gives the sorted prefixes of the .bin/.idx files or
    the prefixes it matches (as NeMo AutoModel does)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = str(paths)
        if not glob.has_magic(paths):
            return [paths], None
        matches = glob.glob(paths) + glob.glob(paths + ".bin") + glob.glob(paths + ".idx")
        prefixes = sorted({m[:-4] for m in matches if m.endswith((".bin", ".idx"))})
        if not prefixes:
            raise FileNotFoundError(f"{paths}: the glob matches no .bin/.idx files; {MISSING_DATA}")
        return prefixes, None
    entries = [str(p).strip() for p in paths]
    if not entries:
        raise ValueError("the blend list is empty")
    numbers = []
    for entry in entries:
        try:
            numbers.append(float(entry))
        except ValueError:
            numbers.append(None)
    if numbers.count(None) == len(numbers):
        return entries, None
    weights = numbers[0::2]
    alternate = "it must alternate weight, prefix (or list only prefixes)"
    if len(entries) % 2:
        raise ValueError(f"blend list {entries}: {len(entries)} entries; {alternate}")
    if None in weights:
        bad = entries[2 * weights.index(None)]
        raise ValueError(f"blend list {entries}: weight {bad!r} is not a number; {alternate}")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"blend list {entries}: weights must be positive finite numbers, "
                         f"got {entries[0::2]}")
    # Normalizing an infinite sum would make every share 0.
    if not math.isfinite(sum(weights)):
        raise ValueError(f"blend list {entries}: the weights {entries[0::2]} add up to more than a "
                         f"float holds; scale them down (only their ratios count)")
    return entries[1::2], weights


def normalize(weights):
    """Weights divided by their sum in float64, as megatron normalizes them (bit for bit)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split):
    """Megatron's [(start, end) or None] * 3: the fractions of each prefix for train, valid and
    test, from a string like "969,30,1"."""
    numbers = re.findall(r"[.0-9]+", split)
    try:
        ratios = [float(n) for n in numbers] + [0.0] * (3 - len(numbers))
        leftover = re.sub(r"[.0-9]+", "", split).strip(" ,/:\t")
        if not 1 <= len(numbers) <= 3 or sum(ratios) <= 0 or leftover:
            raise ValueError
    except ValueError:
        raise ValueError(f"split {split!r}: expected up to three non-negative numbers like "
                         f"'969,30,1'") from None
    bookends = [0, *itertools.accumulate(normalize(ratios))]  # Python float sums, as megatron's
    matrix = []
    for start, end in zip(bookends[:-1], bookends[1:]):
        matrix.append((start, end) if end > start else None)
    return matrix


def split_range(num_sequences, bookends):
    """The [begin, end) sequence range that a split's (start, end) fractions cover, rounded with
    Python's round (half to even) as megatron does."""
    return tuple(int(round(fraction * float(num_sequences))) for fraction in bookends)


def token_weighted_blend(paths):
    """The blend [str(tokens of p0), p0, ...] of `paths`: unlike an unweighted list, it can go
    past one epoch."""
    prefixes, weights = resolve_blend(paths)
    if weights is not None:
        raise ValueError(f"{paths}: already weighted; token_weighted_blend weights a list of "
                         f"prefixes")
    blend = []
    for prefix in prefixes:
        # The build checks each index, once per version of the files.
        tokens = IndexedDataset(prefix, check=False).num_tokens
        if tokens == 0:
            raise ValueError(f"{prefix}.bin: holds no tokens, so it cannot take part in a "
                             f"token-weighted blend")
        blend += [str(tokens), prefix]
    return blend


def epochs(tokens_per_epoch, *, seq_length, num_samples, extra):
    """(epochs, whether the last is shuffled apart) that megatron's GPTDataset builds for
    `num_samples`. With the data, the seed and the lengths, this is all that its index arrays
    depend on: num_samples matters only through it."""
    num_epochs = 1
    if num_samples is not None:
        num_epochs = max(1, -(-(num_samples * seq_length + extra) // tokens_per_epoch))
    if num_epochs == 1:
        return num_epochs, False
    samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    samples_per_epoch = (tokens_per_epoch - extra) // seq_length
    final_epoch_samples = num_samples - samples_before_final_epoch
    return num_epochs, final_epoch_samples < int(0.80 * samples_per_epoch)


def one_epoch_samples(paths, *, seq_length, split, split_index=0, add_extra_token=True):
    """The samples of one epoch of split `split_index` of every prefix of `paths` together: all
    that an unweighted list of prefixes gives (megatron-core's cap), counted from the sequence
    lengths without building any index."""
    bookends = split_matrix(split)[split_index]
    if bookends is None:
        return 0
    total = 0
    for prefix in resolve_blend(paths)[0]:
        dataset = IndexedDataset(prefix, check=False)
        begin, end = split_range(len(dataset), bookends)
        tokens = int(np.sum(dataset.sequence_lengths[begin:end], dtype=np.int64))
        total += max(0, (tokens - int(add_extra_token)) // seq_length)
    return total


def gpt_index_layout(sequence_lengths, begin, end, *, seq_length, num_samples, add_extra_token):
    """{array: (dtype, shape)} of the index arrays that gpt_indices builds for these parameters;
    also what a cache entry of them must hold."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.sum(sequence_lengths[begin:end], dtype=np.int64))
    num_epochs, _ = epochs(tokens_per_epoch, seq_length=seq_length, num_samples=num_samples,
                           extra=extra)
    total_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    num_positions = num_epochs * (end - begin)
    int32_max = np.iinfo(np.int32).max
    sample_dtype = np.int32
    if max(num_positions, int(sequence_lengths.max(initial=0))) > int32_max:
        sample_dtype = np.int64
    shuffle_dtype = np.uint32
    if total_samples >= 2**32 - 2:
        shuffle_dtype = np.int64
    return {"document_index": (np.dtype(np.int32), (num_positions,)),
            "sample_index": (np.dtype(sample_dtype), (total_samples + 1, 2)),
            "shuffle_index": (np.dtype(shuffle_dtype), (total_samples,))}


def gpt_indices(sequence_lengths, begin, end, *, seq_length, num_samples, seed,
                add_extra_token=True):
    """megatron-core GPTDataset's {document_index, sample_index, shuffle_index} of sequences
    [begin, end), in epochs."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.sum(sequence_lengths[begin:end], dtype=np.int64))
    num_epochs, separate_final_epoch = epochs(tokens_per_epoch, seq_length=seq_length,
                                              num_samples=num_samples, extra=extra)
    samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    layout = gpt_index_layout(sequence_lengths, begin, end, seq_length=seq_length,
                              num_samples=num_samples, add_extra_token=add_extra_token)
    # Megatron draws in this order: the document shuffle(s), then the sample shuffle(s). A separate
    # final epoch is shuffled apart from the epochs before it (shuffling nothing draws nothing).
    rng = np.random.RandomState(seed)
    document_index = np.tile(np.arange(begin, end, dtype=np.int32), num_epochs)
    cut = (num_epochs - separate_final_epoch) * (end - begin)
    rng.shuffle(document_index[:cut])
    rng.shuffle(document_index[cut:])
    sample_index = np.zeros(layout["sample_index"][1], layout["sample_index"][0])
    fill_sample_index(sample_index, sequence_lengths[begin:end], begin, document_index,
                      seq_length=seq_length, extra=extra)
    total_samples = len(sample_index) - 1
    shuffle_index = np.arange(total_samples, dtype=layout["shuffle_index"][0])
    cut = total_samples
    if separate_final_epoch:
        cut = samples_before_final_epoch
    rng.shuffle(shuffle_index[:cut])
    rng.shuffle(shuffle_index[cut:])
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def fill_sample_index(sample_index, split_lengths, begin, document_index, *, seq_length, extra,
                      block=1 << 18):
    """Fill rows 1.. of `sample_index`: the (position in the document index, token offset in that
    sequence) where each sample starts. Megatron's C++ walks the documents one by one; here row k
    is found at once as the last sequence starting at or before token k * seq_length + extra - 1
    (empty ones are stepped over), i.e. the count of sequences whose first row is <= k, minus one.
    `block` rows at a time bound the temporaries."""
    # Gathering from an aligned int32 copy of the split's lengths is faster than from the mapping.
    sizes = np.array(split_lengths, dtype=np.int32)[document_index - begin]
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=starts[1:])
    del sizes  # before the rows below are made
    first_rows = starts + (seq_length - extra)
    first_rows //= seq_length
    total_rows = len(sample_index)
    for first in range(1, total_rows, block):
        last = min(first + block, total_rows)
        begun_before, begun_by_last = np.searchsorted(first_rows, [first, last])
        begun = np.bincount(first_rows[begun_before:begun_by_last] - first, minlength=last - first)
        sequence = np.cumsum(begun)
        sequence += begun_before - 1
        sample_index[first:last, 0] = sequence
        offsets = np.arange(first, last, dtype=np.int64) * seq_length - starts[sequence]
        sample_index[first:last, 1] = offsets


def blending_indices(weights, size=None):
    """megatron-core BlendedDataset's (dataset_index int16, dataset_sample_index int64). With
    `size`, step s draws the dataset maximising weights[d] * max(s, 1) - draws[d] (the first on
    ties, in float64); without, `weights` are exact counts to draw. Megatron's loop is sequential;
    here chunks of CHUNK steps run side by side from a guess of their starting draws, and each
    chunk that did not start where the one before it ended is run again from there until all
    agree, which gives the same arrays in a few vectorized passes."""
    if size is None:
        quotas = np.asarray(weights, dtype=np.int64)
        size, weights = int(quotas.sum()), quotas / float(quotas.sum())
    else:
        quotas, weights = None, np.asarray(weights, dtype=np.float64)
    num_chunks = -(-size // CHUNK)
    first_steps = np.arange(num_chunks, dtype=np.int64) * CHUNK
    # The guess of each chunk's starting draws: run WARM_UP steps from the ideal draws (floors,
    # plus one for the largest fractional parts) a little before the chunk starts.
    guess_steps = first_steps[1:] - WARM_UP
    ideal = weights * (guess_steps - 1)[:, None]
    guess = np.floor(ideal).astype(np.int64)
    rank = np.argsort(np.argsort(guess - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    guess += rank < (guess_steps - guess.sum(axis=1))[:, None]
    del ideal, rank
    if quotas is not None:
        np.minimum(guess, quotas, out=guess)
    start_draws = np.zeros((num_chunks, len(weights)), dtype=np.int64)  # exact for chunk 0
    warm_up = np.empty((len(guess), WARM_UP), np.int16), np.empty((len(guess), WARM_UP), np.int64)
    start_draws[1:] = greedy(weights, quotas, guess_steps, guess, *warm_up)
    del guess, warm_up
    dataset_index = np.empty((num_chunks, CHUNK), dtype=np.int16)
    dataset_sample_index = np.empty((num_chunks, CHUNK), dtype=np.int64)
    end_draws = greedy(weights, quotas, first_steps, start_draws, dataset_index,
                       dataset_sample_index)
    while True:
        todo = np.flatnonzero((start_draws[1:] != end_draws[:-1]).any(axis=1)) + 1
        if not todo.size:
            return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]
        start_draws[todo] = end_draws[todo - 1]
        picks, samples = dataset_index[todo], dataset_sample_index[todo]
        end_draws[todo] = greedy(weights, quotas, first_steps[todo], start_draws[todo], picks,
                                 samples)
        dataset_index[todo], dataset_sample_index[todo] = picks, samples


def greedy(weights, quotas, first_steps, draws, picks, samples, block=1 << 19):
    """Run len(picks[0]) greedy steps from each row of `draws` (row r starting at step
    first_steps[r]), writing the datasets picked and their sample numbers into `picks` and
    `samples`; return the draws after. Rows go `block` values (datasets x rows) at a time, which
    bounds the temporaries."""
    rows = max(8, block // len(weights))
    end_draws = np.empty_like(draws)
    for first in range(0, len(draws), rows):
        last = min(first + rows, len(draws))
        end_draws[first:last] = greedy_rows(weights, quotas, first_steps[first:last],
                                            draws[first:last], picks[first:last],
                                            samples[first:last])
    return end_draws


def greedy_rows(weights, quotas, first_steps, draws, picks, samples, flush=64):
    """greedy() on one block of rows, held as (datasets, rows) so that each step reduces over
    axis 0. Each step's picks go to a contiguous scratch row, copied out every `flush` steps,
    because a column write per step costs more than the step's arithmetic."""
    num_datasets, steps, n = len(weights), picks.shape[1], len(draws)
    first_on_ties = (num_datasets - np.arange(num_datasets, dtype=np.int16))[:, None]
    column = weights[:, None]
    counts = np.ascontiguousarray(draws.T, dtype=np.float64)
    flat_counts = counts.reshape(-1)
    # Row r's pick d is flat_counts[d * n + r], where d = num_datasets - its first_on_ties value.
    flat_end = num_datasets * n + np.arange(n)
    error, is_max = np.empty(counts.shape), np.empty(counts.shape, bool)
    ties = np.empty(counts.shape, np.int16)
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
        # The argmax over datasets, first on ties: np.argmax along axis 0 is several times slower.
        np.equal(error, error.max(axis=0), out=is_max)
        np.multiply(is_max, first_on_ties, out=ties)
        top = ties.max(axis=0, out=tie_values[t % flush])
        np.multiply(top, np.int64(n), out=where)
        np.subtract(flat_end, where, out=where)
        sample = np.take(flat_counts, where, out=drawn[t % flush])
        np.add(sample, 1.0, out=next_sample)
        flat_counts[where] = next_sample
        if t % flush == flush - 1 or t == steps - 1:
            done = t % flush + 1
            picks[:, t + 1 - done:t + 1] = num_datasets - tie_values[:done].T
            samples[:, t + 1 - done:t + 1] = drawn[:done].T
    return counts.T


# ------------------------------------------------------------------------------------------------
# The index cache

def key_digest(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def sampled_checksum(values, samples=4096):
    """A CRC of `samples` evenly spaced elements of `values`. It catches a file cut short, zeroed
    or overwritten in any sizeable part while touching a few thousand pages at most, so that a
    warm start does not read the whole cache."""
    flat = values.reshape(-1)
    picks = np.linspace(0, len(flat) - 1, num=min(samples, len(flat))).astype(np.int64)
    return zlib.crc32(np.ascontiguousarray(flat[picks]).tobytes())


def save_npy(f, values):
    """np.save to the open file `f` through f.write: a full disk then fails with ENOSPC, where
    np.save's own writer reports only a short count ("20178 requested and 17376 written")."""
    values = np.ascontiguousarray(values)
    np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(values))
    f.write(memoryview(values.reshape(-1)).cast("B"))


def write_json(path, content):
    with atomic_write(path, "w") as f:
        json.dump(content, f, indent=1)


def make_cache_dir(cache_dir):
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as error:
        raise WriteError(error.errno, error.strerror, cache_dir) from None


def load_entry(base, key, layout):
    """The arrays of cache entry `base`, memory-mapped, or None when it is absent or does not hold
    exactly what `key` and `layout` ({array: (dtype, shape)}) ask for: every array listed, of its
    dtype and shape, with the checksum written in its description."""
    with open(base + ".json") as f:
        description = json.load(f)
    if description["key"] != key:
        raise ValueError("its key differs")
    checksums = description["arrays"]
    if sorted(checksums) != sorted(layout):
        raise ValueError(f"it lists the arrays {sorted(checksums)}, not {sorted(layout)}")
    arrays = {}
    for name, (dtype, shape) in layout.items():
        values = np.load(f"{base}-{name}.npy", mmap_mode="r")
        if values.dtype != dtype or values.shape != shape:
            raise ValueError(f"{name} is {values.dtype} {values.shape}, not {dtype} {shape}")
        if sampled_checksum(values) != checksums[name]:
            raise ValueError(f"{name} holds other values than were written")
        arrays[name] = values
    return arrays


def cached(cache_dir, name, key, layout, build):
    """(arrays, seconds the build took or None) of `build()`, kept in `cache_dir` as
    `{hash}-{name}-{array}.npy` and, written last, `{hash}-{name}.json` with `key` (every
    parameter and each source's fingerprint) and a checksum of each array. A damaged entry is
    rebuilt. Only node_leader() writes: the other ranks of its node load what it wrote."""
    if cache_dir is not None:
        base = os.path.join(cache_dir, f"{key_digest(key)}-{name}")
        if os.path.exists(base + ".json"):
            try:
                return load_entry(base, key, layout), None
            except Exception as error:  # whatever is wrong with the entry, a rebuild cures it
                log(f"{base}.json: ignoring the cached indices ({type(error).__name__}: {error}); "
                    f"rebuilding")
    t0 = time.perf_counter()
    arrays = build()
    seconds = time.perf_counter() - t0
    if cache_dir is not None and node_leader():
        make_cache_dir(cache_dir)
        for array_name, values in arrays.items():
            with atomic_write(f"{base}-{array_name}.npy") as f:
                save_npy(f, values)
        checksums = {array_name: sampled_checksum(v) for array_name, v in arrays.items()}
        write_json(base + ".json", {"key": key, "arrays": checksums})
    return arrays, seconds


def check_once(dataset, cache_dir, racy_seconds=2.0):
    """Check `dataset`'s index and learn its fingerprint, unless `cache_dir` holds a record that
    this version of the files (sizes, times, inode) passed, with their fingerprint: then a warm
    start hashes and checks nothing. A record made within `racy_seconds` of a file's last change
    might miss a rewrite in the same clock tick (git's "racy clean" files), so then the
    fingerprint is hashed again and the index checked only if it differs."""
    version = dataset.version()
    key = {"format": CACHE_FORMAT, "class": "IndexCheck", "version": version}
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"{key_digest(key)}-IndexedDataset-checked.json")
        try:
            with open(path) as f:
                record = json.load(f)
            newest_change = max(max(times[1:3]) for times in version["files"]) / 1e9
            settled = record["written"] - newest_change > racy_seconds
            if record["key"] == key and (settled or dataset.fingerprint == record["fingerprint"]):
                dataset.fingerprint = record["fingerprint"]
                return
        except (OSError, ValueError, KeyError, TypeError):  # no record, or a damaged one: check
            pass
    dataset.check()
    if path is not None and node_leader():
        make_cache_dir(cache_dir)
        write_json(path, {"key": key, "fingerprint": dataset.fingerprint, "written": time.time()})


def cache_dirs(prefixes, cache_dir, fallback_cache_dir, blended):
    """(a directory per prefix, one for the blends if `blended`): `cache_dir`; else beside the
    data, where megatron-core keeps them (the blends beside the first prefix); where that is
    read-only, `fallback_cache_dir` (None: the indices are not kept)."""
    if cache_dir is not None:
        return [cache_dir] * len(prefixes), cache_dir
    dirs = [cache_dir_beside(p, "GPTDataset", fallback_cache_dir) for p in prefixes]
    blend_dir = None
    if blended:
        blend_dir = cache_dir_beside(prefixes[0], "BlendedDataset", fallback_cache_dir)
    return dirs, blend_dir


def cache_dir_beside(prefix, kind, fallback_cache_dir):
    path = parent = os.path.join(prefix, "cache", f"{kind}_indices")
    # A path can be made if its nearest existing ancestor is a writable directory.
    while not os.path.exists(parent):
        parent = os.path.dirname(parent) or "."
    if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
        return path
    if fallback_cache_dir is None:
        log(f"{path}: not writable and no fallback cache directory: the indices are not kept")
    return fallback_cache_dir


# ------------------------------------------------------------------------------------------------
# Datasets: training samples, validation windows in order, and the training sampler

class GPTDataset:
    """megatron-core's GPTDataset of sequences [begin, end); without `add_extra_token` the last
    label is -100."""

    def __init__(self, dataset, begin, end, *, seq_length, num_samples, seed, add_extra_token=True,
                 split="train", cache_dir=None):
        self.dataset, self.seq_length, self.extra = dataset, seq_length, int(add_extra_token)
        key = {"format": CACHE_FORMAT, "class": "GPTDataset", "split": split,
               "source": dataset.fingerprint, "sequences": [begin, end], "num_samples": num_samples,
               "seq_length": seq_length, "seed": seed, "add_extra_token": bool(self.extra)}
        # The order is the key less num_samples, plus what num_samples decides: equal orders are
        # equal index arrays.
        tokens_per_epoch = int(np.sum(dataset.sequence_lengths[begin:end], dtype=np.int64))
        num_epochs, separate = epochs(tokens_per_epoch, seq_length=seq_length,
                                      num_samples=num_samples, extra=self.extra)
        self.order = {k: v for k, v in key.items() if k not in ("format", "num_samples")}
        self.order.update(epochs=num_epochs, separate_final_epoch=separate)
        options = dict(seq_length=seq_length, num_samples=num_samples,
                       add_extra_token=add_extra_token)
        layout = gpt_index_layout(dataset.sequence_lengths, begin, end, **options)
        build = functools.partial(gpt_indices, dataset.sequence_lengths, begin, end, seed=seed,
                                  **options)
        # build_seconds: how long the build took; None when the cache had the arrays.
        arrays, self.build_seconds = cached(cache_dir, f"GPTDataset-{split}", key, layout, build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, i):
        j = self.shuffle_index[i]
        (first, first_offset), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        # Views: nothing is read until they are concatenated.
        pieces = [self.dataset.get(self.document_index[k]) for k in range(first, last + 1)]
        # The end first, since the sample may lie within one sequence.
        pieces[-1] = pieces[-1][:last_offset + self.extra]
        pieces[0] = pieces[0][first_offset:]
        text = np.concatenate(pieces, dtype=np.int64)
        if len(text) != self.seq_length + self.extra:  # the index under the sample changed
            raise self.dataset.changed(f"sample {i} has {len(text)} tokens, "
                                       f"not {self.seq_length + self.extra}")
        if self.extra:
            labels = text[1:]
        else:
            labels = np.append(text[1:], -100)  # megatron pads the last label and masks it
        return {"tokens": text[:len(labels)], "labels": labels}

    def describe(self, i):
        """Where sample i comes from, e.g. "data/a_text_document: documents 12, 7 (sample 77)"."""
        j = self.shuffle_index[i]
        (first, _), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        reaches_last = last_offset + self.extra > 0
        sequences = self.document_index[first:last + reaches_last]
        return f"{self.dataset.path_prefix}: {self.dataset.documents(sequences)} (sample {i})"


def cached_blending_indices(weights, size, *, split="train", cache_dir=None, names=()):
    """BlendedDataset's arrays (dataset_index, dataset_sample_index) for `weights` and `size`
    (without a size, the weights are exact counts), kept in `cache_dir`. `names`: the datasets'
    prefixes, for the log."""
    if size is not None:
        weights = normalize(weights)  # again, as megatron does
    key = {"format": CACHE_FORMAT, "class": "BlendedDataset", "split": split, "weights": weights,
           "size": size}
    length = size
    if size is None:
        length = int(sum(weights))
    layout = {"dataset_index": (np.dtype(np.int16), (length,)),
              "dataset_sample_index": (np.dtype(np.int64), (length,))}

    def build():
        dataset_index, dataset_sample_index = blending_indices(weights, size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    arrays, seconds = cached(cache_dir, f"BlendedDataset-{split}", key, layout, build)
    if seconds is not None:
        log_blend(split, normalize(weights), arrays["dataset_index"], names, seconds)
    return arrays["dataset_index"], arrays["dataset_sample_index"]


def log_blend(split, weights, dataset_index, names, seconds):
    """A few lines on a blend just built: its size, and each dataset's weight and draws."""
    log(f"{split} blend of {len(weights)} datasets, {len(dataset_index)} samples, built in "
        f"{seconds:.2f}s")
    draws = np.zeros(len(weights), dtype=np.int64)
    for first in range(0, len(dataset_index), 1 << 20):  # bounded temporaries
        draws += np.bincount(dataset_index[first:first + (1 << 20)], minlength=len(weights))
    if len(weights) > 8:
        log(f"{split} blend: weights {min(weights):.4g} to {max(weights):.4g}, "
            f"{draws.min():,} to {draws.max():,} samples per dataset")
        return
    for name, weight, drawn in zip(names, weights, draws):
        log(f"{split} blend: {name}: weight {weight:.4g}, {drawn:,} samples")


class BlendedDataset:
    """megatron-core's BlendedDataset: sample i is sample `dataset_sample_index[i]` of
    `datasets[dataset_index[i]]`."""

    def __init__(self, datasets, weights, size, *, split="train", cache_dir=None):
        self.datasets = datasets
        names = [d.dataset.path_prefix for d in datasets]
        self.dataset_index, self.dataset_sample_index = cached_blending_indices(
            weights, size, split=split, cache_dir=cache_dir, names=names)
        # A size only cuts the greedy draw short (without one, the draw differs): this is what
        # decides the first samples.
        if size is not None:
            weights = normalize(weights)
        self.order = {"weights": weights, "exhaustive": size is None,
                      "datasets": [d.order for d in datasets]}

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        return self.datasets[self.dataset_index[i]][self.dataset_sample_index[i]]

    def describe(self, i):
        """Where sample i comes from: a sample of one of the blended datasets."""
        part = self.datasets[self.dataset_index[i]]
        return f"{part.describe(self.dataset_sample_index[i])}, blend sample {i}"


def first_samples_agree(a, b, count, block=1 << 20):
    """Whether samples [0, count) of the GPT or blended datasets `a` and `b` are the same samples
    in the same order: the same datasets and sample numbers, and under them the same sequences at
    the same offsets. It compares the index entries those samples reach, `block` samples at a
    time; no tokens are read."""
    if type(a) is not type(b) or min(len(a), len(b)) < count:
        return False
    if isinstance(a, BlendedDataset):
        return blends_agree(a, b, count, block)
    if (a.dataset.fingerprint, a.seq_length, a.extra) != (b.dataset.fingerprint, b.seq_length,
                                                          b.extra):
        return False
    for first in range(0, count, block):
        last = min(first + block, count)
        if not sample_spans_agree(a, b, first, last):
            return False
    return True


def blends_agree(a, b, count, block):
    if len(a.datasets) != len(b.datasets):
        return False
    draws = np.zeros(len(a.datasets), dtype=np.int64)
    # Each dataset's samples are drawn in order (0, 1, 2, ...), so counting the draws tells how
    # many first samples of each dataset must agree.
    for first in range(0, count, block):
        last = min(first + block, count)
        if not np.array_equal(a.dataset_index[first:last], b.dataset_index[first:last]):
            return False
        if not np.array_equal(a.dataset_sample_index[first:last],
                              b.dataset_sample_index[first:last]):
            return False
        draws += np.bincount(a.dataset_index[first:last], minlength=len(a.datasets))
    pairs = zip(a.datasets, b.datasets, draws, strict=True)
    return all(first_samples_agree(x, y, int(n)) for x, y, n in pairs)


def sample_spans(dataset, first, last):
    """(first rows, last rows) of the sample index for samples [first, last)."""
    j = np.asarray(dataset.shuffle_index[first:last], dtype=np.int64)
    starts = np.asarray(dataset.sample_index[j], np.int64)
    ends = np.asarray(dataset.sample_index[j + 1], np.int64)
    return starts, ends


def sample_spans_agree(a, b, first, last):
    """Whether samples [first, last) of GPT datasets `a` and `b` start and end at the same offsets
    of the same sequences."""
    starts_a, ends_a = sample_spans(a, first, last)
    starts_b, ends_b = sample_spans(b, first, last)
    if not (np.array_equal(starts_a[:, 1], starts_b[:, 1])
            and np.array_equal(ends_a[:, 1], ends_b[:, 1])
            and np.array_equal(ends_a[:, 0] - starts_a[:, 0], ends_b[:, 0] - starts_b[:, 0])):
        return False
    # Positions start..end of each sample in either document index.
    spans = ends_a[:, 0] - starts_a[:, 0] + 1
    steps = np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans)
    positions_a = np.repeat(starts_a[:, 0], spans) + steps
    positions_b = np.repeat(starts_b[:, 0], spans) + steps
    return np.array_equal(a.document_index[positions_a], b.document_index[positions_b])


def check_build_arguments(seq_length, seed, sizes):
    if not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    valid = [s is None or (isinstance(s, (int, np.integer)) and s >= 0) for s in sizes]
    if len(sizes) != 3 or not all(valid):
        raise ValueError(f"sizes must be (n_train, n_valid, n_test), each a non-negative int or "
                         f"None; got {sizes}")


def build_gpt_datasets(paths, *, seq_length, split="969,30,1", seed=1234, sizes=(None, None, None),
                       cache_dir=None, fallback_cache_dir=None):
    """(train, valid, test), each None without samples, as megatron-core's
    BlendedMegatronDatasetBuilder builds them from `paths` (resolve_blend) and `sizes` (samples
    per split, None: one epoch); the indices are cached (cache_dirs) by each node's leader."""
    check_build_arguments(seq_length, seed, sizes)
    sizes = [None if s is None else int(s) for s in sizes]
    builder = SplitsBuilder(paths, split, sizes, seq_length=int(seq_length), seed=int(seed),
                            cache_dir=cache_dir, fallback_cache_dir=fallback_cache_dir)
    world_size = distributed()[1]
    if world_size == 1 or not builder.caches():
        return builder.build()
    return build_in_turns(builder.build)


def build_in_turns(build):
    """build() on every rank: first on each node's leader, which writes the index cache, then on
    the other ranks, which map what their node's leader wrote. Where nodes share a filesystem,
    their leaders write the same entries, each through temporaries of its own. A failure reaches
    every rank as a one-line error, so that none waits for the others or prints a traceback."""
    import torch.distributed as dist  # a process group exists, so torch is already imported

    rank, world_size = distributed()
    result = None
    for leaders_turn in (True, False):
        failure = error = None
        if node_leader() == leaders_turn:
            try:
                result = build()
            except Exception as raised:
                error = raised
                failure = share_failure(raised)
        failures = [None] * world_size
        dist.all_gather_object(failures, failure)
        for other, shared in enumerate(failures):
            if shared is None:
                continue
            if other == rank:
                raise error
            kind, message = shared
            raise kind(f"{message} (rank {other} found this)")
    return result


def share_failure(error):
    """(ValueError or OSError, one line) that tells the other ranks what failed here."""
    if isinstance(error, OSError):
        return OSError, str(error).splitlines()[0]
    if isinstance(error, ValueError):
        return ValueError, str(error).splitlines()[0]
    return ValueError, f"{type(error).__name__}: {error}".splitlines()[0]


class SplitsBuilder:
    """What build_gpt_datasets builds each split from: the datasets, their cache directories and
    the sampling parameters."""

    def __init__(self, paths, split, sizes, *, seq_length, seed, cache_dir, fallback_cache_dir):
        self.prefixes, self.weights = resolve_blend(paths)
        self.split, self.matrix, self.sizes = split, split_matrix(split), sizes
        self.seq_length, self.seed = seq_length, seed
        # The indices are checked in build(), once per version of the files.
        self.datasets = [IndexedDataset(prefix, check=False) for prefix in self.prefixes]
        if self.weights is not None:
            missing = [SPLITS[i] for i in range(3) if self.matrix[i] is not None and sizes[i] is None]
            if missing:
                raise ValueError(f"a weighted blend needs a size for every split it builds; "
                                 f"{missing} have None")
            self.weights = normalize(self.weights)
        blended = len(self.prefixes) > 1 or self.weights is not None
        self.dirs, self.blend_dir = cache_dirs(self.prefixes, cache_dir, fallback_cache_dir,
                                               blended)

    def caches(self):
        """The cache directories in use."""
        return sorted({d for d in self.dirs + [self.blend_dir] if d is not None})

    def build(self):
        if node_leader():
            for directory in self.caches():
                remove_stale_temporaries(directory)
        for dataset, directory in zip(self.datasets, self.dirs):
            check_once(dataset, directory)
        return tuple(self.split_dataset(i) for i in range(3))

    def split_dataset(self, i):
        """Split i, blended or not, or None; one log line when some of its indices were built."""
        if self.matrix[i] is None:
            return None
        t0 = time.perf_counter()
        dataset = self.blend(i)
        parts = getattr(dataset, "datasets", [dataset])
        built = [part for part in parts if part is not None and part.build_seconds is not None]
        if not built:
            return dataset
        where = built[0].dataset.path_prefix
        if len(parts) > 1:
            where = f"{len(built)} of {len(parts)} prefixes"
        samples = sum(len(p) for p in built)
        sequences = sum(len(p.document_index) for p in built)
        seconds = sum(p.build_seconds for p in built)
        log(f"{where}: {SPLITS[i]} indices, {samples:,} samples of {self.seq_length} tokens from "
            f"{sequences:,} sequences, built in {seconds:.2f}s "
            f"({time.perf_counter() - t0:.2f}s for the whole split)")
        return dataset

    def gpt_split(self, d, i, num_samples):
        """The GPTDataset of split i of datasets[d], or None when it yields no samples."""
        dataset = self.datasets[d]
        begin, end = split_range(len(dataset), self.matrix[i])
        if not dataset.sequence_lengths[begin:end].any():
            if num_samples:  # megatron-core loops forever here
                raise ValueError(f"{dataset.path_prefix}: its {SPLITS[i]} split ({self.split!r} of "
                                 f"{len(dataset)} sequences: [{begin}, {end})) has no tokens, but "
                                 f"{num_samples} samples were asked")
            return None
        part = GPTDataset(dataset, begin, end, seq_length=self.seq_length, num_samples=num_samples,
                          seed=self.seed, split=SPLITS[i], cache_dir=self.dirs[d])
        if len(part):
            return part
        return None

    def blend(self, i):
        size = self.sizes[i]
        if self.weights is None and len(self.prefixes) == 1:
            return self.gpt_split(0, i, size)
        if self.weights is not None:
            # Each dataset's share of the samples, built with megatron's 0.5% surplus.
            targets = [math.ceil(size * w) for w in self.weights]
            parts = [self.gpt_split(d, i, math.ceil(target * (1 + 0.005)))
                     for d, target in enumerate(targets)]
            weights, size = self.weights, sum(targets)
        else:
            # One epoch of each, in proportion to their samples.
            parts = [self.gpt_split(d, i, None) for d in range(len(self.datasets))]
            weights = [len(part) if part is not None else 0 for part in parts]
            if size is not None and sum(weights) < size:
                log(f"{SPLITS[i]}: an unweighted blend is one epoch of each prefix, "
                    f"{sum(weights)} samples, fewer than the {size} asked (token_weighted_blend "
                    f"gives a blend that can be repeated)")
                size = sum(weights)
        if size == 0 or sum(weights) == 0:
            return None
        if None in parts:  # megatron-core cannot blend an empty dataset either (it asserts)
            raise ValueError(f"{self.prefixes[parts.index(None)]}: its {SPLITS[i]} split "
                             f"({self.split!r}) has no samples of {self.seq_length} tokens, so it "
                             f"cannot take part in the blend")
        return BlendedDataset(parts, weights, size, split=SPLITS[i], cache_dir=self.blend_dir)


class TokenWindows:
    """Window k of the stream `lead` + `pieces` [(dataset, sequence ids), ...] is
    stream[k*T : k*T + T + 1] as {"tokens": its first T, "labels": its last T}, as llm.c reads;
    as many windows as the stream holds, at most `length`."""

    def __init__(self, pieces, seq_length, length=None, lead=()):
        self.pieces, self.seq_length = pieces, seq_length
        self.lead = np.asarray(lead, dtype=np.int64)
        # Where each piece's sequences start in the stream, and where the stream ends.
        self.piece_starts, self.num_tokens = [], len(self.lead)
        for dataset, sequences in pieces:
            lengths = np.r_[0, dataset.sequence_lengths[sequences]]
            starts = self.num_tokens + np.cumsum(lengths, dtype=np.int64)
            self.num_tokens = int(starts[-1])
            self.piece_starts.append(starts)
        self.length = max(0, (self.num_tokens - 1) // seq_length)
        if length is not None:
            self.length = min(self.length, length)

    def __len__(self):
        return self.length

    def _window(self, i):
        """Window i's stream range [start, stop) and the (dataset, sequences, starts, positions in
        both) it reads."""
        # range() raises IndexError past the end, and counts a negative i from it.
        start = range(self.length)[i] * self.seq_length
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
        places = []
        for dataset, sequences, _, positions in self._window(i)[2]:
            documents = dataset.documents(sequences[positions.start:positions.stop])
            places.append(f"{dataset.path_prefix}: {documents}")
        return f"{'; '.join(places)} (window {i})"


class LLMCValWindows(TokenWindows):
    """llm.c's validation batches: num_tokens // seq_length windows of [eot] + every document of
    `path_prefix` (a prefix or glob) in file order. llm.c puts the EOT before each document and we
    after, so this is its val shard."""

    def __init__(self, path_prefix, seq_length, num_tokens, eot=EOT):
        prefixes, windows = resolve_blend(path_prefix)[0], num_tokens // seq_length
        pieces = [(ds, np.arange(len(ds))) for ds in map(IndexedDataset, prefixes)]
        super().__init__(pieces, seq_length, windows, [eot])
        if len(self) < windows:
            files = ", ".join(p + ".bin" for p in prefixes)
            raise ValueError(f"{files}: the stream holds {self.num_tokens} tokens with the leading "
                             f"EOT, fewer than the {windows * seq_length + 1} that {windows} "
                             f"windows of {seq_length} need")


def sequential_samples(paths, *, seq_length, split="969,30,1", split_index=1, max_samples=None):
    """One split's sequences in order (blend weights ignored) as TokenWindows, to validate on;
    None for a zero ratio."""
    prefixes, _ = resolve_blend(paths)
    bookends = split_matrix(split)[split_index]
    if bookends is None:
        return None
    pieces = [(ds, np.arange(*split_range(len(ds), bookends)))
              for ds in map(IndexedDataset, prefixes)]
    samples = TokenWindows(pieces, seq_length, max_samples)
    if samples.num_tokens < seq_length + 1:
        raise ValueError(f"{', '.join(prefixes)}: the {SPLITS[split_index]} split ({split!r}) "
                         f"holds {samples.num_tokens} tokens, less than one window of "
                         f"seq_length + 1 = {seq_length + 1}")
    return samples


class PretrainingSampler:
    """One rank's micro-batches, as megatron's MegatronPretrainingSampler (a batch_sampler): rank r
    takes the r-th mbs of each full global batch of mbs*W after `consumed_samples`, so that a
    restart on any world size continues in place."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, rank, world_size):
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= rank < world_size, got "
                             f"{micro_batch_size}, {rank}, {world_size}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside "
                             f"[0, total_samples={total_samples}]")
        self.micro_batch_size = micro_batch_size
        self.global_batch = micro_batch_size * world_size
        # This rank's first sample of each global batch.
        self.first = consumed_samples + rank * micro_batch_size
        self.steps = (total_samples - consumed_samples) // self.global_batch

    def __iter__(self):
        end = self.first + self.steps * self.global_batch
        for first in range(self.first, end, self.global_batch):
            yield list(range(first, first + self.micro_batch_size))


# ------------------------------------------------------------------------------------------------
# The command line

def describe_files(ds, vocab_size, read_tokens, problems):
    """One line on the files of `ds`; with `read_tokens`, their ids, adding any out of the
    vocabulary to `problems`."""
    prefix, lengths = ds.path_prefix, ds.sequence_lengths
    line = (f"{prefix}: {ds.num_documents:,} documents, {len(ds):,} sequences, "
            f"{ds.num_tokens:,} tokens ({ds.dtype}); .bin {ds.sizes['.bin']:,} bytes, "
            f".idx {ds.sizes['.idx']:,} bytes")
    if len(lengths):
        line += (f", sequence length min {lengths.min():,} mean {lengths.mean():,.1f} "
                 f"max {lengths.max():,}")
    if read_tokens:
        # In parts small enough to stay in the CPU cache for their max after their min.
        parts = np.array_split(ds.tokens, len(ds.tokens) // (1 << 26) + 1)
        ranges = np.array([(part.min(), part.max()) for part in parts])
        low, high = int(ranges.min()), int(ranges.max())
        line += f", ids in [{low}, {high}]"
        if vocab_size is not None and not 0 <= low <= high < vocab_size:
            problems.append(f"{prefix}.bin: token ids span [{low}, {high}], outside the "
                            f"vocabulary [0, {vocab_size})")
    return line


def verify(prefixes, vocab_size=None, read_tokens=True):
    """Print each prefix's counts and sizes (opening checks its index), with `read_tokens` its
    ids too; return the problems found."""
    problems, totals = [], np.zeros(3, dtype=np.int64)
    for prefix in prefixes:
        try:
            ds = IndexedDataset(prefix)
            if read_tokens and not ds.num_tokens:
                raise ValueError(f"{prefix}.bin: no tokens ({ds.num_documents} documents): "
                                 f"megatron-core cannot map an empty .bin")
        except (ValueError, FileNotFoundError) as error:
            problems.append(str(error))
            continue
        totals += [ds.num_documents, len(ds), ds.num_tokens]
        print(describe_files(ds, vocab_size, read_tokens, problems))
    if len(prefixes) > 1:
        print(f"total of {len(prefixes)} prefixes: {totals[0]:,} documents, {totals[1]:,} "
              f"sequences, {totals[2]:,} tokens")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Inspect Megatron indexed datasets (<prefix>.bin + <prefix>.idx).")
    parser.add_argument("command", choices=["info", "verify"],
                        help="info: counts, dtype and sizes; verify: check the index and read "
                             "every token")
    parser.add_argument("paths", metavar="PREFIX_OR_GLOB", nargs="+")
    parser.add_argument("--vocab-size", type=int, default=None, help="verify: fail on token ids "
                                                                     ">= this")
    args = parser.parse_args(argv)
    # One prefix or quoted glob, or the files an unquoted glob expanded to.
    paths = sorted({p[:-4] if p.endswith((".bin", ".idx")) else p for p in args.paths})
    try:
        prefixes = paths
        if len(args.paths) == 1:
            prefixes = resolve_blend(paths[0])[0]
        problems = verify(prefixes, args.vocab_size, read_tokens=args.command == "verify")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
