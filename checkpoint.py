"""train_gpt2.py's checkpoints: out_dir/ckpt/step_NNNNNNNN/ (DCP shards, rng.pt, train_state.json),
written whole or not at all, in the background by default, and read back with every check a resume
needs (damaged files, non-finite numbers, another optimizer, other data). Also load_model, which
sample.py and hellaswag.py use to read a run, a checkpoint or a Hugging Face model."""
import concurrent.futures
import contextlib
import dataclasses
import datetime
import errno
import functools
import hashlib
import io
import json
import os
import pathlib
import random
import re
import shutil
import sys
import time
import warnings
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from atomic_io import atomic_write, error_reason, fsync_dir, lock_holder
from hf_files import (FINGERPRINT_TOLERANCE, HF_CONFIG_KEYS, fingerprint_difference,
                      from_pretrained, resolve_pretrained)
from indexed_dataset import first_samples_agree, train_samples
from model import GPT, GPTConfig, local_block
from processes import (any_rank, barrier, broadcast_object, first_line, is_master, on_each_node,
                       on_rank0)

# A checkpoint is complete once MARKER is written, which is written last; it lists every file's size.
MARKER = "complete.json"

# A checkpoint saved or loaded without a process group is meant to be: one process uses it whole.
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")
# torch's own checkpoint writer calls tensor.storage(): the deprecation warning is not the user's.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)


# ---------------------------------------------------------------------------- finding checkpoints

def complete_checkpoints(ckpt_root):
    """Paths of the complete checkpoints under ckpt_root, oldest first."""
    names = os.listdir(ckpt_root) if os.path.isdir(ckpt_root) else []
    paths = [os.path.join(ckpt_root, name) for name in names if re.fullmatch(r"step_\d{8}", name)]
    return sorted(path for path in paths if os.path.isfile(os.path.join(path, MARKER)))


def read_train_state(ckpt_path):
    return json.loads(pathlib.Path(ckpt_path, "train_state.json").read_text(encoding="utf-8"))


def check_checkpoint(path):
    """None if each file of checkpoint `path` has its written size and CRC-32 and its state reads;
    else why. The CRC finds bytes changed in place (a bad disk block), which DCP would load."""
    name = os.path.join(path, MARKER)
    try:
        for file, written in json.loads(pathlib.Path(name).read_text())["files"].items():
            name = os.path.join(path, file)
            actual = os.path.getsize(name)
            if actual != written["size"]:
                return f"{name}: truncated or changed ({actual} bytes, {written['size']} when written)"
            with open(name, "rb") as f:
                if file_crc32(f) != written["crc32"]:
                    return f"{name}: its bytes changed since it was written (CRC-32 differs)"
        name = os.path.join(path, "train_state.json")
        read_train_state(path)
        return None
    except Exception as e:  # any way a file can be unreadable: missing, empty, not JSON
        return f"{name}: {type(e).__name__}: {e}"


def set_aside(path, why):
    """Rename a checkpoint not to be used to PATH.WHY-TIME, kept for inspection; the new name."""
    new = f"{path}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    while os.path.exists(new):
        new += "x"
    os.rename(path, new)
    return new


def checkpoint_problem(path, load=None):
    """Why checkpoint `path` is not usable (check_checkpoint's answer, or load(path)'s error), or None."""
    problem = check_checkpoint(path)
    if problem is None and load is not None:
        try:
            load(path)
        except CodeChanged:
            raise  # the code changed, not the checkpoint
        # Whatever else failed to read, the checkpoint is the problem; DCP's error is no Exception.
        except (Exception, dcp.CheckpointException) as e:
            problem = load_error(e)
    return problem


def load_error(error):
    """What failed to read, in a few words; DCP's CheckpointException holds each rank's cause."""
    cause = next(iter(getattr(error, "failures", {}).values()), (error,))[0]
    return f"{type(cause).__name__}: {first_line(cause)}"


