"""
Checkpoints and loading a model from anything.

A training run keeps out_dir/ckpt/step_NNNNNNNN/: the DCP files of model and optimizer (each rank writes its own
shard; any number of ranks can load them), train_state.json (step, consumed samples, architecture, config) and
rng.pt. `load_model` turns any name a user may give (a hub id, an HF GPT-2 directory, a training out_dir, one
checkpoint directory) into a plain fp32 GPT on the CPU; sample.py, hellaswag.py and train_gpt2.py all use it.
"""
import json
import os
import random
import re
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from atomic_io import atomic_write, fsync_dir
from distributed import any_rank, barrier, broadcast_object, rank_and_world_size
from hf_weights import from_pretrained
from model import GPT, GPTConfig

# a checkpoint saved or loaded without a process group is meant to be: one process trains, or reads, it whole
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")



# A checkpoint is complete when MARKER is in it: written last, after every file of the checkpoint (the DCP shards and
# .metadata included) and the directory itself were fsynced. Checkpoints written before markers existed carry no
# "format" key in train_state.json; that code published a checkpoint by renaming a fully written temporary directory,
# so for them the three files being there is enough. A checkpoint with "format": 2 and no marker is incomplete.
MARKER = "complete.json"
FORMAT = 2
CHECKPOINT_FILES = (".metadata", "train_state.json", "rng.pt")


def is_complete(path):
    """Whether checkpoint directory `path` was completely written (by this code, or by the code before markers)."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return True
    if not all(os.path.isfile(os.path.join(path, f)) for f in CHECKPOINT_FILES):
        return False
    try:
        return "format" not in read_train_state(path)
    except (OSError, ValueError):
        return True  # a legacy checkpoint with a damaged train_state.json: check_checkpoint reports it


def complete_checkpoints(ckpt_root):
    """Paths of the complete checkpoints under ckpt_root, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    paths = [os.path.join(ckpt_root, name) for name in os.listdir(ckpt_root) if re.fullmatch(r"step_\d{8}", name)]
    return sorted(path for path in paths if is_complete(path))


def resolve_checkpoint(path):
    """A checkpoint directory, or the newest complete checkpoint of a train_gpt2 out_dir."""
    if os.path.isfile(os.path.join(path, "train_state.json")):
        return path
    found = complete_checkpoints(os.path.join(path, "ckpt"))
    if not found:
        raise FileNotFoundError(f"{path}: neither a checkpoint directory nor an out_dir with a complete checkpoint "
                                f"under ckpt/")
    return found[-1]


def read_train_state(ckpt_path):
    with open(os.path.join(ckpt_path, "train_state.json"), encoding="utf-8") as f:
        return json.load(f)


def check_checkpoint(path):
    """None when the files of checkpoint `path` are all there and readable, else why not (naming the file). Cheap:
    reads train_state.json, rng.pt and .metadata, and checks every shard file is as long as .metadata says."""
    name = os.path.join(path, "train_state.json")
    try:
        state = read_train_state(path)
        for key in ("step", "consumed_samples", "model_config"):
            if key not in state:
                return f"{name}: no '{key}'"
        name = os.path.join(path, "rng.pt")
        torch.load(name, weights_only=False)
        name = os.path.join(path, ".metadata")
        ends = {}
        for info in dcp.FileSystemReader(path).read_metadata().storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for shard, end in sorted(ends.items()):
            name = os.path.join(path, shard)
            size = os.path.getsize(name)
            if size < end:
                return f"{name}: truncated ({size} bytes, .metadata needs {end})"
        if os.path.isfile(os.path.join(path, MARKER)):
            name = os.path.join(path, MARKER)
            with open(name, encoding="utf-8") as f:
                for file, size in json.load(f)["sizes"].items():
                    name = os.path.join(path, file)
                    if os.path.getsize(name) != size:
                        return f"{name}: {os.path.getsize(name)} bytes, {size} when written"
    except Exception as e:  # any way a file can be unreadable: missing, empty, truncated, not JSON, not a pickle
        return f"{name}: {type(e).__name__}: {e}"
    return None


def set_aside(path, why):
    """Rename a checkpoint that must not be used to PATH.WHY-TIME, kept for inspection; return the new name."""
    new = f"{path}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    while os.path.exists(new):
        new += "x"
    os.rename(path, new)
    return new


def newest_usable_checkpoint(ckpt_root):
    """(the newest complete checkpoint whose files are all readable or None, messages). Damaged newer ones are
    renamed aside, never deleted. Rank 0 only: the caller broadcasts the choice."""
    messages = []
    for path in reversed(complete_checkpoints(ckpt_root)):
        problem = check_checkpoint(path)
        if problem is None:
            return path, messages
        messages.append(f"skipping damaged checkpoint {path}: {problem}; kept as {set_aside(path, 'damaged')}")
    return None, messages


def assert_finite(model, what, ckpt_root):
    """Raise FloatingPointError on every rank when any rank's parameters hold NaN or inf, so that no checkpoint or
    export ever holds them. Collective: every rank calls it (each checks its own shard)."""
    params = dict(model.named_parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params.values()]
    finite = torch.stack([torch.isfinite(t.detach()).all() for t in local]).tolist()  # one device sync, not one each
    bad = [name for name, ok in zip(params, finite) if not ok]
    if any_rank(bad):
        raise FloatingPointError(f"{what}: parameters hold NaN or inf ("
                                 + (", ".join(bad[:3]) if bad else "on another rank")
                                 + f"); nothing was written. {last_good_checkpoint(ckpt_root)}")


