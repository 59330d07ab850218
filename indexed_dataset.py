"""Megatron-Core indexed datasets and GPT sampling in plain numpy: the same .bin/.idx bytes, and the
same samples in the same order, as megatron-core 0.16.1's IndexedDataset, GPTDataset and
BlendedDataset (tests/ compare them). `python indexed_dataset.py info|verify PREFIX_OR_GLOB`."""
import argparse
import concurrent.futures
import contextlib
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

from atomic_io import atomic_write, remove_stale_temporaries

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
DTYPE_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
SPLITS = ("train", "valid", "test")
EOT = 50256  # GPT-2's <|endoftext|>, which ends every document of prepare_fineweb.py's files
CACHE_FORMAT = 4  # bumped when the cache changes meaning, so that old entries are rebuilt
CHUNK, WARM_UP = 2048, 64  # blending_indices runs chunks of CHUNK steps, each started WARM_UP early
MISSING_DATA = "write the token files with prepare_fineweb.py (see its --help), or check the path"


def distributed():
    """(rank, world size) of the torch.distributed group, else (0, 1); it never imports torch."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def node_leader():
    """Whether this process writes its node's index cache: torchrun's local rank 0, else rank 0."""
    rank, world_size = distributed()
    if world_size == 1 or "LOCAL_RANK" not in os.environ:
        return rank == 0
    return os.environ["LOCAL_RANK"] == "0"


def usable_cores():
    """The CPU cores this process may run on (its affinity, which a scheduler may narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def log(message):
    if distributed()[0] == 0:
        # One write per line: print() writes the newline apart, and the blend's helper thread logs
        # beside the main thread.
        sys.stderr.write(f"indexed_dataset: {message}\n")
        sys.stderr.flush()


# The .bin/.idx files
def file_sha256(path):
    """The SHA-256 of a file, read in blocks rather than mapped, so that its pages leave us."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class IndexedDataset:
    """Memory-mapped `<path_prefix>.bin` + `.idx`: `ds[i]` is a read-only view of sequence i."""

    def __init__(self, path_prefix, check=True):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file; {MISSING_DATA} (a prefix, no .bin)")
        self.bin_file = open(bin_path, "rb")  # kept open, so that get() can ask its size cheaply
        bin_size, idx_size = os.fstat(self.bin_file.fileno()).st_size, os.path.getsize(idx_path)
        self.sizes = {".bin": bin_size, ".idx": idx_size}
        if idx_size < HEADER.size:
            raise ValueError(f"{idx_path}: truncated: {idx_size} bytes, less than the 34-byte "
                             "header")
        self._index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        magic, version, code, count, num_boundaries = HEADER.unpack(self._index[:HEADER.size])
        if magic != INDEX_MAGIC or version != 1 or code not in DTYPES:
            raise ValueError(f"{idx_path}: not a Megatron indexed dataset index of version 1 "
                             f"(magic {magic!r}, version {version}, dtype code {code})")
        expected = HEADER.size + 12 * count + 8 * num_boundaries
        # A multimodal .idx adds a byte per sequence after the boundaries.
        if num_boundaries < 1 or idx_size not in (expected, expected + count):
            raise ValueError(f"{idx_path}: truncated or corrupt: its header announces {count} "
                             f"sequences and {num_boundaries - 1} documents, {expected} bytes, "
                             f"not {idx_size}")
        self.dtype, self.num_documents = np.dtype(DTYPES[code]), num_boundaries - 1
        self.sequence_lengths = np.frombuffer(self._index, "<i4", count, HEADER.size)
        self.sequence_pointers = np.frombuffer(self._index, "<i8", count, HEADER.size + 4 * count)
        self.document_indices = np.frombuffer(self._index, "<i8", num_boundaries, HEADER.size + 12 * count)
        if self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(f"{idx_path}: corrupt: document boundaries run from {self.document_indices[0]} "
                             f"to {self.document_indices[-1]}, not from 0 to the sequence count {count}")
        if check:
            self.check()
        expected = self.num_tokens * self.dtype.itemsize  # check() ties the pointers to the lengths
        if bin_size != expected:
            raise ValueError(f"{bin_path}: {bin_size} bytes, not the {expected} bytes its {idx_path} says")
        self.tokens = np.empty(0, self.dtype)  # an empty file cannot be mapped
        if bin_size:  # a plain view: a memmap's slices cost more
            self.tokens = np.memmap(bin_path, self.dtype, "r").view(np.ndarray)

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, i, offset=0, length=None):
        """`length` tokens (default: to the end) of sequence i, starting `offset` tokens into it."""
        # A read past the end of a .bin cut short under its mapping would die of SIGBUS.
        size = os.fstat(self.bin_file.fileno()).st_size
        if size < self.sizes[".bin"]:
            raise ValueError(f"{self.path_prefix}.bin: shrank from {self.sizes['.bin']} to {size} "
                             f"bytes while the run read it; restore it and resume")
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
        """A hash of the index and the .bin's size: what changes when the data is replaced."""
        return f"{file_sha256(self.path_prefix + '.idx')[:32]}-{self.sizes['.bin']}"

    def documents(self, sequences):
        """The documents (from 0) holding tokens of the array `sequences`: "documents 7, 3"."""
        nonempty = sequences[self.sequence_lengths[sequences] > 0]
        held = np.searchsorted(self.document_indices, nonempty, "right")
        return "documents " + ", ".join(map(str, dict.fromkeys((held - 1).tolist())))

    def changed(self, why):
        """The error for files rewritten in place while open (a sample of the wrong length)."""
        return ValueError(f"{self.path_prefix}: changed on disk since it was opened ({why})")

    def check(self, block=1 << 20):
        """ValueError naming the .idx unless each pointer sums the lengths before it. Its pointers are
        read, not mapped: mapped pages would stay in this process (8 bytes a sequence)."""
        idx_path, count = self.path_prefix + ".idx", len(self)
        with open(idx_path, "rb") as f:
            start = 0
            for first in range(0, count, block):
                sizes = self.sequence_lengths[first:first + block].astype(np.int64) * self.dtype.itemsize
                starts = np.cumsum(sizes) - sizes + start
                start = int(starts[-1] + sizes[-1])
                at = HEADER.size + 4 * count + 8 * first
                pointers = np.frombuffer(os.pread(f.fileno(), 8 * len(sizes), at), "<i8")
                for k in np.flatnonzero(pointers != starts)[:1]:  # the first wrong pointer, if any
                    raise ValueError(f"{idx_path}: corrupt: sequence {first + k} starts at byte "
                                     f"{pointers[k]} of the .bin, but the lengths before it say "
                                     f"{starts[k]} ({self.dtype} tokens): a wrong dtype or pointer")


class IndexedDatasetBuilder:
    """Writer of `<prefix>.bin` and, at finalize, `<prefix>.idx`, byte for byte as megatron's."""

    def __init__(self, bin_path, dtype=np.uint16):
        self.bin_path, self.dtype = str(bin_path), np.dtype(dtype)  # one of DTYPES
        if self.bin_path.endswith(".bin") and os.path.exists(self.bin_path[:-4] + ".idx"):
            os.remove(self.bin_path[:-4] + ".idx")  # no reader may take a .bin being rewritten
        self._bin = open(self.bin_path, "wb")
        self.sequence_lengths, self.document_indices = array("q"), array("q", [0])

    def add_document(self, tokens, lengths=None):
        """Append 1-D `tokens`: a document of sequences of `lengths` (default one, none if empty)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.bin_path}: a document must be 1-D tokens, not of shape {tokens.shape}")
        # The range check costs more than the write, so it runs only where a value may not fit.
        if tokens.size and self.dtype.kind in "iu" and not np.can_cast(tokens.dtype, self.dtype):
            bad = tokens[tokens.astype(self.dtype) != tokens]
            if tokens.dtype.kind not in "iub" or bad.size:
                raise ValueError(f"{self.bin_path}: tokens {tokens.dtype} {bad[:1]} do not fit the "
                                 f"dataset's dtype {self.dtype}")
        if lengths is None:
            lengths = [tokens.size] if tokens.size else []
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths) or sum(lengths) != tokens.size:
            raise ValueError(f"{self.bin_path}: lengths {lengths} do not add up to {tokens.size} tokens")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path):
        """Close the .bin and write the index to `idx_path`."""
        self._bin.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        boundaries = np.frombuffer(self.document_indices, dtype=np.int64)
        pointers = (np.cumsum(lengths) - lengths) * self.dtype.itemsize
        with atomic_write(idx_path) as f:
            f.write(HEADER.pack(INDEX_MAGIC, 1, DTYPE_CODES[self.dtype], len(lengths), len(boundaries)))
            for values, dtype in ((lengths, "<i4"), (pointers, "<i8"), (boundaries, "<i8")):
                f.write(values.astype(dtype).tobytes())


# Which prefixes, which weights, which part of each, and the index arrays of each dataset
def resolve_blend(paths):
    """(prefixes, weights or None) of a prefix, a list of them, a blend list ["30", p0, "70", p1],
    or a glob of files or prefixes (sorted, as NeMo AutoModel reads it)."""
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
    numbers = [as_number(entry) for entry in entries]
    if numbers.count(None) == len(numbers):
        return entries, None
    weights = numbers[0::2]
    if len(entries) % 2 or not all(w is not None and math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"blend list {entries}: it must alternate weight, prefix (or list only "
                         f"prefixes), each weight a positive number")
    if not math.isfinite(sum(weights)):  # normalized, they would all be 0 or NaN
        raise ValueError(f"blend list {entries}: the weights {entries[0::2]} add up to more than a "
                         "float holds; scale them down")
    return entries[1::2], weights


def as_number(text):
    try:
        return float(text)
    except ValueError:
        return None


def normalize(weights):
    """Weights divided by their sum in float64, as megatron normalizes them (bit for bit)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split):
    """Megatron's [(start, end) or None] * 3 of each prefix for train, valid, test: "969,30,1"."""
    numbers = re.findall(r"[.0-9]+", split)
    ratios = [as_number(n) for n in numbers] + [0.0] * (3 - len(numbers))
    leftover = re.sub(r"[.0-9]+", "", split).strip(" ,/:\t")
    if None in ratios or not 1 <= len(numbers) <= 3 or sum(ratios) <= 0 or leftover:
        raise ValueError(f"split {split!r}: expected up to three numbers >= 0 like '969,30,1'")
    bookends = [0, *itertools.accumulate(normalize(ratios))]  # Python float sums, as megatron's
    return [(a, b) if b > a else None for a, b in zip(bookends[:-1], bookends[1:])]