def newest_usable_checkpoint(ckpt_root, read_only=False, load=None):
    """(the newest complete checkpoint that check_checkpoint and load(path), if given, pass, or
    None; messages naming those skipped). Damaged ones are renamed aside, or with read_only left."""
    messages, damaged = [], []
    while found := [path for path in complete_checkpoints(ckpt_root) if path not in damaged]:
        newest = found[-1]
        problem = checkpoint_problem(newest, load)
        if problem is None:
            return newest, messages
        # A live run may delete checkpoints or write a newer one while we read: a checkpoint is
        # called damaged only if the list did not change meanwhile; else look again from the newest.
        if [path for path in complete_checkpoints(ckpt_root) if path not in damaged] == found:
            damaged.append(newest)
            kept = "left in place" if read_only else f"kept as {set_aside(newest, 'damaged')}"
            messages.append(f"skipping damaged checkpoint {newest}: {problem}; {kept}")
    return None, messages


def is_run_or_checkpoint(path):
    """Whether `path` is what train_gpt2.py writes: an out_dir (with ckpt/) or one checkpoint."""
    return (os.path.isdir(os.path.join(path, "ckpt"))
            or os.path.isfile(os.path.join(path, "train_state.json")))


def resolve_checkpoint(path, load=None):
    """A checkpoint as named, or a run's newest usable one, read-only (skips go to stderr)."""
    if os.path.isfile(os.path.join(path, "train_state.json")):
        problem = checkpoint_problem(path, load)
        if problem is not None:  # named outright: nothing older to fall back on
            raise ValueError(f"{path}: not a usable checkpoint: {problem}")
        return path
    ckpt_root = os.path.join(path, "ckpt")
    found, messages = newest_usable_checkpoint(ckpt_root, read_only=True, load=load)
    for message in messages:
        print(message, file=sys.stderr)
    if found is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint nor a run with a usable checkpoint "
                                f"under ckpt/")
    return found


def last_good_checkpoint(out_dir):
    """Where a run stopped for non-finite numbers can be taken up again, as a sentence."""
    kept = complete_checkpoints(os.path.join(out_dir, "ckpt"))
    return f"The last good checkpoint is {kept[-1] if kept else 'none (none was written)'}"


# ------------------------------------------------------------------------ non-finite numbers

def nonfinite(model, optimizer=None):
    """Names of this rank's parameters (and optimizer moments) holding NaN or inf, or a negative
    exp_avg_sq, in one device sync."""
    checks = {name: torch.isfinite(local_block(p)[0]).all() for name, p in model.named_parameters()}
    names = {p: name for name, p in model.named_parameters()}
    states = [item for opt in optimizer or [] for item in opt.state.items()]
    for p, state in states:
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # the moments, not the step
                shard = local_block(value)[0]  # this rank's part of a DTensor moment
                ok = torch.isfinite(shard).all()
                if key == "exp_avg_sq":
                    ok = ok & (shard >= 0).all()
                checks[f"{names[p]} ({key})"] = ok
    flags = torch.stack(list(checks.values())).tolist()
    return [name for name, ok in zip(checks, flags) if not ok]


def assert_finite(model, what, out_dir):
    """FloatingPointError on every rank when any rank's shard holds NaN or inf, so that no such
    weights are ever saved or exported."""
    bad = nonfinite(model)
    if any_rank(bad):
        where = ", ".join(bad[:3]) or "on another rank"
        raise FloatingPointError(f"{what}: parameters hold NaN or inf ({where}); nothing was "
                                 f"written. {last_good_checkpoint(out_dir)}")


# --------------------------------------------------------------------------- writing checkpoints