def last_good_checkpoint(ckpt_root):
    """The sentence every stop for non-finite numbers ends with: where the run can be taken up again."""
    kept = complete_checkpoints(ckpt_root)
    return "The last good checkpoint is " + (kept[-1] if kept else "none (none was written)")


def fsync_tree(path):
    """fsync every file in directory `path`, then the directory (DCP already syncs the shards it writes, on every
    node; this covers the rest and the directory entries). Returns {file name: size} for the marker."""
    sizes = {}
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        sizes[name] = os.path.getsize(file)
    fsync_dir(path)
    return sizes


def checkpoint_write_error(e, path):
    """An OSError for a failed checkpoint write: DCP wraps each rank's exception into a CheckpointException."""
    failures = getattr(e, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, OSError):
            return OSError(cause.errno, f"writing checkpoint {path} failed on rank {rank}: "
                                        f"{cause.strerror or cause}", cause.filename)
    if isinstance(e, OSError):
        return OSError(e.errno, f"writing checkpoint {path} failed: {e.strerror or e}", e.filename)
    return None


def save_checkpoint(ckpt_root, model, optimizer, train_state, keep, rank):
    """Write a checkpoint into a temporary directory, fsync it, write the marker, publish it by renaming, then delete
    all but the newest `keep` complete ones. Non-finite weights raise FloatingPointError instead; a failed write
    raises OSError and leaves no directory that looks complete. Collective: every rank calls it."""
    assert_finite(model, f"checkpoint at step {train_state['step']}", ckpt_root)
    final = os.path.join(ckpt_root, f"step_{train_state['step']:08d}")
    if broadcast_object(is_complete(final) if rank == 0 else None):
        return final  # this very state is already saved (a run resumed here and stopped at once)
    tmp = final + ".tmp"
    if rank == 0:
        if os.path.exists(final):
            print(f"incomplete checkpoint {final} moved to {set_aside(final, 'incomplete')}")
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover of an interrupted write
        os.makedirs(tmp)
    barrier()
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        if rank == 0:  # dcp.save returns on rank 0 after every rank's files are written
            rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                       cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
            with atomic_write(os.path.join(tmp, "rng.pt")) as f:
                torch.save(rng, f)
            with atomic_write(os.path.join(tmp, "train_state.json"), "w", encoding="utf-8") as f:
                json.dump(dict(train_state, format=FORMAT), f, indent=2)
            sizes = fsync_tree(tmp)
            with atomic_write(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
                json.dump(dict(step=train_state["step"], sizes=sizes), f, indent=2)
            os.rename(tmp, final)
            fsync_dir(ckpt_root)
    except (Exception, CheckpointException) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space; it never held a marker
        error = checkpoint_write_error(e, final)
        if error is None:
            raise
        raise error from None
    if rank == 0:
        for old in complete_checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def restore_rng(ckpt_path):
    # every rank was seeded alike and nothing draws per-rank randomness, so rank 0's states serve all ranks
    rng = torch.load(os.path.join(ckpt_path, "rng.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def load_checkpoint(ckpt_path, model, optimizer):
    """Load model, optimizer and RNG states in place (resharding onto this run's ranks); return train_state.json.
    When any rank fails to read ckpt_path, every rank learns it (DCP's load is collective, so all must move on
    together): it is renamed aside and the next older complete checkpoint of the same run is tried."""
    older = [path for path in reversed(complete_checkpoints(os.path.dirname(ckpt_path))) if path < ckpt_path]
    candidates = [ckpt_path] + broadcast_object(older)
    for path in candidates:
        error = None
        try:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            restore_rng(path)
            train_state = read_train_state(path)
        except (Exception, CheckpointException) as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not any_rank(error is not None):
            return train_state
        if rank_and_world_size()[0] == 0:
            print(f"skipping checkpoint {path}: it failed to load ({error or 'on another rank'}); kept as "
                  f"{set_aside(path, 'damaged')}")
        barrier()
    raise ValueError(f"{os.path.dirname(ckpt_path)}: no checkpoint could be loaded (damaged ones were renamed "
                     f"*.damaged-*); start a fresh run in another out_dir")


def load_weights(ckpt_path, model):
    """Load only the model weights of a checkpoint into `model` (plain or sharded, any number of ranks)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=ckpt_path)
    set_model_state_dict(model, state["model"])


def model_from_checkpoint(path):
    """A plain fp32 GPT on the CPU from a train_gpt2 out_dir (its newest complete checkpoint) or one checkpoint
    directory, with the architecture stored in the checkpoint. Call it where no process group is initialised."""
    ckpt_path = resolve_checkpoint(path)
    model = GPT(GPTConfig(**read_train_state(ckpt_path)["model_config"]))
    load_weights(ckpt_path, model)
    return model


def is_run_or_checkpoint(path):
    """Whether `path` is what train_gpt2.py writes: an out_dir (with ckpt/) or one checkpoint directory."""
    return os.path.isdir(os.path.join(path, "ckpt")) or os.path.isfile(os.path.join(path, "train_state.json"))


def load_model(name_or_path):
    """A GPT in fp32 on the CPU from a hub name, an HF GPT-2 directory, or a training out_dir / checkpoint directory."""
    if os.path.isdir(name_or_path):
        # what train_gpt2.py writes: out_dir/ckpt/step_N/ with train_state.json; anything else is read as HF GPT-2
        if is_run_or_checkpoint(name_or_path):
            return model_from_checkpoint(name_or_path)
        return from_pretrained(name_or_path)
    if os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path}: a file; expected a model directory, a training out_dir or a hub name")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.endswith(os.sep):
        raise FileNotFoundError(f"{name_or_path}: no such model directory")
    return from_pretrained(name_or_path)
