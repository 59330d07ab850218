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
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from atomic_io import atomic_write
from distributed import barrier
from model import GPT, GPTConfig

# a checkpoint saved or loaded without a process group is meant to be: one process trains, or reads, it whole
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")



def complete_checkpoints(ckpt_root):
    """Paths of the complete checkpoints under ckpt_root, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    found = []
    for name in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, name)
        if re.fullmatch(r"step_\d{8}", name) and all(
                os.path.isfile(os.path.join(path, f)) for f in (".metadata", "train_state.json", "rng.pt")):
            found.append(path)
    return sorted(found)


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


def save_checkpoint(ckpt_root, model, optimizer, train_state, keep, rank):
    """Write a checkpoint into a temporary directory and publish it by renaming it, so that a checkpoint directory
    always holds a complete checkpoint; then delete all but the newest `keep`. Collective: every rank calls it."""
    final = os.path.join(ckpt_root, f"step_{train_state['step']:08d}")
    if os.path.isdir(final):  # this very state is already saved (a run resumed here and stopped at once)
        return final
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if rank == 0:  # dcp.save returns on rank 0 after every rank's files are written
        rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                   cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        with atomic_write(os.path.join(tmp, "rng.pt")) as f:
            torch.save(rng, f)
        with atomic_write(os.path.join(tmp, "train_state.json"), "w", encoding="utf-8") as f:
            json.dump(train_state, f, indent=2)
        os.rename(tmp, final)
        for old in complete_checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(ckpt_path, model, optimizer):
    """Load model, optimizer and RNG states in place (resharding onto this run's ranks); return train_state.json."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=ckpt_path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # every rank was seeded alike and nothing draws per-rank randomness, so rank 0's states serve all ranks
    rng = torch.load(os.path.join(ckpt_path, "rng.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return read_train_state(ckpt_path)


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
        return GPT.from_pretrained(name_or_path)
    if os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path}: a file; expected a model directory, a training out_dir or a hub name")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.endswith(os.sep):
        raise FileNotFoundError(f"{name_or_path}: no such model directory")
    return GPT.from_pretrained(name_or_path)