# The optimizer's state is saved per parameter name ("state.<name>.exp_avg"); the groups'
# hyperparameters are not saved, as build_optimizer() and the config set them. So a resume pairs
# each parameter with its own moments even where the grouping changed.
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def training_state(model, optimizer, step, extra_state):
    """The state dict that a checkpoint at `step` holds: the model, the optimizer's moments and
    `extra_state` (train_gpt2.build_extra_state: an edit's own, such as an EMA of the weights).
    Before the first update AdamW has no state, and get_state_dict would make one up (step 1,
    zero moments) that changes every later update: a step-0 checkpoint holds no optimizer."""
    if step == 0:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=BY_NAME)
        state = {"model": model_state,
                 "optim": {key: value for key, value in optim_state.items()
                           if key.startswith("state.")}}
    if extra_state:
        state["extra"] = extra_state
    return state


def state_keys(state, prefix=""):
    """The flat keys of a nested state dict, as DCP names them in its metadata ("optim.state.x")."""
    keys = []
    for key, value in state.items():
        if isinstance(value, dict):
            keys += state_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def saved_state_keys(path):
    """The flat keys of the state that checkpoint `path` holds, read from DCP's metadata."""
    return list(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def rng_state():
    """The random generators' states, serialized in memory: a full disk then fails in write() as an
    OSError naming the file, where torch.save's zip writer says "unexpected pos"."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    state = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
                 python=random.getstate(), cuda=cuda)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_json(path, obj):
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def file_crc32(f):
    crc = 0
    while block := f.read(1 << 24):
        crc = zlib.crc32(block, crc)
    return crc


def fsync_tree(path):
    """fsync every file in directory `path`, then the directory; {file name: its size and CRC-32}
    for the marker (read back from the page cache the write just filled)."""
    files = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
            files[name] = dict(size=os.fstat(f.fileno()).st_size, crc32=file_crc32(f))
    fsync_dir(path)
    return files


WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # so one checkpoint write at a time


def save_checkpoint(cfg, model, optimizer, step, data, extra_state, group=None):
    """Checkpoint `step`: the state, the random generators and train_state.json as they are now; a
    Future of write_checkpoint's (path, seconds). Every rank calls it. Under async_checkpoint the
    state is copied to CPU memory (dcp.async_save) and a thread writes it beside training."""
    assert_finite(model, f"checkpoint at step {step}", cfg.out_dir)
    final = os.path.join(cfg.out_dir, "ckpt", f"step_{step:08d}")
    if broadcast_object(os.path.isfile(os.path.join(final, MARKER))):
        return WRITER.submit(lambda: (final, 0.0))  # already saved: a run resumed here and stopped
    tmp = final + ".tmp"
    if is_master():
        if os.path.exists(final):
            print(f"incomplete checkpoint {final} moved to {set_aside(final, 'incomplete')}")
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover of an interrupted write
        os.makedirs(tmp)
    barrier()
    state = training_state(model, optimizer, step, extra_state)
    train_state = dict(step=step, consumed_samples=step * cfg.global_batch_size, **data,
                       world_size=dist.get_world_size() if dist.is_initialized() else 1,
                       config=dataclasses.asdict(cfg),
                       model_config=dataclasses.asdict(model.config), tensors=tensor_shapes(model))
    if cfg.async_checkpoint:
        shards = dcp.async_save(state, checkpoint_id=tmp, process_group=group).result
        return WRITER.submit(write_checkpoint, cfg, final, shards, rng_state(), train_state, group)
    shards = functools.partial(dcp.save, state, checkpoint_id=tmp)  # here, over the default group
    written = write_checkpoint(cfg, final, shards, rng_state(), train_state)
    return WRITER.submit(lambda: written)


def write_checkpoint(cfg, final, write_shards, rng, train_state, group=None):
    """Write ckpt/step_N.tmp (write_shards(), rng.pt, train_state.json), fsync it, write its marker
    last and rename it to step_N; then drop the oldest beyond ckpt_keep. Every rank calls it."""
    t0 = time.perf_counter()
    ckpt_root, tmp = os.path.dirname(final), final + ".tmp"
    try:
        write_shards()
        if is_master():  # the DCP save returns on rank 0 once every rank's files are written
            with atomic_write(os.path.join(tmp, "rng.pt")) as f:
                f.write(rng)
            write_json(os.path.join(tmp, "train_state.json"), train_state)
            files = fsync_tree(tmp)
            write_json(os.path.join(tmp, MARKER), dict(step=train_state["step"], files=files))
            os.rename(tmp, final)
            fsync_dir(ckpt_root)
    except (Exception, dcp.CheckpointException) as e:
        error = checkpoint_error(e, final)  # while the disk is still as full as the write found it
        if is_master():
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space; it never held a marker
        raise error from None
    if is_master():
        for old in complete_checkpoints(ckpt_root)[:-cfg.ckpt_keep]:
            shutil.rmtree(old)
    barrier(group)
    return final, time.perf_counter() - t0


def checkpoint_error(error, final):
    """The OSError that says why writing checkpoint `final` failed (a full disk, a read-only
    directory), on which rank; or `error` itself. DCP wraps each rank's exception."""
    failures = getattr(error, "failures", None) or {}  # {rank: (exception, traceback)}
    causes = [(f" on rank {rank}", failures[rank][0]) for rank in sorted(failures)]
    for where, cause in causes or [("", error)]:
        if isinstance(cause, (OSError, RuntimeError)):
            code, reason = getattr(cause, "errno", None), error_reason(cause)
            # torch's zip writer (DCP writes small items with it) says only "unexpected pos" when a
            # write falls short. The free space tells too, but only until rank 0 has removed the
            # failed write: another rank may look after that.
            full = "unexpected pos" in reason
            with contextlib.suppress(OSError):
                full = full or shutil.disk_usage(os.path.dirname(final)).free < 2**20
            if code is None and full:
                code, reason = errno.ENOSPC, os.strerror(errno.ENOSPC)
            return OSError(code, f"writing checkpoint {final} failed{where}: {reason}",
                           getattr(cause, "filename", None))
    return error


class Checkpoints:
    """The run's checkpoint writes, one at a time. Under async_checkpoint the step waits only for
    the copy of the state; the next save, a stop, the end of the run and an error wait for the
    write, and its error (a full disk) is raised there."""

    def __init__(self, cfg, log):
        self.cfg, self.log, self.written, self.group = cfg, log, None, None
        if cfg.async_checkpoint and dist.is_initialized():
            # Its own gloo group, as torchtitan's: the write's collectives and training's never mix.
            timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def save(self, model, optimizer, step, data, extra_state, wait=False):
        t0 = time.perf_counter()
        self.wait()
        self.written = save_checkpoint(self.cfg, model, optimizer, step, data, extra_state,
                                       self.group)
        self.waited = time.perf_counter() - t0
        if wait or not self.cfg.async_checkpoint:
            self.wait()

    def poll(self):
        """Say that the write is done, once it is; a failed one is left to wait()."""
        if self.written is not None and self.written.done() and not self.written.exception():
            self.wait()

    def wait(self):
        if self.written is not None:
            written, self.written = self.written, None
            path, seconds = written.result()
            self.log(f"saved checkpoint {path} (the step waited {self.waited:.1f} s, the write "
                     f"took {seconds:.1f} s)")


# --------------------------------------------------------------------------- reading checkpoints

def tensor_shapes(model):
    """{name: shape} of each tensor a checkpoint of `model` holds (global shapes, also sharded)."""
    return {name: list(tensor.shape) for name, tensor in get_model_state_dict(model).items()}


def model_differences(saved, now):
    """How two tensor_shapes() differ, as phrases: 'added A, B', 'missing C', 'reshaped D [..] ->
    [..]'; empty for the same model."""
    added = [name for name in now if name not in saved]
    missing = [name for name in saved if name not in now]
    reshaped = [f"{name} {saved[name]} -> {now[name]}" for name in now
                if name in saved and saved[name] != now[name]]
    return phrases_of(("added", added), ("missing", missing), ("reshaped", reshaped))


def phrases_of(*groups):
    """'WHAT A, B, C and N more' for each (what, names) group with names, the first three named."""
    phrases = []
    for what, names in groups:
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            phrases.append(f"{what} {', '.join(names[:3])}{more}")
    return phrases


def load_weights(ckpt_path, model, names=None):
    """A checkpoint's weights (those in `names`, default all) into `model` (plain or FSDP2); NaN
    or inf raise on every rank."""
    state = {"model": get_model_state_dict(model)}
    if names is not None:
        state["model"] = {name: state["model"][name] for name in names}
    dcp.load(state, checkpoint_id=ckpt_path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=names is None))
    params = dict(model.named_parameters())
    finite = torch.stack([torch.isfinite(local_block(p)[0]).all() for p in params.values()]).int()
    if any(isinstance(p, DTensor) for p in params.values()):
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # so that every rank raises alike
    bad = [name for name, ok in zip(params, finite.tolist()) if not ok]
    if bad:
        raise ValueError(f"{ckpt_path}: the weights hold NaN or inf ({', '.join(bad[:3])})")