def split_range(num_sequences, bookends):
    """The [begin, end) sequences a split's (start, end) fractions cover (round half to even)."""
    return tuple(int(round(fraction * float(num_sequences))) for fraction in bookends)


def token_weighted_blend(paths):
    """The blend [str(tokens of p0), p0, ...] of `paths`: unlike a list, it goes past an epoch."""
    prefixes, weights = resolve_blend(paths)
    if weights is not None:
        raise ValueError(f"{paths}: already weighted; token_weighted_blend weights prefixes")
    blend = []
    for prefix in prefixes:
        # The build checks each index. A prefix without tokens has weight 0, which resolve_blend refuses.
        blend += [str(IndexedDataset(prefix, check=False).num_tokens), prefix]
    return blend


def one_epoch_samples(paths, *, seq_length, split, split_index=0, add_extra_token=True):
    """The samples in one epoch of a split of all of `paths`: what an unweighted list can give."""
    bookends = split_matrix(split)[split_index]
    total = 0
    for prefix in resolve_blend(paths)[0] if bookends is not None else []:
        dataset = IndexedDataset(prefix, check=False)
        begin, end = split_range(len(dataset), bookends)
        tokens = int(np.sum(dataset.sequence_lengths[begin:end], dtype=np.int64))
        total += max(0, (tokens - int(add_extra_token)) // seq_length)
    return total


def gpt_plan(sequence_lengths, begin, end, *, seq_length, num_samples, extra):
    """(epochs, whether the last is shuffled apart, samples before it, {array: (dtype, shape)}) of
    megatron's GPTDataset for `num_samples`: with the data and seed, all that decides its arrays."""
    tokens_per_epoch = int(np.sum(sequence_lengths[begin:end], dtype=np.int64))
    num_epochs = 1
    if num_samples is not None:
        num_epochs = max(1, -(-(num_samples * seq_length + extra) // tokens_per_epoch))
    samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    samples_per_epoch = (tokens_per_epoch - extra) // seq_length
    separate = num_epochs > 1 and num_samples - samples_before_final_epoch < int(0.80 * samples_per_epoch)
    samples, positions = (num_epochs * tokens_per_epoch - extra) // seq_length, num_epochs * (end - begin)
    wide = max(positions, int(sequence_lengths.max(initial=0))) > np.iinfo(np.int32).max
    layout = {"document_index": (np.dtype(np.int32), (positions,)),
              "sample_index": (np.dtype(np.int64 if wide else np.int32), (samples + 1, 2)),
              "shuffle_index": (np.dtype(np.int64 if samples >= 2**32 - 2 else np.uint32), (samples,))}
    return num_epochs, separate, samples_before_final_epoch, layout


def gpt_indices(sequence_lengths, begin, end, *, seq_length, num_samples, seed, add_extra_token=True):
    """megatron-core GPTDataset's {document_index, sample_index, shuffle_index} of [begin, end)."""
    extra = int(add_extra_token)
    num_epochs, separate_final_epoch, samples_before_final_epoch, layout = gpt_plan(
        sequence_lengths, begin, end, seq_length=seq_length, num_samples=num_samples, extra=extra)
    # Megatron draws the document shuffle(s), then the sample shuffle(s); a separate final epoch is
    # shuffled apart from the epochs before it (shuffling nothing draws nothing).
    rng = np.random.RandomState(seed)
    document_index = np.tile(np.arange(begin, end, dtype=np.int32), num_epochs)
    cut = (num_epochs - separate_final_epoch) * (end - begin)
    rng.shuffle(document_index[:cut])
    rng.shuffle(document_index[cut:])
    sample_index = np.zeros(layout["sample_index"][1], layout["sample_index"][0])
    # Gathering from an aligned int32 copy of the split's lengths is faster than from the mapping.
    sizes = np.array(sequence_lengths[begin:end], dtype=np.int32)[document_index - begin]
    fill_sample_index(sample_index, sizes, seq_length=seq_length, extra=extra)
    shuffle_index = np.arange(len(sample_index) - 1, dtype=layout["shuffle_index"][0])
    cut = samples_before_final_epoch if separate_final_epoch else len(shuffle_index)
    rng.shuffle(shuffle_index[:cut])
    rng.shuffle(shuffle_index[cut:])
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def fill_sample_index(sample_index, sizes, *, seq_length, extra, block=1 << 18):
    """Rows 1.. of the sample index: the (position in the document index, token offset) where each
    sample starts; `sizes` are the sequences' lengths in document-index order. Megatron walks them;
    here row k is at once the count of sequences whose first row is <= k, minus one."""
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=starts[1:])
    first_rows = starts + (seq_length - extra)
    first_rows //= seq_length
    for first in range(1, len(sample_index), block):
        last = min(first + block, len(sample_index))
        begun_before, begun_by_last = np.searchsorted(first_rows, [first, last])
        begun = np.bincount(first_rows[begun_before:begun_by_last] - first, minlength=last - first)
        sequence = np.cumsum(begun) + (begun_before - 1)
        sample_index[first:last, 0] = sequence
        offsets = np.arange(first, last, dtype=np.int64) * seq_length - starts[sequence]
        sample_index[first:last, 1] = offsets


def blending_indices(weights, size=None):
    """megatron-core BlendedDataset's (dataset_index int16, dataset_sample_index int64): with `size`, step s
    draws the dataset maximising weights[d] * max(s, 1) - draws[d] (the first on ties, in float64); without,
    `weights` are exact counts. Megatron's loop is sequential; here chunks of CHUNK steps run side by side
    from a guess of their starting draws, and a chunk that did not start where the one before ended runs
    again from there, until all agree."""
    quotas = None
    if size is None:
        quotas = np.asarray(weights, dtype=np.int64)
        size, weights = int(quotas.sum()), quotas / float(quotas.sum())
    weights = np.asarray(weights, dtype=np.float64)
    num_chunks = -(-size // CHUNK)
    first_steps = np.arange(num_chunks, dtype=np.int64) * CHUNK
    # The guess: WARM_UP steps from the ideal draws (floors, plus one for the largest fractions).
    guess_steps = first_steps[1:] - WARM_UP
    ideal = weights * (guess_steps - 1)[:, None]
    guess = np.floor(ideal).astype(np.int64)
    rank = np.argsort(np.argsort(guess - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    guess += rank < (guess_steps - guess.sum(axis=1))[:, None]
    if quotas is not None:
        np.minimum(guess, quotas, out=guess)
    start_draws = np.zeros((num_chunks, len(weights)), dtype=np.int64)  # exact for chunk 0
    warm_up = np.empty((len(guess), WARM_UP), np.int16), np.empty((len(guess), WARM_UP), np.int64)
    start_draws[1:] = greedy(weights, quotas, guess_steps, guess, *warm_up)
    dataset_index = np.empty((num_chunks, CHUNK), dtype=np.int16)
    dataset_sample_index = np.empty((num_chunks, CHUNK), dtype=np.int64)
    todo = np.arange(num_chunks)
    end_draws = np.empty_like(start_draws)
    while todo.size:
        picks, samples = dataset_index[todo], dataset_sample_index[todo]
        end_draws[todo] = greedy(weights, quotas, first_steps[todo], start_draws[todo], picks, samples)
        dataset_index[todo], dataset_sample_index[todo] = picks, samples
        todo = np.flatnonzero((start_draws[1:] != end_draws[:-1]).any(axis=1)) + 1
        start_draws[todo] = end_draws[todo - 1]
    return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]


def greedy(weights, quotas, first_steps, draws, picks, samples, block=1 << 19, flush=64):
    """Run len(picks[0]) greedy steps from each row of `draws` (row r from step first_steps[r]) into
    `picks` and `samples`; return the draws after. The rows go in blocks of `block` values, which
    bound the temporaries, each held as (datasets, rows): each step reduces over axis 0. Picks go to
    a scratch row, copied out every `flush` steps: a column write costs more than a step."""
    num_datasets, steps = len(weights), picks.shape[1]
    first_on_ties = (num_datasets - np.arange(num_datasets, dtype=np.int16))[:, None]
    rows, end_draws = max(8, block // num_datasets), np.empty_like(draws)
    for first in range(0, len(draws), rows):
        part = slice(first, first + rows)
        counts = np.ascontiguousarray(draws[part].T, dtype=np.float64)
        flat_counts, n = counts.reshape(-1), counts.shape[1]
        # Row r's pick d is flat_counts[d * n + r], where d = num_datasets - its first_on_ties value.
        flat_end = num_datasets * n + np.arange(n)
        error, is_max = np.empty(counts.shape), np.empty(counts.shape, bool)
        ties, where = np.empty(counts.shape, np.int16), np.empty(n, np.int64)
        row_steps, x, next_sample = first_steps[part].astype(np.float64), np.empty(n), np.empty(n)
        tie_values, drawn = np.empty((flush, n), np.int16), np.empty((flush, n))
        for t in range(steps):
            np.add(row_steps, t, out=x)
            if t == 0:
                np.maximum(x, 1.0, out=x)  # step 0 weighs as step 1
            np.multiply(weights[:, None], x, out=error)
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
                picks[part, t + 1 - done:t + 1] = num_datasets - tie_values[:done].T
                samples[part, t + 1 - done:t + 1] = drawn[:done].T
        end_draws[part] = counts.T
    return end_draws


# The index cache
def key_digest(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def sampled_checksum(path, offset, itemsize, count, samples=256):
    """A CRC of `samples` evenly spaced items of the array at byte `offset` of `path`, which catches
    an array zeroed or overwritten in any sizeable part; preads keep the cache's pages out of this
    process."""
    picks = np.linspace(0, count - 1, num=min(samples, count)).astype(np.int64)
    with open(path, "rb") as f:
        items = [os.pread(f.fileno(), itemsize, offset + k * itemsize) for k in picks.tolist()]
    return zlib.crc32(b"".join(items))


def load_entry(base, key, layout):
    """The arrays of cache entry `base`, mapped, if its description has `key` and lists exactly the
    arrays of `layout` ({name: (dtype, shape)}), each of its dtype and shape and unchanged."""
    with open(base + ".json") as f:
        description = json.load(f)
    if description["key"] != key:
        raise ValueError("its key differs")
    checksums = description["arrays"]
    if sorted(checksums) != sorted(layout):
        raise ValueError(f"it lists the arrays {sorted(checksums)}, not {sorted(layout)}")
    arrays = {}
    for name, (dtype, shape) in layout.items():
        values = arrays[name] = np.load(f"{base}-{name}.npy", mmap_mode="r")
        if values.dtype != dtype or values.shape != shape:
            raise ValueError(f"{name} is {values.dtype}{values.shape}, not {dtype}{shape}")
        if sampled_checksum(values.filename, values.offset, values.itemsize, values.size) != checksums[name]:
            raise ValueError(f"{name} holds other values than were written")
    return arrays


def cached(cache_dir, name, key, layout, build, what):
    """The arrays of `build()`, kept in `cache_dir` as {hash}-{name}-*.npy and, written last, their
    description {hash}-{name}.json. Only node_leader() writes; a build is logged as `what`."""
    base = os.path.join(cache_dir or "", f"{key_digest(key)}-{name}")
    if cache_dir is not None and os.path.exists(base + ".json"):
        try:
            return load_entry(base, key, layout)
        except Exception as error:  # whatever is wrong with the entry, a rebuild cures it
            log(f"{base}.json: ignoring the cached indices ({type(error).__name__}: {error}); rebuilding")
    t0 = time.perf_counter()
    arrays = build()
    log(f"{what}, built in {time.perf_counter() - t0:.2f}s")
    if cache_dir is not None and node_leader():
        os.makedirs(cache_dir, exist_ok=True)
        checksums = {}
        for array_name, values in arrays.items():
            path, values = f"{base}-{array_name}.npy", np.ascontiguousarray(values)
            # Not fsynced (as megatron's are not): load_entry checks what a crash may have left.
            with atomic_write(path, durable=False) as f:
                # Written through f.write, since np.save reports a full disk as a short count only.
                header = np.lib.format.header_data_from_array_1_0(values)
                np.lib.format.write_array_header_1_0(f, header)
                offset = f.tell()
                f.write(memoryview(values.reshape(-1)).cast("B"))
            checksums[array_name] = sampled_checksum(path, offset, values.itemsize, values.size)
        with atomic_write(base + ".json", "w", durable=False) as f:
            json.dump({"key": key, "arrays": checksums}, f, indent=1)
    return arrays


def check_once(dataset, cache_dir):
    """Check `dataset`'s index and learn its fingerprint, unless `cache_dir` has a record that this
    version of the files passed, with their fingerprint: a warm start then hashes and checks nothing."""
    if cache_dir is None:
        return dataset.check()
    # Each file's size, times and inode tell a new version without reading it, as make and git do.
    files = [os.stat(dataset.path_prefix + suffix) for suffix in (".idx", ".bin")]
    files = [[st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for st in files]
    key = {"format": CACHE_FORMAT, "class": "IndexCheck", "prefix": os.path.abspath(dataset.path_prefix),
           "files": files}
    path = os.path.join(cache_dir, f"{key_digest(key)}-IndexedDataset-checked.json")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none, or a damaged one
        with open(path) as f:
            record = json.load(f)
        if record["key"] == key:
            dataset.fingerprint = record["fingerprint"]
            return
    dataset.check()
    if node_leader():
        os.makedirs(cache_dir, exist_ok=True)
        with atomic_write(path, "w", durable=False) as f:  # checked on loading, as the cache is
            json.dump({"key": key, "fingerprint": dataset.fingerprint}, f)


def cache_dir_for(prefix, kind, cache_dir, fallback_cache_dir):
    """`cache_dir`, else <prefix>/cache/<kind>_indices, where megatron-core keeps them, if it can be
    made, else `fallback_cache_dir` (None: the indices are not kept)."""
    if cache_dir is not None:
        return cache_dir
    path = parent = os.path.join(prefix, "cache", f"{kind}_indices")
    while not os.path.exists(parent):  # it can be made if its nearest ancestor is writable
        parent = os.path.dirname(parent) or "."
    if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
        return path
    if fallback_cache_dir is None:
        log(f"{path}: not writable and no fallback cache directory: the indices are not kept")
    return fallback_cache_dir


# Datasets: training samples, validation windows in order, and the training sampler
class GPTDataset:
    """megatron-core's GPTDataset of sequences [begin, end); the last label is -100 without extra."""

    def __init__(self, dataset, begin, end, *, seq_length, num_samples, seed, add_extra_token=True,
                 split="train", cache_dir=None):
        self.dataset, self.seq_length, self.extra = dataset, seq_length, int(add_extra_token)
        key = {"format": CACHE_FORMAT, "class": "GPTDataset", "split": split, "source": dataset.fingerprint,
               "sequences": [begin, end], "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
               "add_extra_token": bool(self.extra)}
        options = dict(seq_length=seq_length, num_samples=num_samples)
        num_epochs, separate, _, layout = gpt_plan(dataset.sequence_lengths, begin, end, **options, extra=self.extra)
        # The order: the key less num_samples, plus what it decides. Equal orders, equal arrays.
        self.order = {k: v for k, v in key.items() if k not in ("format", "num_samples")}
        self.order.update(epochs=num_epochs, separate_final_epoch=separate)
        build = functools.partial(gpt_indices, dataset.sequence_lengths, begin, end, seed=seed, **options,
                                  add_extra_token=add_extra_token)
        samples = layout["shuffle_index"][1][0]
        what = f"{dataset.path_prefix}: {split} indices of {samples:,} samples"
        arrays = cached(cache_dir, f"GPTDataset-{split}", key, layout, build, what)
        self.document_index, self.sample_index, self.shuffle_index = arrays.values()

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, i):
        j = self.shuffle_index[i]
        (first, first_offset), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        pieces = [self.dataset.get(self.document_index[k]) for k in range(first, last + 1)]
        pieces[-1] = pieces[-1][:last_offset + self.extra]  # first, as both may be one sequence
        pieces[0] = pieces[0][first_offset:]
        text = np.concatenate(pieces, dtype=np.int64)
        if len(text) != self.seq_length + self.extra:  # the index under the sample changed
            raise self.dataset.changed(f"sample {i} has {len(text)} tokens, not {self.seq_length + self.extra}")
        if not self.extra:  # megatron pads the last label and masks it
            return {"tokens": text, "labels": np.append(text[1:], -100)}
        return {"tokens": text[:-1], "labels": text[1:]}

    def describe(self, i):
        """Where sample i comes from, e.g. "data/a_text_document: documents 12, 7 (sample 77)"."""
        j = self.shuffle_index[i]
        (first, _), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        sequences = self.document_index[first:last + (last_offset + self.extra > 0)]
        return f"{self.dataset.path_prefix}: {self.dataset.documents(sequences)} (sample {i})"


def cached_blending_indices(weights, size, split, cache_dir):
    """BlendedDataset's (dataset_index, dataset_sample_index), kept in `cache_dir`."""
    if size is not None:
        weights = normalize(weights)  # again, as megatron does
    key = {"format": CACHE_FORMAT, "class": "BlendedDataset", "split": split, "weights": weights, "size": size}
    length = int(sum(weights)) if size is None else size
    layout = {"dataset_index": (np.dtype(np.int16), (length,)),
              "dataset_sample_index": (np.dtype(np.int64), (length,))}

    def build():
        return dict(zip(layout, blending_indices(weights, size)))

    what = f"{split} blend of {length:,} samples from {len(weights)} datasets"
    return tuple(cached(cache_dir, f"BlendedDataset-{split}", key, layout, build, what).values())


class BlendedDataset:
    """megatron's BlendedDataset: sample i is dataset_sample_index[i] of datasets[dataset_index[i]]."""

    def __init__(self, datasets, weights, size, indices):
        """`indices`: what cached_blending_indices(weights, size) returns."""
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = indices
        # A size only cuts the greedy draw short; without one, the draw differs.
        self.order = {"weights": weights if size is None else normalize(weights),
                      "exhaustive": size is None, "datasets": [d.order for d in datasets]}

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        return self.datasets[self.dataset_index[i]][self.dataset_sample_index[i]]

    def describe(self, i):
        """Where sample i comes from: a sample of one of the blended datasets."""
        part = self.datasets[self.dataset_index[i]]
        return f"{part.describe(self.dataset_sample_index[i])}, blend sample {i}"


def first_samples_agree(a, b, count):
    """Whether samples [0, count) of GPT or blended datasets `a` and `b` are the same: equal orders
    are equal index arrays (a size only cuts them short); other epochs or weights differ from the
    first sample on."""
    return a.order == b.order and min(len(a), len(b)) >= count


def build_gpt_datasets(paths, *, seq_length, split="969,30,1", seed=1234, sizes=(None, None, None),
                       cache_dir=None, fallback_cache_dir=None):
    """(train, valid, test), each None without samples, as megatron-core's builder makes them from
    `paths` (resolve_blend) and `sizes` (samples per split, None: one epoch)."""
    sizes = [None if s is None else int(s) for s in sizes]
    builder = SplitsBuilder(paths, split, sizes, int(seq_length), int(seed), cache_dir, fallback_cache_dir)
    return builder.build() if distributed()[1] == 1 else build_in_turns(builder.build)


def train_samples(paths, *, seq_length, split, seed, num_samples, cache_dir=None, fallback_cache_dir=None):
    """The train split's samples, num_samples of them (None: one epoch), as build_gpt_datasets makes
    them; an unweighted list of prefixes asked for more than one epoch is blended by token count."""
    prefixes, weights = resolve_blend(paths)
    if num_samples is not None and weights is None and len(prefixes) > 1:
        # An unweighted list gives at most one epoch of each prefix (Megatron's limit), so a longer
        # run blends them by token count from the start, each repeated in whole epochs.
        epoch = one_epoch_samples(paths, seq_length=seq_length, split=split)
        if num_samples > epoch:
            log(f"{paths}: {num_samples:,} samples are more than one epoch ({epoch:,}); the prefixes "
                "are blended by token count, each repeated in whole epochs")
            paths = token_weighted_blend(paths)
    train, _, _ = build_gpt_datasets(paths, seq_length=seq_length, split=split, seed=seed,
                                     sizes=(num_samples, 0, 0), cache_dir=cache_dir,
                                     fallback_cache_dir=fallback_cache_dir)
    if train is None:
        raise ValueError(f"{paths}: the train split is empty (split {split!r})")
    if weights is not None:  # said at every start: the cache says it only when it builds the blend
        shares = normalize(weights)
        if len(prefixes) > 8:
            log(f"train blend: {len(prefixes)} prefixes, weights {min(shares):.4f} to {max(shares):.4f}")
        else:
            log("train blend: " + ", ".join(f"{p} {share:.4f}" for p, share in zip(prefixes, shares)))
    return train


def build_in_turns(build):
    """build() on every rank: first on each node's leader, which writes the index cache (leaders on
    one filesystem write the same entries, each through its own temporaries), then on the others,
    which map it. A failure on any rank is raised on every rank in one line, so that none waits."""
    import torch.distributed as dist  # a process group exists, so torch is already imported
    result, failures = None, [None] * distributed()[1]
    for leaders_turn in (True, False):
        error = failure = None
        if node_leader() == leaders_turn:
            try:
                result = build()
            except Exception as raised:
                error = raised  # the others raise the same kind of error, in one line
                kind = OSError if isinstance(error, OSError) else ValueError
                # Its first line, or its kind where it has no text (a bare assert).
                failure = kind, (str(error).splitlines() or [type(error).__name__])[0]
        dist.all_gather_object(failures, failure)
        if error is not None:
            raise error
        for rank, shared in enumerate(failures):
            if shared is not None:
                raise shared[0](f"{shared[1]} (on rank {rank})")
    return result


class SplitsBuilder:
    """The datasets, cache directories and parameters that build_gpt_datasets builds splits from."""

    def __init__(self, paths, split, sizes, seq_length, seed, cache_dir, fallback_cache_dir):
        self.prefixes, self.weights = resolve_blend(paths)
        self.split, self.matrix, self.sizes = split, split_matrix(split), sizes
        self.seq_length, self.seed = seq_length, seed
        self.datasets = [IndexedDataset(p, check=False) for p in self.prefixes]  # build() checks
        if self.weights is not None:
            missing = [SPLITS[i] for i in range(3) if self.matrix[i] and sizes[i] is None]
            if missing:
                raise ValueError(f"a weighted blend needs a size for every split; {missing} have None")
            self.weights = normalize(self.weights)
        where = cache_dir, fallback_cache_dir
        self.dirs = [cache_dir_for(p, "GPTDataset", *where) for p in self.prefixes]
        self.blend_dir = None
        if len(self.prefixes) > 1 or self.weights is not None:
            self.blend_dir = cache_dir_for(self.prefixes[0], "BlendedDataset", *where)

    def build(self):
        if node_leader():
            for directory in {d for d in self.dirs + [self.blend_dir] if d is not None}:
                remove_stale_temporaries(directory)
        for dataset, directory in zip(self.datasets, self.dirs):
            check_once(dataset, directory)
        # A weighted blend's index needs only the weights and the size: a helper thread builds it
        # beside the datasets' indices, which hides most of its time on a cold start.
        with concurrent.futures.ThreadPoolExecutor(1) as self.helper:
            return tuple(self.blend(i) for i in range(3))

    def gpt_split(self, d, i, num_samples):
        """The GPTDataset of split i of datasets[d], or None when it yields no samples."""
        dataset = self.datasets[d]
        begin, end = split_range(len(dataset), self.matrix[i])
        if not dataset.sequence_lengths[begin:end].any():
            if num_samples:  # megatron-core loops forever here
                raise ValueError(f"{dataset.path_prefix}: its {SPLITS[i]} split ({self.split!r}: sequences "
                                 f"[{begin}, {end})) has no tokens, but {num_samples} samples were asked")
            return None
        part = GPTDataset(dataset, begin, end, seq_length=self.seq_length, num_samples=num_samples,
                          seed=self.seed, split=SPLITS[i], cache_dir=self.dirs[d])
        return part if len(part) else None

    def blend(self, i):
        """Split i, blended or not, or None when it has no samples."""
        size, indices = self.sizes[i], None
        if self.matrix[i] is None:
            return None
        if self.weights is None and len(self.prefixes) == 1:
            return self.gpt_split(0, i, size)
        if self.weights is not None:  # each dataset's share, built with megatron's 0.5% surplus
            targets = [math.ceil(size * w) for w in self.weights]
            weights, size = self.weights, sum(targets)
            if size:
                indices = self.helper.submit(cached_blending_indices, weights, size, SPLITS[i],
                                             self.blend_dir)
            parts = [self.gpt_split(d, i, math.ceil(n * (1 + 0.005))) for d, n in enumerate(targets)]
        else:  # one epoch of each, in proportion to their samples
            parts = [self.gpt_split(d, i, None) for d in range(len(self.datasets))]
            weights = [0 if part is None else len(part) for part in parts]
            if size is not None:  # megatron's cap (token_weighted_blend goes past it)
                size = min(size, sum(weights))
        if size == 0 or sum(weights) == 0:
            return None
        if None in parts:  # megatron-core cannot blend an empty dataset either (it asserts)
            raise ValueError(f"{self.prefixes[parts.index(None)]}: its {SPLITS[i]} split ({self.split!r}) "
                             f"has no samples of {self.seq_length} tokens to take part in the blend")
        if indices is None:
            indices = self.helper.submit(cached_blending_indices, weights, size, SPLITS[i],
                                         self.blend_dir)
        return BlendedDataset(parts, weights, size, indices.result())


class TokenWindows:
    """Window k of the stream `lead` + `pieces` [(dataset, sequence ids), ...] is stream[k*T:k*T+T+1]
    as {"tokens": its first T, "labels": its last T}, as llm.c reads; at most `length` of them."""

    def __init__(self, pieces, seq_length, length=None, lead=()):
        self.pieces, self.seq_length, self.lead = pieces, seq_length, np.asarray(lead, dtype=np.int64)
        self.piece_starts, self.num_tokens = [], len(self.lead)  # each sequence's start; the end
        for dataset, sequences in pieces:
            lengths = np.r_[0, dataset.sequence_lengths[sequences]]
            self.piece_starts.append(self.num_tokens + np.cumsum(lengths, dtype=np.int64))
            self.num_tokens = int(self.piece_starts[-1][-1])
        self.length = min(max(0, (self.num_tokens - 1) // seq_length), math.inf if length is None else length)

    def __len__(self):
        return self.length

    def _window(self, i):
        """Window i's [start, stop) and the (dataset, sequences, starts, positions) it reads."""
        start = range(self.length)[i] * self.seq_length  # IndexError past the end; i < 0 from it
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
        where = [f"{ds.path_prefix}: {ds.documents(sequences[positions.start:positions.stop])}"
                 for ds, sequences, _, positions in self._window(i)[2]]
        return f"{'; '.join(where)} (window {i})"


class LLMCValWindows(TokenWindows):
    """llm.c's validation batches: num_tokens // seq_length windows of [eot] + every document of
    `path_prefix` in order. llm.c puts EOT before each document and we after: this is its val shard."""

    def __init__(self, path_prefix, seq_length, num_tokens, eot=EOT):
        prefixes, windows = resolve_blend(path_prefix)[0], num_tokens // seq_length
        pieces = [(ds, np.arange(len(ds))) for ds in map(IndexedDataset, prefixes)]
        super().__init__(pieces, seq_length, windows, [eot])
        if len(self) < windows:
            raise ValueError(f"{', '.join(p + '.bin' for p in prefixes)}: the stream holds {self.num_tokens} "
                             f"tokens with the leading EOT, fewer than the {windows * seq_length + 1} that "
                             f"{windows} windows need")


def sequential_samples(paths, *, seq_length, split="969,30,1", split_index=1, max_samples=None):
    """One split's sequences in order as TokenWindows, to validate on; None for a zero ratio."""
    prefixes, _ = resolve_blend(paths)
    bookends = split_matrix(split)[split_index]
    if bookends is None:
        return None
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    pieces = [(ds, np.arange(*split_range(len(ds), bookends))) for ds in datasets]
    return TokenWindows(pieces, seq_length, max_samples)


class PretrainingSampler:
    """One rank's micro-batches, as megatron's MegatronPretrainingSampler: rank r takes the r-th mbs of
    each global batch of mbs*W after `consumed_samples`: a restart on any world size continues."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, rank, world_size):
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside [0, {total_samples}]")
        self.micro_batch_size, self.global_batch = micro_batch_size, micro_batch_size * world_size
        self.first = consumed_samples + rank * micro_batch_size  # in each global batch
        self.steps = (total_samples - consumed_samples) // self.global_batch

    def __iter__(self):
        for first in range(self.first, self.first + self.steps * self.global_batch, self.global_batch):
            yield list(range(first, first + self.micro_batch_size))


# The command line
def verify(prefixes, vocab_size=None, read_tokens=True):
    """Print each prefix's counts and sizes (with `read_tokens` its ids); return the problems."""
    problems = []
    for prefix in prefixes:
        try:
            ds = IndexedDataset(prefix)
            if read_tokens and not ds.num_tokens:
                raise ValueError(f"{prefix}.bin: no tokens ({ds.num_documents} documents): megatron cannot map it")
        except (ValueError, FileNotFoundError) as error:
            problems.append(str(error))
            continue
        line = (f"{prefix}: {ds.num_documents:,} documents, {len(ds):,} sequences, {ds.num_tokens:,} tokens "
                f"({ds.dtype}); .bin {ds.sizes['.bin']:,} bytes, .idx {ds.sizes['.idx']:,} bytes")
        if read_tokens:
            low, high = int(ds.tokens.min()), int(ds.tokens.max())
            line += f", ids in [{low}, {high}]"
            if vocab_size is not None and not 0 <= low <= high < vocab_size:
                problems.append(f"{prefix}.bin: token ids span [{low}, {high}], outside [0, {vocab_size})")
        print(line)
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description="Inspect Megatron datasets (<prefix>.bin + .idx).")
    parser.add_argument("command", choices=["info", "verify"], help="verify also reads every token")
    parser.add_argument("paths", metavar="PREFIX_OR_GLOB", nargs="+")
    parser.add_argument("--vocab-size", type=int, default=None, help="verify: fail on ids >= this")
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
    print(f"{len(problems)} problem(s)" if problems else "OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
