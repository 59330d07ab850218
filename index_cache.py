"""The on-disk cache of indexed_dataset.py's GPT and blend indices, and where it lives.

Megatron-core keeps a GPTDataset's indices beside its data (`<prefix>/cache/GPTDataset_indices`), under a hash of its
parameters, and loads them on every later run; so does this. Rank 0 writes, every file atomically (atomic_io), and
the description of an entry last, so a reader sees a whole entry or none.
"""
import hashlib
import json
import os
import sys

import numpy as np

from atomic_io import atomic_write

CACHE_FORMAT = 2  # bump when the cached arrays or their key change meaning (2: keyed by the .idx's size and mtime)


def cached(cache_dir, name, key, build, write):
    """The arrays `build()` returns, kept in `cache_dir` as `{hash}-{name}-{array}.npy` under a hash of `key`.

    `key` holds every parameter and each source .idx's path, size and mtime, so new data or settings miss. The
    description `{hash}-{name}.json`, written last, records the key and each array's dtype, shape and sha256. A load
    checks the key, the dtypes and shapes and the file sizes (cheap); a cache failing any is rebuilt. Reading every
    byte would cost more than the load itself, so the checksums are checked only by `dataset_tools.py verify-cache`.
    """
    if cache_dir is None:
        return build()
    base = os.path.join(cache_dir, f"{cache_digest(key)}-{name}")
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
            description["arrays"][array_name] = {"dtype": values.dtype.str, "shape": list(values.shape),
                                                 "sha256": hashlib.sha256(np.ascontiguousarray(values)).hexdigest()}
        with atomic_write(base + ".json", "w") as f:
            json.dump(description, f, indent=1)
    return arrays


def cache_digest(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


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
    """(a directory per prefix, one for the blends): `cache_dir` if given; else beside the data, where megatron-core
    keeps its GPTDataset indices (`<prefix>/cache/GPTDataset_indices`; it keeps no blend, ours go beside the first
    prefix); else, where that cannot be written, `fallback_cache_dir`; else None (built in memory). `blended`: whether
    the blends need one."""
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


def distributed():
    """(rank, world size) of the initialized torch.distributed group, else (0, 1). Never imports torch itself:
    a process that has not imported it has no process group."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def log(message):
    if distributed()[0] == 0:
        print(f"indexed_dataset: {message}", file=sys.stderr, flush=True)