def load_model(name_or_path):
    """A GPT in fp32 on the CPU from a hub id, an HF directory, or a run or checkpoint."""
    if not is_run_or_checkpoint(name_or_path):
        return from_pretrained(name_or_path)
    models = {}

    def load(path):
        models[path] = GPT(saved_model_config(path))
        load_weights(path, models[path])

    return models[resolve_checkpoint(name_or_path, load)]


class CodeChanged(ValueError):
    """A sound checkpoint that the code as it is now cannot take (a GPTConfig field, the training
    state): said in one line, and never a reason to set the checkpoint aside as damaged."""


def saved_model_config(path):
    """The GPTConfig that checkpoint `path` was written with. A field that model.py's GPTConfig
    lacks, or has and the checkpoint lacks, is one line naming it."""
    saved = read_train_state(path)["model_config"]
    fields = {field.name: field for field in dataclasses.fields(GPTConfig)}
    unknown = [f"{name}={saved[name]!r}" for name in saved if name not in fields]
    missing = [f"{name} (default {fields[name].default!r})" for name in fields if name not in saved]
    if unknown:
        raise CodeChanged(f"{path}: the checkpoint's model has {', '.join(unknown)}, which "
                          "model.py's GPTConfig lacks; add the field back to read it")
    if missing:
        raise CodeChanged(f"{path}: model.py's GPTConfig has {', '.join(missing)}, which the "
                          "checkpoint's model lacks (it was written before the field was added); "
                          "start the edited model from these weights in a new out_dir with "
                          "--init_from")
    return GPTConfig(**saved)


def model_config_of(cfg):
    """The GPTConfig that a TrainConfig describes: its GPTConfig fields, every one of them, with
    block_size seq_length's where the config leaves it None."""
    values = {field.name: getattr(cfg, field.name) for field in dataclasses.fields(GPTConfig)}
    values["block_size"] = cfg.block_size or cfg.seq_length
    return GPTConfig(**values)


def starting_point(cfg, resume_path):
    """(GPTConfig, (kind, source)) of the first weights: "resume", "checkpoint" (init_from a run),
    "hf" (a Hugging Face model, with our padded_vocab_size) or "seed" (GPT-2's init)."""
    configured = model_config_of(cfg)
    if resume_path is not None:
        model_config = saved_model_config(resume_path)
        # block_size left None follows the checkpoint; seq_length is the data's, compared there.
        differ = [f"{field} {value!r} (config: {getattr(configured, field)!r})"
                  for field, value in dataclasses.asdict(model_config).items()
                  if value != getattr(configured, field)
                  and not (field == "block_size" and cfg.block_size is None)]
        if differ and cfg.init_from is None:
            raise ValueError(f"{resume_path}: the checkpoint to resume from has "
                             f"{', '.join(differ)}; use the checkpoint's architecture or "
                             "another out_dir")
        return model_config, ("resume", resume_path)
    if cfg.init_from is None:
        return configured, ("seed", cfg.seed)
    if is_run_or_checkpoint(cfg.init_from):  # a run's weights
        path = on_rank0(lambda: init_checkpoint(cfg.init_from, cfg.init_from_partial))
        if cfg.init_from_partial:
            return configured, ("checkpoint", path)
        return saved_model_config(path), ("checkpoint", path)
    # A hub id is downloaded by each node into its own cache. The fields that config.json sets
    # are its own; padded_vocab_size and any field an edit added are the config's.
    directory, hf_config = on_each_node(lambda: resolve_pretrained(cfg.init_from))
    from_file = {field: getattr(hf_config, field) for field in HF_CONFIG_KEYS.values()}
    return dataclasses.replace(configured, **from_file), ("hf", directory)


def init_checkpoint(source, partial=False):
    """The checkpoint that init_from `source` names: itself, or a finished run's newest usable one.
    A run still training may delete a checkpoint while it is read: then name one yourself."""
    holder = lock_holder(os.path.join(source, ".lock"))
    if holder is not None:
        newest = complete_checkpoints(os.path.join(source, "ckpt"))
        example = newest[-1] if newest else os.path.join(source, "ckpt", "step_N")
        raise ValueError(f"init_from {source}: that run is still training ({holder}) and may delete "
                         f"its checkpoints while they are read; name one, e.g. {example}")
    # With init_from_partial the model is the config's, so the saved one need not fit the code.
    return resolve_checkpoint(source, load=read_train_state if partial else saved_model_config)


def load_init_checkpoint(path, model, partial=False):
    """The weights of checkpoint `path` into `model` (every rank calls); a fresh optimizer follows.
    A model that differs from the checkpoint's is refused in one line, or with `partial` gets the
    tensors that match by name and shape, the others keeping their init: a sentence saying which."""
    saved, now = on_rank0(lambda: read_train_state(path)["tensors"]), tensor_shapes(model)
    differ = model_differences(saved, now)
    if differ and not partial:
        raise ValueError(f"init_from {path}: the model differs from the checkpoint's "
                         f"({'; '.join(differ)}); set --init_from_partial=True to load the tensors "
                         "that match and start the others from their init")
    matching = [name for name in now if saved.get(name) == now[name]]
    try:
        load_weights(path, model, matching)
    except (RuntimeError, OSError, dcp.CheckpointException) as e:
        raise ValueError(f"init_from {path}: its weights do not load ({first_line(e)})") from None
    if not differ:
        return f"init_from: loaded the weights of {path}"
    return (f"init_from: loaded {len(matching)} of the model's {len(now)} tensors from {path}; "
            f"{'; '.join(differ)} (added and reshaped ones keep their init, missing ones are "
            "not used); the optimizer starts afresh")


def load_state(path, model, optimizer, extra_state):
    """Load checkpoint `path` into the model, the optimizer, the extra state (in place) and the
    random generators; its train_state.json. The optimizer keeps its own groups; each parameter
    gets its saved moments."""
    train_state = read_train_state(path)
    state = training_state(model, optimizer, train_state["step"], extra_state)
    dcp.load(state, checkpoint_id=path)  # in place
    if "optim" in state:
        _, groups = get_state_dict(model, optimizer, options=BY_NAME)
        groups = {k: v for k, v in groups.items() if k.startswith("param_groups.")}
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict={**state["optim"], **groups}, options=BY_NAME)
    else:  # no update yet: AdamW starts without state, as in the uninterrupted run
        set_model_state_dict(model, state["model"])
        for opt in optimizer:
            opt.state.clear()
    if nonfinite(model, optimizer):
        raise FloatingPointError("it holds NaN or inf weights, or a negative or non-finite "
                                 "Adam moment")
    # Every rank was seeded alike and nothing draws per-rank randomness: rank 0's states serve all.
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return train_state


def load_checkpoint(ckpt_path, model, optimizer, extra_state):
    """Load the newest checkpoint that loads on every rank, from `ckpt_path` back; one that fails
    on any rank is set aside as damaged. Its train_state.json."""
    ckpt_root = os.path.dirname(ckpt_path)
    older = [path for path in reversed(complete_checkpoints(ckpt_root)) if path < ckpt_path]
    for path in [ckpt_path] + broadcast_object(older):
        error = None
        try:
            train_state = load_state(path, model, optimizer, extra_state)
        except (Exception, dcp.CheckpointException) as e:
            error = load_error(e)
        if not any_rank(error is not None):
            return train_state
        if is_master():
            print(f"skipping checkpoint {path}: it failed to load ({error or 'on another rank'}); "
                  f"kept as {set_aside(path, 'damaged')}")
        barrier()
    raise ValueError(f"{ckpt_root}: no checkpoint loads (damaged ones were renamed *.damaged-*); "
                     "start a fresh run in another out_dir")


# ------------------------------------------------------------------------------- resume's checks

# The config keys that may change at a resume; the change is logged.
TUNABLE = ("max_steps", "lr", "min_lr", "lr_warmup_steps", "weight_decay", "beta1", "beta2",
           "adam_eps", "grad_clip", "muon_lr", "muon_momentum", "muon_scalar_lr", "muon_embed_lr")


def state_difference(path, model, optimizer, extra_state):
    """How the keys of checkpoint `path`'s state differ from those the code saves now (an EMA an
    edit added, another optimizer's moments), as a phrase; empty where they are the same."""
    step, saved = on_rank0(lambda: (read_train_state(path)["step"], saved_state_keys(path)))
    now = state_keys(training_state(model, optimizer, step, extra_state))
    in_saved, in_now = set(saved), set(now)
    phrases = phrases_of(("the code has", [key for key in now if key not in in_saved]),
                         ("the checkpoint has", [key for key in saved if key not in in_now]))
    return "; ".join(phrases)


def resume(resume_path, model, optimizer, extra_state, cfg, data, log, train_data=None):
    """Load the checkpoint: (its step, 'key a -> b' for each TUNABLE key the config changed). A
    change to the tokens the run sees, or to their order, is refused unless
    resume_allow_data_change."""
    train_state = on_rank0(lambda: read_train_state(resume_path))
    differ = model_differences(train_state["tensors"], tensor_shapes(model))
    run = os.path.dirname(os.path.dirname(resume_path))
    edited = ("undo the edit, or start the edited model from these weights in a new out_dir with "
              f"--init_from={run}")
    if differ:  # every checkpoint would fail to load, and none of them is damaged
        raise ValueError(f"{resume_path}: the model is not the one this run trained "
                         f"({'; '.join(differ)}); {edited} --init_from_partial=True")
    drift = fingerprint_difference(train_state["function"], data["function"])
    if drift > FINGERPRINT_TOLERANCE:  # the same tensors, computed with otherwise
        raise CodeChanged(f"{resume_path}: model.py computes otherwise than when this run's "
                          f"checkpoints were written (the same tensors; the logits over the whole "
                          f"context moved by up to {drift:.3g}); {edited}")
    saved = train_state["config"]["optimizer"]
    if saved != cfg.optimizer:  # its state would not fit: every checkpoint would fail to load
        raise ValueError(f"{resume_path}: the run was trained with --optimizer={saved}; resume so")
    state_change = state_difference(resume_path, model, optimizer, extra_state)
    if state_change:
        raise CodeChanged(f"{resume_path}: the code's training state is not the checkpoint's "
                          f"({state_change}); undo the edit that changed it, or start from these "
                          f"weights in a new out_dir with --init_from={run}")
    train_state = load_checkpoint(resume_path, model, optimizer, extra_state)
    step, saved = train_state["step"], train_state["config"]
    if cfg.eval_only:  # an evaluation reads no training data and needs no step budget
        return step, []
    batch = saved["global_batch_size"]
    if batch != cfg.global_batch_size:
        # The data order and the schedule are counted in steps of the saved batch.
        raise ValueError(f"{resume_path}: the run was trained with global_batch_size {batch}, the "
                         f"config now says {cfg.global_batch_size}; resume with "
                         f"--global_batch_size={batch} (on any number of ranks)")
    if step > cfg.max_steps:
        raise ValueError(f"{resume_path}: the checkpoint is at step {step}, "
                         f"beyond max_steps {cfg.max_steps}")
    changes = data_changes(train_state, cfg, data, train_data)
    if changes and not cfg.resume_allow_data_change:
        raise ValueError(f"{resume_path}: resuming would change the tokens the run sees or their "
                         f"order: {'; '.join(changes)}; undo it, use a new out_dir, or set "
                         "--resume_allow_data_change=True")
    if changes:
        log(f"resuming with changed data (resume_allow_data_change): {'; '.join(changes)}")
    return step, config_changes({key: saved[key] for key in TUNABLE if key in saved}, cfg)


def data_state(train_data):
    """What a resume compares: each file's fingerprint and a digest of the sample order. The digest
    covers what keys the index cache (each file's fingerprint, the split, seq_length, seed, epochs,
    the blend's weights): equal digests are the same samples in the same order."""
    parts = getattr(train_data, "datasets", [train_data])  # the GPTDatasets, blended or not
    order = json.dumps(train_data.order, sort_keys=True)
    return dict(data={part.dataset.path_prefix: part.dataset.fingerprint for part in parts},
                sample_order=hashlib.sha256(order.encode()).hexdigest())


def data_changes(train_state, cfg, data, train_data):
    """What differs between the saved run's tokens and order and this config's, as 'key a -> b'."""
    saved = train_state["config"]
    keys = ("data_paths", "split", "seed", "seq_length")
    changes = [f"{key} {saved[key]!r} -> {getattr(cfg, key)!r}"
               for key in keys if saved[key] != getattr(cfg, key)]
    before, now = train_state["data"], data["data"]
    for prefix in sorted(set(before) | set(now)):
        if before.get(prefix) != now.get(prefix):
            changes.append(f"data {prefix} fingerprint {before.get(prefix, 'absent')[:12]} -> "
                           f"{now.get(prefix, 'absent')[:12]}")
    consumed = train_state["step"] * cfg.global_batch_size
    if changes or train_state["sample_order"] == data["sample_order"] or not consumed:
        return changes
    # Another plan (a new max_steps changed the epochs or the blend): what matters is the samples
    # already consumed, so the saved run's plan is built again (from the index cache) and compared.
    saved_plan = train_samples(cfg.data_paths, seq_length=cfg.seq_length, split=cfg.split,
                               seed=cfg.seed, num_samples=saved["max_steps"] * cfg.global_batch_size,
                               cache_dir=cfg.index_mapping_dir,
                               fallback_cache_dir=os.path.join(cfg.out_dir, "index_cache"))
    if first_samples_agree(saved_plan, train_data, consumed):
        return []
    return [f"max_steps {saved['max_steps']} -> {cfg.max_steps} (the train split is then built in "
            f"other epochs or blended otherwise: the {consumed:,} samples consumed differ)"]


def config_changes(saved, cfg):
    """'key saved -> now' for each key of the `saved` config dict that `cfg` sets otherwise."""
    now = dataclasses.asdict(cfg)
    changes = []
    for key, value in saved.items():
        unset = key == "max_steps" and now[key] is None  # one epoch, counted once the data is built
        if key in now and now[key] != value and not unset:
            changes.append(f"{key} {value!r} -> {now[key]!r}")
    return changes
