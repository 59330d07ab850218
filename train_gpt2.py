"""Pretrain GPT-2 on Megatron-format token datasets (FineWeb-Edu): one process, or FSDP2 under torchrun.

    python train_gpt2.py configs/demo_cpu.py                   # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --lr_warmup_steps=10

The run writes into out_dir: train_config.json, main.log (llm.c's format), metrics.jsonl,
ckpt/step_NNNNNNNN/ (torch.distributed.checkpoint) and, at the end, hf/ (a Hugging Face GPT-2).
Rerun the same command to resume, on any number of ranks.

Where the common edits go: the model, its activation, attention and loss are in model.py; the
learning-rate schedule is lr_at(), the optimizer and its parameter groups are build_optimizer(),
and one training step is the body of the loop in train().
"""
import sys

if sys.version_info < (3, 10):
    # Checked before any import: TrainConfig's `str | None` fields are a TypeError on Python 3.9.
    sys.exit("train_gpt2.py: error: Python 3.10 or newer is needed, this is Python %d.%d"
             % sys.version_info[:2])

import concurrent.futures
import dataclasses
import errno
import functools
import gc
import hashlib
import importlib.util
import io
import json
import math
import os
import queue
import random
import re
import resource
import shutil
import signal
import threading
import time
import typing
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

import hellaswag
from atomic_io import LockHeld, atomic_write, error_reason, fsync_dir, lock_file
from configurator import NANOGPT_INIT_FROM, config_help, parse_config
from indexed_dataset import (LLMCValWindows, PretrainingSampler, build_gpt_datasets,
                             first_samples_agree, one_epoch_samples, resolve_blend,
                             sequential_samples, token_weighted_blend)
from model import (ACTIVATIONS, GPT, MARKER, GPTConfig, complete_checkpoints, export_hf,
                   init_sharded, is_run_or_checkpoint, load_hf_sharded, load_weights,
                   newest_usable_checkpoint, read_train_state,
                   resolve_checkpoint, resolve_pretrained, set_aside)
from sample import sample_texts
from tokenizer import EOT_ID, VOCAB_SIZE, write_hf_tokenizer


@dataclasses.dataclass
class TrainConfig:
    # data: token datasets written by prepare_fineweb.py (or Megatron's preprocess_data.py)
    data_paths: str | list = "fineweb_edu/megatron_gpt2/processed_data_*_text_document"  # or a blend
    index_mapping_dir: str | None = None  # the index cache; None: beside each prefix, as Megatron's
    split: str = "969,30,1"  # train, validation, test shares of each prefix's documents
    # validation: None takes the first val_tokens of data_paths' validation split; a prefix (such as
    # prepare_fineweb.py's val_text_document) takes llm.c's windows over [EOT] + its documents
    val_data_paths: str | list | None = None
    seq_length: int = 1024
    # model; when the weights come from init_from or a checkpoint, their architecture wins
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    padded_vocab_size: int | None = 50304  # rows of wte/lm_head; a multiple of 64 is faster on GPUs
    activation: str = "gelu_new"  # the MLP's: a name in model.ACTIVATIONS (add yours there)
    init_from: str | None = None  # None: GPT-2 init; an HF id or directory; a run or checkpoint
    # batch: global_batch_size sequences per optimizer step, local_batch_size per forward on a rank
    global_batch_size: int = 512
    local_batch_size: int = 16
    # AdamW with weight decay on 2-D parameters; linear warmup, cosine decay to min_lr at max_steps
    max_steps: int | None = 19073  # 10B tokens of 524,288 a step; None: one epoch of the train split
    lr: float = 6e-4
    min_lr: float = 0.0  # llm.c's GPT-2 runs decay to 0 (build-nanogpt's to 0.1 x lr)
    lr_warmup_steps: int = 700
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    optimizer: str = "adamw"  # or "muon": the blocks' matrices, AdamW the rest (docs/training.md)
    muon_momentum: float = 0.95  # dion's mu
    muon_adjust_lr: str = "spectral_norm"  # lr x sqrt(fan_out/fan_in); "rms_norm": 0.2 sqrt(max)
    muon_scalar_lr: float | None = None  # AdamW's lr for biases and LayerNorms; None: lr
    muon_embed_lr: float | None = None  # for wte (the tied head) and wpe; None: muon_scalar_lr
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    # evaluation at step 0, every val_every_steps and after the last step
    val_every_steps: int = 250
    val_tokens: int = 10_485_760  # llm.c's 10,240 x 1024 first validation tokens; 0 = off
    hellaswag: str | None = None  # None = off; a HellaSwag jsonl file; or "download"
    hellaswag_limit: int | None = None  # score only the first N examples
    sample_tokens: int = 0  # tokens sampled at each validation (GPT-2's vocabulary); 0 = off
    eval_only: bool = False  # evaluate the initial model (init_from or out_dir's) once and exit
    # outputs
    out_dir: str = "out"
    log_every_steps: int = 1  # the step's numbers are read from the device once per this many steps
    ckpt_every_steps: int = 1000  # 0 = only at the end and on SIGTERM/SIGINT
    ckpt_keep: int = 2  # complete checkpoints kept, newest first
    async_checkpoint: bool = True  # the step waits for a copy of the state, a thread writes it
    # a resume refuses a change to data_paths, the data, split, seed, seq_length or the epochs
    resume_allow_data_change: bool = False  # True: resume anyway; the sample order changes
    wandb_log: bool = False  # also log every metrics.jsonl record to Weights & Biases
    wandb_project: str = "gpt2"
    wandb_run_name: str | None = None  # None: out_dir's name; a resumed run continues its wandb run
    # system
    seed: int = 1234  # model init and data order
    device: str = "auto"  # auto (cuda when available), cuda, cpu
    dtype: str = "bfloat16"  # bf16 compute with fp32 weights and gradient reduction; or float32
    compile: bool = True  # torch.compile each transformer block and the loss
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, slower
    dist_timeout_s: int = 900  # a collective that waits longer than this fails instead of hanging


def check_config(cfg, world_size):
    """Refuse, in one line naming the key, any value outside the range where it makes sense."""
    finite = {key: math.isfinite(getattr(cfg, key)) for key in
              ("lr", "min_lr", "weight_decay", "adam_eps", "grad_clip", "beta1", "beta2")}
    rules = [  # (key, whether its value is fine, the range it must be in)
        ("lr", finite["lr"] and cfg.lr > 0, "> 0"),
        ("min_lr", finite["min_lr"] and 0 <= cfg.min_lr <= cfg.lr, f"between 0 and lr ({cfg.lr:g})"),
        ("weight_decay", finite["weight_decay"] and cfg.weight_decay >= 0, ">= 0"),
        ("beta1", finite["beta1"] and 0 <= cfg.beta1 < 1, "in [0, 1)"),
        ("beta2", finite["beta2"] and 0 <= cfg.beta2 < 1, "in [0, 1)"),
        ("adam_eps", finite["adam_eps"] and cfg.adam_eps > 0, "> 0"),
        ("grad_clip", finite["grad_clip"] and cfg.grad_clip >= 0, ">= 0 (0: no clipping)"),
        ("lr_warmup_steps", cfg.lr_warmup_steps >= 0, ">= 0"),
        ("muon_momentum", 0 <= cfg.muon_momentum < 1, "in [0, 1)"),
        ("muon_scalar_lr", cfg.muon_scalar_lr is None or 0 < cfg.muon_scalar_lr < math.inf, "> 0"),
        ("muon_embed_lr", cfg.muon_embed_lr is None or 0 < cfg.muon_embed_lr < math.inf, "> 0"),
    ]
    at_least = dict(seq_length=1, global_batch_size=1, local_batch_size=1, max_steps=1,
                    val_every_steps=1, val_tokens=0, sample_tokens=0, ckpt_every_steps=0,
                    ckpt_keep=1, log_every_steps=1, dist_timeout_s=1, hellaswag_limit=1)
    for key, low in at_least.items():
        value = getattr(cfg, key)
        rules.append((key, value is None or value >= low, f">= {low}"))
    if cfg.max_steps is not None:
        rules.append(("lr_warmup_steps", cfg.lr_warmup_steps <= cfg.max_steps,
                      f"<= max_steps ({cfg.max_steps})"))
    for key, fine, expected in rules:
        if not fine:
            raise ValueError(f"config: {key} must be {expected}, got {getattr(cfg, key)!r}")
    named = dict(device=("auto", "cuda", "cpu"), dtype=("bfloat16", "float32"),
                 activation=tuple(ACTIVATIONS), optimizer=("adamw", "muon"),
                 muon_adjust_lr=("spectral_norm", "rms_norm"))
    for key, choices in named.items():
        if getattr(cfg, key) not in choices:
            raise ValueError(f"config: {key} must be one of {', '.join(choices)}, "
                             f"got {getattr(cfg, key)!r}")
    if cfg.init_from in NANOGPT_INIT_FROM:
        raise ValueError(f"config: init_from={cfg.init_from!r} is nanoGPT's; "
                         f"here {NANOGPT_INIT_FROM[cfg.init_from]}")
    if 0 < cfg.val_tokens < cfg.seq_length:
        raise ValueError(f"config: val_tokens {cfg.val_tokens} is less than one sequence "
                         f"of {cfg.seq_length}")
    if cfg.wandb_log and importlib.util.find_spec("wandb") is None:
        raise ValueError("config: wandb_log=True needs the wandb package: pip install wandb")
    ranks_batch = cfg.local_batch_size * world_size
    if cfg.global_batch_size % ranks_batch and not cfg.eval_only:
        raise ValueError(f"config: global_batch_size {cfg.global_batch_size} is not divisible by "
                         f"local_batch_size {cfg.local_batch_size} x world size {world_size} "
                         f"= {ranks_batch}")


def load_config(argv):
    """The TrainConfig of a command line, checked."""
    cfg = parse_config(TrainConfig, argv)
    check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    return cfg


# The oldest torch the whole test suite passes on (bench/compat.sh; docs/development.md says why).
MIN_TORCH = "2.9.1"
# torch's own checkpoint writer calls tensor.storage(): the deprecation warning is not the user's.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)


def torch_version_problem(version=torch.__version__):
    """None, or the one line saying that this `version` of torch is older than MIN_TORCH."""
    if torch.torch_version.TorchVersion(version) < MIN_TORCH:
        return (f"torch {version} is older than {MIN_TORCH}, the oldest this code is tested on; "
                f"pip install 'torch>={MIN_TORCH}' (or a CUDA build of it for GPUs)")
    return None


# Dense bf16 tensor-core TFLOP/s of one GPU, for MFU. The first name found in the device's name
# wins, so a more specific name comes before the name it contains ("H200 NVL" before "H200").
PEAK_BF16_TFLOPS = [("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200 NVL", 835),
                    ("H200", 989), ("A100", 312), ("B200", 2250)]


# -------------------------------------------------------------------------------------------------
# processes and the out_dir

def setup_distributed(device_choice="auto", timeout_s=900):
    """(rank, world_size, device); under torchrun also the process group: NCCL on GPUs, gloo on CPU."""
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("config: device is 'cuda' but torch sees no CUDA GPU")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    torch.backends.cuda.matmul.allow_tf32 = use_cuda  # TF32 matmuls on GPUs, as cuDNN already does
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    if not use_cuda:
        dist.init_process_group("gloo", timeout=timeout)
        return rank, world_size, torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return rank, world_size, device


# Each helper below also works without a process group (one process), so callers never branch.
def rank_and_world_size():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_master():
    return rank_and_world_size()[0] == 0


def barrier(group=None):
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast_object(obj):
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def first_error(error):
    """Raise on every rank the first rank's `error` (None where that rank had none)."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    for error in errors:
        if error is not None:
            raise error


def on_rank0(work):
    """work() done by rank 0 alone; its result on every rank, or its error raised on every rank."""
    result = error = None
    if is_master():
        try:
            result = work()
        except (ValueError, OSError) as e:
            error = e
    result, error = broadcast_object((result, error))
    if error is not None:
        raise error
    return result


def on_each_node(work):
    """work() done first by each node's local rank 0, then by the node's other ranks, which find
    its result there (a hub download into the node's own cache: nodes need not share a home)."""
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    result = None
    for my_turn in (first, not first):
        error = None
        if my_turn:
            try:
                result = work()
            except (ValueError, OSError) as e:
                error = e
        first_error(error)
    return result


def any_rank(flag):
    """Whether `flag` is true on any rank (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return bool(flag)
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.tensor(float(bool(flag)), device=device)
    dist.all_reduce(total)
    return total.item() > 0


ROOT = os.path.dirname(os.path.abspath(__file__))
# What a run writes into out_dir. A non-empty directory holding none of these is someone else's.
RUN_FILES = ("train_config.json", "ckpt", "main.log", "metrics.jsonl", ".lock")
HF_MARKER = ".train_gpt2.json"  # in every hf/ export: only such an hf/ may be replaced
LOCKS = []  # this process's out_dir locks, released when run() returns


def lock_out_dir(out_dir):
    """An exclusive flock on out_dir/.lock, which the kernel drops when the process dies."""
    try:
        LOCKS.append(lock_file(os.path.join(out_dir, ".lock")))
    except LockHeld as e:
        raise ValueError(f"{out_dir}: another run is training in this out_dir ({e}); "
                         f"wait for it to end, stop it, or choose another out_dir") from None


def cut_torn_line(path):
    """Cut a last line without a newline (the run was killed while writing it), so that the next
    record does not run into it; a message saying so, or None."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb+") as f:
        text = f.read()
        if not text or text.endswith(b"\n"):
            return None
        keep = text.rfind(b"\n") + 1
        f.truncate(keep)
    return f"{path}: cut its partial last line (the run was killed while writing it): " \
           f"{text[keep:][:60]!r}"


def check_out_dir(out_dir):
    """Refuse an out_dir that is not a run's own directory."""
    if not out_dir.strip():
        raise ValueError("config: out_dir is empty; name a directory for the run, e.g. --out_dir=out")
    path = os.path.realpath(out_dir)
    for name, protected in (("the current directory", os.getcwd()), ("the project directory", ROOT)):
        protected = os.path.realpath(protected)
        if protected == path or protected.startswith(path.rstrip(os.sep) + os.sep):
            raise ValueError(f"{out_dir}: out_dir is {name} or one of its parents; "
                             "name a directory of its own")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{out_dir}: out_dir is a file; name a directory")
    entries = []
    if os.path.isdir(path):
        entries = os.listdir(path)
    if entries and not set(RUN_FILES) & set(entries):
        raise ValueError(f"{out_dir}: out_dir holds {len(entries)} entries (e.g. "
                         f"{sorted(entries)[0]!r}) but no train_config.json, ckpt/ or main.log: "
                         "not a training run's directory; name a new one")


def prepare_out_dir(out_dir, eval_only=False):
    """On rank 0: check and lock out_dir, remove interrupted writes; the newest usable checkpoint or
    None. Under eval_only the run's logs stay as they are: results go to out_dir/eval/."""
    check_out_dir(out_dir)
    ckpt_root = os.path.join(out_dir, "ckpt")
    os.makedirs(ckpt_root, exist_ok=True)
    lock_out_dir(out_dir)
    for name in os.listdir(ckpt_root):
        if name.endswith(".tmp"):  # ours: the lock says that no other run is writing it
            print(f"removing incomplete checkpoint {os.path.join(ckpt_root, name)}")
            shutil.rmtree(os.path.join(ckpt_root, name))
    resume_path, messages = newest_usable_checkpoint(ckpt_root)
    damaged = sorted(name for name in os.listdir(ckpt_root) if ".damaged-" in name)
    if resume_path is None and damaged and not eval_only:
        # Starting again from step 0 here would bury the run those checkpoints belonged to.
        raise ValueError(f"{ckpt_root}: no checkpoint is usable (damaged ones were renamed "
                         f"*.damaged-*, e.g. {damaged[-1]}); start a fresh run in another out_dir")
    log_dir = out_dir
    if eval_only:
        log_dir = os.path.join(out_dir, "eval")
    os.makedirs(log_dir, exist_ok=True)
    for name in ("main.log", "metrics.jsonl"):
        log_path = os.path.join(log_dir, name)
        if resume_path or eval_only:  # appended to from here on
            messages.append(cut_torn_line(log_path))
        elif os.path.exists(log_path):  # a fresh run never mixes its curves with an older run's
            k = 1
            while os.path.exists(f"{log_path}.{k}"):
                k += 1
            os.rename(log_path, f"{log_path}.{k}")
            messages.append(f"{log_path} of an earlier run moved to {log_path}.{k}")
    for message in messages:
        if message:
            print(message)
    return resume_path


# -------------------------------------------------------------------------------------------------
# checkpoints (model.py reads them too: complete_checkpoints, newest_usable_checkpoint, load_model)

def last_good_checkpoint(out_dir):
    """Where a run stopped for non-finite numbers can be taken up again, as a sentence."""
    kept = complete_checkpoints(os.path.join(out_dir, "ckpt"))
    if not kept:
        return "The last good checkpoint is none (none was written)"
    return f"The last good checkpoint is {kept[-1]}"


def local(tensor):
    """This rank's part of a parameter or state tensor: a DTensor's shard, or all of a plain one."""
    if hasattr(tensor, "to_local"):
        return tensor.detach().to_local()
    return tensor.detach()


def nonfinite(model, optimizer=None):
    """Names of this rank's parameters (and optimizer moments) holding NaN or inf, or a negative
    exp_avg_sq, in one device sync."""
    checks = {name: torch.isfinite(local(p)).all() for name, p in model.named_parameters()}
    names = {p: name for name, p in model.named_parameters()}
    states = [item for opt in optimizer or [] for item in opt.state.items()]
    for p, state in states:
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # the moments, not the step
                ok = torch.isfinite(local(value)).all()
                if key == "exp_avg_sq":
                    ok = ok & (local(value) >= 0).all()
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


# The optimizer's state is saved per parameter name ("state.<name>.exp_avg"); the groups'
# hyperparameters are not saved, as build_optimizer() and the config set them. So a resume pairs
# each parameter with its own moments even where the grouping changed.
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def training_state(model, optimizer, step):
    """The state dict that a checkpoint at `step` holds. Before the first update AdamW has no
    state, and get_state_dict would make one up (step 1, zero moments) that changes every later
    update: a step-0 checkpoint holds the model alone."""
    if step == 0:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer, options=BY_NAME)
    per_parameter = {key: value for key, value in optim_state.items() if key.startswith("state.")}
    return {"model": model_state, "optim": per_parameter}


def rng_state():
    """The random generators' states, serialized in memory: a full disk then fails in write() as an
    OSError naming the file, where torch.save's zip writer says "unexpected pos"."""
    state = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
                 python=random.getstate(), cuda=None)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_json(path, obj):
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def fsync_tree(path):
    """fsync every file in directory `path`, then the directory; {file name: size} for the marker."""
    sizes = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
        sizes[name] = os.path.getsize(os.path.join(path, name))
    fsync_dir(path)
    return sizes


WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # so one checkpoint write at a time


def save_checkpoint(cfg, model, optimizer, step, data, group=None):
    """Checkpoint `step`: the state, the random generators and train_state.json as they are now; a
    Future of write_checkpoint's (path, seconds). Every rank calls it. Under async_checkpoint the
    state is copied to CPU memory (dcp.async_save) and a thread writes it beside training."""
    assert_finite(model, f"checkpoint at step {step}", cfg.out_dir)
    ckpt_root = os.path.join(cfg.out_dir, "ckpt")
    final = os.path.join(ckpt_root, f"step_{step:08d}")
    if broadcast_object(os.path.isfile(os.path.join(final, MARKER))):
        return WRITER.submit(lambda: (final, 0.0))  # already saved: a run resumed here and stopped
    tmp = final + ".tmp"
    if is_master():
        if os.path.exists(final):
            print(f"incomplete checkpoint {final} moved to {set_aside(final, 'incomplete')}")
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover of an interrupted write
        os.makedirs(tmp)
    barrier()
    state = training_state(model, optimizer, step)
    train_state = dict(step=step, consumed_samples=step * cfg.global_batch_size, **data,
                       world_size=rank_and_world_size()[1], config=dataclasses.asdict(cfg),
                       model_config=dataclasses.asdict(model.config))
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
            sizes = fsync_tree(tmp)
            write_json(os.path.join(tmp, MARKER), dict(step=train_state["step"], sizes=sizes))
            os.rename(tmp, final)
            fsync_dir(ckpt_root)
    except (Exception, dcp.CheckpointException) as e:
        if is_master():
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space; it never held a marker
        raise checkpoint_error(e, final) from None
    if is_master():
        for old in complete_checkpoints(ckpt_root)[:-cfg.ckpt_keep]:
            shutil.rmtree(old)
    barrier(group)
    return final, time.perf_counter() - t0


def checkpoint_error(error, final):
    """The OSError that says why writing checkpoint `final` failed (a full disk, a read-only
    directory), on which rank; or `error` itself. DCP wraps each rank's exception."""
    failures = getattr(error, "failures", None) or {}
    causes = [(f" on rank {rank}", failures[rank]) for rank in sorted(failures)]
    for where, cause in causes or [("", error)]:
        if isinstance(cause, tuple):
            cause = cause[0]
        if isinstance(cause, (OSError, RuntimeError)):
            code, reason = getattr(cause, "errno", None), error_reason(cause)
            if code is None and disk_full(os.path.dirname(final)):
                # torch's zip writer (DCP writes small items with it) says only "unexpected pos".
                code, reason = errno.ENOSPC, os.strerror(errno.ENOSPC)
            return OSError(code, f"writing checkpoint {final} failed{where}: {reason}",
                           getattr(cause, "filename", None))
    return error


def disk_full(path):
    """Whether the filesystem of `path` has less than a MiB left."""
    try:
        return shutil.disk_usage(path).free < 2**20
    except OSError:
        return False


def load_state(path, model, optimizer):
    """Load checkpoint `path` into the model, the optimizer and the random generators; its
    train_state.json. The optimizer keeps its own groups; each parameter gets its saved moments."""
    train_state = read_train_state(path)
    state = training_state(model, optimizer, train_state["step"])
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


def load_checkpoint(ckpt_path, model, optimizer):
    """Load the newest checkpoint that loads on every rank, from `ckpt_path` back; one that fails
    on any rank is set aside as damaged. Its train_state.json."""
    ckpt_root = os.path.dirname(ckpt_path)
    older = [path for path in reversed(complete_checkpoints(ckpt_root)) if path < ckpt_path]
    for path in [ckpt_path] + broadcast_object(older):
        error = None
        try:
            train_state = load_state(path, model, optimizer)
        except (Exception, dcp.CheckpointException) as e:
            error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        if not any_rank(error is not None):
            return train_state
        if is_master():
            print(f"skipping checkpoint {path}: it failed to load ({error or 'on another rank'}); "
                  f"kept as {set_aside(path, 'damaged')}")
        barrier()
    raise ValueError(f"{ckpt_root}: no checkpoint loads (damaged ones were renamed *.damaged-*); "
                     "start a fresh run in another out_dir")


def resume(resume_path, model, optimizer, cfg, data, log, train_data=None):
    """Load the checkpoint; its step. A change to the tokens the run sees, or to their order, is
    refused unless resume_allow_data_change."""
    saved = read_train_state(resume_path)["config"].get("optimizer", "adamw")
    if saved != cfg.optimizer:  # its state would not fit: every checkpoint would fail to load
        raise ValueError(f"{resume_path}: the run was trained with --optimizer={saved}; resume so")
    train_state = load_checkpoint(resume_path, model, optimizer)
    step, saved = train_state["step"], train_state["config"]
    if cfg.eval_only:  # an evaluation reads no training data and needs no step budget
        return step
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
    keys = ("max_steps", "lr", "min_lr", "lr_warmup_steps", "weight_decay", "beta1", "beta2",
            "adam_eps", "grad_clip", "muon_momentum", "muon_scalar_lr", "muon_embed_lr")
    changed = config_changes({key: saved[key] for key in keys if key in saved}, cfg)
    if changed:
        log(f"{'; '.join(changed)}: the config wins from step {step} on; "
            f"lr at step {step} is {lr_at(step, cfg):.3e}")
    return step


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
    saved_cfg = dataclasses.replace(cfg, max_steps=saved["max_steps"])
    saved_plan = build_train_data(saved_cfg, log=lambda *args, **kwargs: None)
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


def data_state(train_data):
    """What a resume compares: each file's fingerprint and a digest of the sample order. The digest
    covers what keys the index cache (each file's fingerprint, the split, seq_length, seed, epochs,
    the blend's weights): equal digests are the same samples in the same order."""
    parts = getattr(train_data, "datasets", [train_data])  # the GPTDatasets, blended or not
    order = json.dumps(train_data.order, sort_keys=True)
    return dict(data={part.dataset.path_prefix: part.dataset.fingerprint for part in parts},
                sample_order=hashlib.sha256(order.encode()).hexdigest())


def already_complete(cfg, resume_path):
    """Whether out_dir holds the run's last checkpoint and its hf/ export: nothing left to do."""
    try:
        with open(os.path.join(cfg.out_dir, "hf", HF_MARKER), encoding="utf-8") as f:
            exported = json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return False
    train_state = read_train_state(resume_path)
    last_step = cfg.max_steps or train_state["config"]["max_steps"]
    return train_state["step"] == last_step == exported


def publish_hf(model, cfg):
    """The final weights (and GPT-2's tokenizer) as out_dir/hf; an hf/ that this script did not
    write is moved aside first."""
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 keeps the root's last forward unsharded (bf16): back to fp32 shards
    assert_finite(model, "Hugging Face export", cfg.out_dir)
    t0, hf_dir = time.perf_counter(), os.path.join(cfg.out_dir, "hf")
    ours = os.path.exists(os.path.join(hf_dir, HF_MARKER))
    if is_master() and os.path.isdir(hf_dir) and not ours:
        print(f"{hf_dir} was not written by train_gpt2.py; moved to {set_aside(hf_dir, 'moved')}")

    def extra_files(directory):
        if model.config.vocab_size == VOCAB_SIZE:
            # GPT-2's tokenizer, for its context, and generation that stops at its EOT.
            write_hf_tokenizer(directory, model_max_length=model.config.block_size)
            write_json(os.path.join(directory, "generation_config.json"),
                       dict(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID))
        write_json(os.path.join(directory, HF_MARKER),
                   dict(written_by="train_gpt2.py", step=cfg.max_steps))

    # Every rank gathers one tensor at a time to rank 0, which writes.
    export_hf(model, hf_dir, extra_files=extra_files)
    barrier()
    if is_master():
        print(f"exported Hugging Face weights to {hf_dir} ({time.perf_counter() - t0:.1f} s)")


# -------------------------------------------------------------------------------------------------
# model and optimizer

ARCHITECTURE = ("n_layer", "n_head", "n_embd", "vocab_size", "padded_vocab_size", "activation")


def starting_point(cfg, resume_path):
    """(GPTConfig, (kind, source)) of the first weights: "resume", "checkpoint" (init_from a run),
    "hf" (a Hugging Face model, with our padded_vocab_size) or "seed" (GPT-2's init)."""
    if resume_path is not None:
        model_config = GPTConfig(**read_train_state(resume_path)["model_config"])
        differ = [f"{k} {getattr(model_config, k)} (config: {getattr(cfg, k)})"
                  for k in ARCHITECTURE if getattr(model_config, k) != getattr(cfg, k)]
        if differ and cfg.init_from is None:
            raise ValueError(f"{resume_path}: the checkpoint to resume from has "
                             f"{', '.join(differ)}; use the checkpoint's architecture or "
                             "another out_dir")
        return model_config, ("resume", resume_path)
    if cfg.init_from is None:
        model_config = GPTConfig(block_size=cfg.seq_length, vocab_size=cfg.vocab_size,
                                 padded_vocab_size=cfg.padded_vocab_size, n_layer=cfg.n_layer,
                                 n_head=cfg.n_head, n_embd=cfg.n_embd,
                                 activation=cfg.activation)
        return model_config, ("seed", cfg.seed)
    if is_run_or_checkpoint(cfg.init_from):
        configs = {}

        def read(path):  # a live run may delete its newest checkpoint meanwhile: then the next
            configs[path] = read_train_state(path)["model_config"]

        model_config = on_rank0(lambda: configs[resolve_checkpoint(cfg.init_from, load=read)])
        return GPTConfig(**model_config), ("checkpoint", cfg.init_from)
    # A hub id is downloaded by each node into its own cache.
    directory, hf_config = on_each_node(lambda: resolve_pretrained(cfg.init_from))
    hf_config = dataclasses.replace(hf_config, padded_vocab_size=cfg.padded_vocab_size)
    return hf_config, ("hf", directory)


def build_model(model_config, init, cfg, device):
    """The model built on the meta device and sharded with FSDP2 under torchrun; then each rank
    fills in its own rows of the weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        model = GPT(model_config)
    # Per block, inside FSDP's and compile's wrapping.
    model.activation_checkpointing = cfg.activation_checkpointing
    model.compile_loss = cfg.compile
    mp_policy = MixedPrecisionPolicy()
    if cfg.dtype == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = None
    if dist.is_initialized():
        # The mesh of the run's device type: fully_shard's default follows the accelerator.
        mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.transformer.h:
        if cfg.compile:
            # Before sharding, so that FSDP's hooks cause no graph breaks and names stay the same.
            block.compile()
        if mesh is not None:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    if mesh is not None:
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    model.to_empty(device=device)
    if mesh is None:  # to_empty() gave a plain model two embedding tensors: tie them again
        model.lm_head.weight = model.transformer.wte.weight
    kind, source = init
    if kind == "seed":
        init_sharded(model, source)
    elif kind == "hf":
        load_hf_sharded(model, source)
    elif kind == "checkpoint":  # init_from another run: its weights, a fresh optimizer
        path = load_init_checkpoint(source, model)
        if is_master():
            print(f"init_from: loaded the weights of {path}")
    return model


def newest_untried(source, tried, why):
    """The checkpoint `source` names, or its run's newest complete one not in `tried`."""
    candidates = [source]
    if not os.path.isfile(os.path.join(source, "train_state.json")):
        candidates = complete_checkpoints(os.path.join(source, "ckpt"))
    untried = [path for path in candidates if path not in tried]
    if not untried:
        raise ValueError(f"init_from {source}: no checkpoint loads (the last one tried: {why})")
    return untried[-1]


def load_init_checkpoint(source, model):
    """Load the weights of `source` (a checkpoint, or a run's newest one that loads) on every rank;
    the path. A live run may delete the chosen checkpoint before it is read: then the newest one
    is chosen again."""
    tried, why = [], "none"
    while True:
        path = on_rank0(functools.partial(newest_untried, source, tried, why))
        error = None
        try:
            load_weights(path, model)
        except (ValueError, RuntimeError, OSError, dcp.CheckpointException) as e:
            error = e  # damaged although its files look complete, or deleted meanwhile
        if not any_rank(error is not None):
            return path
        why = f"{path}: {str(error).strip().splitlines()[0] if error else 'on another rank'}"
        if is_master():
            print(f"init_from: skipping {why}")
        tried.append(path)


def build_optimizer(model, cfg, device):
    """The optimizers the loop steps: AdamW, with weight decay on the 2-D parameters (matmul weights
    and embeddings) only, as the GPT-2 recipes do; or Muon and AdamW, grouped as dion's Muon is.
    Each group has a name; lr_at()'s rate is multiplied by a group's lr_scale, so that a group of
    its own (say the embedding at 10x) is one more entry here."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [dict(name="decay", params=decay, weight_decay=cfg.weight_decay, lr_scale=1.0),
              dict(name="no_decay", params=no_decay, weight_decay=0.0, lr_scale=1.0)]
    adamw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                 fused=device.type == "cuda")
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(groups, **adamw)]
    # Muon for the blocks' matrices. dion's spectral_norm is lr x sqrt(fan_out/fan_in), torch's
    # "original" is lr for wide ones (the MLP's c_proj): their lr_scale adds the rest and their
    # weight_decay takes it out again, as dion decays by lr x weight_decay.
    matrices = [p for p in model.transformer.h.parameters() if p.dim() == 2]
    scales = [min(1.0, math.sqrt(p.shape[0] / p.shape[1])) for p in matrices]
    if cfg.muon_adjust_lr == "rms_norm":
        scales = [1.0 for p in matrices]
    groups = [dict(name="muon", params=[p], lr_scale=scale, weight_decay=cfg.weight_decay / scale)
              for p, scale in zip(matrices, scales)]
    adjust_lr_fn = dict(spectral_norm="original", rms_norm="match_rms_adamw")[cfg.muon_adjust_lr]
    muon = torch.optim.Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=False,
                            adjust_lr_fn=adjust_lr_fn)
    # AdamW: biases and LayerNorms with weight decay, the embeddings (wte is the head too) without.
    scalar_lr = cfg.muon_scalar_lr or cfg.lr
    embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
    groups = [dict(name="scalar", params=no_decay, weight_decay=cfg.weight_decay,
                   lr_scale=scalar_lr / cfg.lr),
              dict(name="embedding", params=embeddings, weight_decay=0.0,
                   lr_scale=(cfg.muon_embed_lr or scalar_lr) / cfg.lr)]
    return [muon, torch.optim.AdamW(groups, **adamw)]


def lr_at(step, cfg):
    """llm.c's schedule: linear warmup (step 0 already gets lr / lr_warmup_steps), then a cosine
    decay from lr to min_lr at max_steps."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    decay_ratio = (step - cfg.lr_warmup_steps) / max(1, cfg.max_steps - cfg.lr_warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg.lr - cfg.min_lr)


def peak_flops(device):
    """Dense bf16 FLOP/s of one `device` from PEAK_BF16_TFLOPS, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


# -------------------------------------------------------------------------------------------------
# data and evaluation

def build_data(cfg, log):
    """(train_data, val_data): Megatron's GPTDataset samples of the train split (None under
    eval_only) and the validation windows (None without validation)."""
    train_data = None
    if not cfg.eval_only:
        train_data = build_train_data(cfg, log)
    if not cfg.val_tokens:
        return train_data, None
    if cfg.val_data_paths is not None:
        val_data = LLMCValWindows(cfg.val_data_paths, cfg.seq_length, cfg.val_tokens)
    else:
        windows = cfg.val_tokens // cfg.seq_length
        val_data = sequential_samples(cfg.data_paths, seq_length=cfg.seq_length, split=cfg.split,
                                      split_index=1, max_samples=windows)
        if val_data is None:
            log(f"no validation: split {cfg.split!r} gives the validation split no share")
            return train_data, None
        if len(val_data) < windows:  # refused, as LLMCValWindows refuses it
            raise ValueError(f"{cfg.data_paths}: the validation split ({cfg.split!r}) holds "
                             f"{val_data.num_tokens:,} tokens, fewer than the "
                             f"{windows * cfg.seq_length + 1:,} that val_tokens "
                             f"{cfg.val_tokens:,} needs; lower val_tokens or give validation a "
                             "larger share")
    log(f"validation: {len(val_data)} windows of {cfg.seq_length} tokens from "
        f"{cfg.val_data_paths or cfg.data_paths}")
    return train_data, val_data


def build_train_data(cfg, log):
    """The train split's samples for cfg.max_steps; None takes one epoch and sets cfg.max_steps."""
    num_samples = None
    if cfg.max_steps is not None:
        num_samples = cfg.max_steps * cfg.global_batch_size
    paths, (prefixes, weights) = cfg.data_paths, resolve_blend(cfg.data_paths)
    if num_samples is not None and weights is None and len(prefixes) > 1:
        # An unweighted list of prefixes gives at most one epoch of each (Megatron's limit), so a
        # longer run blends them by token count from the start.
        epoch = one_epoch_samples(paths, seq_length=cfg.seq_length, split=cfg.split)
        if num_samples > epoch:
            log(f"{paths}: {num_samples:,} samples are more than one epoch ({epoch:,}); the "
                "prefixes are blended by token count, each repeated in whole epochs")
            paths = token_weighted_blend(paths)
            prefixes, weights = resolve_blend(paths)
    fallback = os.path.join(cfg.out_dir, "index_cache")
    train_data, _, _ = build_gpt_datasets(paths, seq_length=cfg.seq_length, split=cfg.split,
                                          seed=cfg.seed, sizes=(num_samples, 0, 0),
                                          cache_dir=cfg.index_mapping_dir,
                                          fallback_cache_dir=fallback)
    if train_data is None:
        raise ValueError(f"{cfg.data_paths}: the train split is empty (split {cfg.split!r})")
    if weights is not None:  # said at every start: the cache says it only when it builds the blend
        shares = [w / sum(weights) for w in weights]
        if len(prefixes) > 8:
            log(f"train blend: {len(prefixes)} prefixes, weights {min(shares):.4f} to "
                f"{max(shares):.4f}")
        else:
            log("train blend: " + ", ".join(f"{prefix} {share:.4f}"
                                            for prefix, share in zip(prefixes, shares)))
    if num_samples is None:
        cfg.max_steps = len(train_data) // cfg.global_batch_size
        if cfg.max_steps < 1:
            raise ValueError(f"{cfg.data_paths}: the train split has {len(train_data):,} samples, "
                             f"fewer than one global batch of {cfg.global_batch_size}")
        log(f"max_steps None: one epoch of the train split is {cfg.max_steps:,} steps")
    return train_data


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
            while True:
                ready.put([host_batch(dataset, next(sampler), vocab_size, pin)
                           for _ in range(grad_accum_steps)])
        except StopIteration:
            return  # every step's samples were read
        except BaseException as e:
            stop.error = e
            ready.put(e)

    threading.Thread(target=produce, daemon=True).start()
    return ready


class Evaluator:
    """Validation loss, HellaSwag and a sample, before step s's update (under eval_only, HellaSwag
    and the sample at step 0 too)."""

    def __init__(self, cfg, val_data, vocab_size, device, log):
        self.cfg, self.val_data, self.vocab_size = cfg, val_data, vocab_size
        self.device, self.log = device, log
        # bf16 on one device is autocast; sharded, FSDP's mixed precision already computes in bf16.
        self.autocast_dtype = None
        if cfg.dtype == "bfloat16" and not dist.is_initialized():
            self.autocast_dtype = torch.bfloat16
        self.autocast = torch.autocast(device.type, dtype=self.autocast_dtype,
                                       enabled=self.autocast_dtype is not None)
        self.sample_tokens = 0
        if cfg.sample_tokens and vocab_size != VOCAB_SIZE:
            log(f"sample_tokens ignored: the vocabulary ({vocab_size} tokens) is not GPT-2's")
        elif cfg.sample_tokens:
            self.sample_tokens = cfg.sample_tokens
        self.hellaswag = None
        if cfg.hellaswag is not None:
            if vocab_size != VOCAB_SIZE:
                raise ValueError("config: hellaswag needs the GPT-2 vocabulary; the model has "
                                 f"{vocab_size} tokens")
            path = cfg.hellaswag
            if path == "download":
                path = None
            # Read, parsed and tokenized once by rank 0 and sent to every rank: other nodes need
            # neither the file nor the internet, and a bad file fails every rank alike.
            self.hellaswag = on_rank0(
                lambda: hellaswag.render_all(hellaswag.load_examples(path)))

    def __call__(self, model, step, stop):
        """Whether the evaluation ran to its end (False: a stop was requested during it)."""
        head = f"step {step:5d}/{self.cfg.max_steps} |"

        def stopped():
            return any_rank(stop.requested())

        if self.val_data is not None:
            if not self.validate(model, step, head, stopped):
                return False
        if self.hellaswag is not None and (step > 0 or self.cfg.eval_only):
            rank, world_size = rank_and_world_size()
            # As many examples per forward as a training micro-batch has tokens.
            result = hellaswag.evaluate(
                model, self.hellaswag, device=self.device, rank=rank, world_size=world_size,
                autocast_dtype=self.autocast_dtype, limit=self.cfg.hellaswag_limit,
                batch_tokens=self.cfg.local_batch_size * self.cfg.seq_length, stopped=stopped)
            if result is None:
                return False
            self.log(f"{head} hellaswag acc_norm {result['acc_norm']:.4f} "
                     f"({result['correct_norm']}/{result['total']})",
                     f"s:{step} eval:{result['acc_norm']:.4f}", step=step,
                     hellaswag_acc_norm=result["acc_norm"], hellaswag_acc=result["acc"])
        if self.sample_tokens and step > 0:
            with self.autocast:
                text = sample_texts(model, "", max_new_tokens=self.sample_tokens,
                                    seed=self.cfg.seed + step, device=self.device)[0]
            self.log(f"{head} sample: {text!r}", step=step, sample=text)
        return True

    def validate(self, model, step, head, stopped):
        """Log the mean loss over the validation windows; False if a stop came during it."""
        rank, world_size = rank_and_world_size()
        batch_size = self.cfg.local_batch_size
        # Rank r scores windows r, r + W, ...; every rank runs as many forwards, since a sharded
        # forward is a collective.
        t0, mine = time.perf_counter(), list(range(rank, len(self.val_data), world_size))
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        for b in range(math.ceil(len(self.val_data) / (world_size * batch_size))):
            if stopped():  # checked between batches: a stop never waits behind an evaluation
                return False
            indices = mine[b * batch_size:(b + 1) * batch_size]
            batch = host_batch(self.val_data, indices or [0], self.vocab_size,
                               self.device.type == "cuda")
            tokens, labels = (t.to(self.device, non_blocking=True) for t in batch)
            with torch.no_grad(), self.autocast:
                _, loss = model(tokens, labels)
            if indices:
                totals[0] += loss.double() * labels.numel()
                totals[1] += labels.numel()
        if dist.is_initialized():
            dist.all_reduce(totals)
        val_loss = (totals[0] / totals[1]).item()
        if not math.isfinite(val_loss):
            raise FloatingPointError(f"step {step}: val loss {val_loss} is not finite; stopped, "
                                     "state not saved")
        self.log(f"{head} val loss {val_loss:.6f} | {time.perf_counter() - t0:.1f} s",
                 f"s:{step} tel:{val_loss:.4f}", step=step, val_loss=val_loss)
        return True


# -------------------------------------------------------------------------------------------------
# the training loop

class StopRequest:
    """Why the run should stop at the next step: a SIGTERM or SIGINT (it then checkpoints and exits
    128 + signum), or a data error of the reading thread (it checkpoints, then reports the error).

    While the run stops, more SIGTERMs are absorbed: a scheduler signals every process and then
    torchrun forwards its own, and none may kill the worker before its checkpoint. A person's
    second Ctrl-C is told that the checkpoint is being written; a third aborts without it."""

    def __init__(self):
        self.signal = self.time = self.error = None
        self.interrupts = 0  # Ctrl-Cs after the first signal
        self.told = False  # whether a repeated SIGTERM was said to be ignored
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def requested(self):
        return self.signal is not None or self.error is not None

    def handle(self, signum, frame):
        if self.signal is None:
            self.signal, self.time = signum, time.perf_counter()
        elif signum == signal.SIGTERM:
            if not self.told and is_master():
                say("SIGTERM again while stopping: ignored, the checkpoint is being written")
            self.told = True
        else:
            self.interrupts += 1
            if self.interrupts == 1 and is_master():
                say("stopping: the checkpoint is being written; Ctrl-C again (or kill -9) aborts "
                    "without it, and a rerun then resumes from the checkpoint before")
            elif self.interrupts > 1:  # the person insists: die by SIGINT, without a traceback
                say("aborted without a checkpoint; rerun the same command to resume from the "
                    "last one")
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Checkpoints:
    """The run's checkpoint writes, one at a time. Under async_checkpoint the step waits only for
    the copy of the state; the next save, a stop, the end of the run and an error wait for the
    write, and its error (a full disk) is raised there."""

    def __init__(self, cfg, log):
        self.cfg, self.log, self.written, self.group = cfg, log, None, None
        if cfg.async_checkpoint and dist.is_initialized():
            # Its own gloo group, as torchtitan's: the write's collectives and training's never mix.
            timeout = timedelta(seconds=cfg.dist_timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def save(self, model, optimizer, step, data, wait=False):
        t0 = time.perf_counter()
        self.wait()
        self.written = save_checkpoint(self.cfg, model, optimizer, step, data, self.group)
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


def say(text):
    print(text, file=sys.stderr, flush=True)


class PeerLost(Exception):
    """Another rank died or stopped answering: this rank ends with one line; a rerun resumes."""


class RunLog:
    """On rank 0: a console line, a main.log line (llm.c's format) and a metrics.jsonl record (and
    wandb's), in out_dir (or its eval/ subdirectory under eval_only)."""

    def __init__(self, out_dir):
        self.out_dir, self.master, self.wandb = out_dir, is_master(), None

    def start(self, cfg, resumed):
        """On rank 0, once the config is accepted: train_config.json (eval_config.json under
        eval_only) and, with wandb_log, the wandb run of this directory."""
        name = "train_config.json"
        if cfg.eval_only:
            name = "eval_config.json"
        write_json(os.path.join(self.out_dir, name), dataclasses.asdict(cfg))
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        if not cfg.wandb_log:
            return
        import wandb
        id_path = os.path.join(self.out_dir, "wandb_run_id")
        if resumed and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = os.urandom(4).hex()
            with atomic_write(id_path, "w", encoding="utf-8") as f:
                f.write(run_id)
        name = cfg.wandb_run_name or os.path.basename(os.path.abspath(cfg.out_dir))
        self.wandb = wandb.init(project=cfg.wandb_project, id=run_id, resume="allow",
                                dir=self.out_dir, name=name, config=dataclasses.asdict(cfg))
        # Plotted against the training step, not wandb's own counter.
        self.wandb.define_metric("*", step_metric="step")

    def __call__(self, text, main_log=None, **metrics):
        if not self.master:
            return
        print(text, flush=True)
        if main_log:
            with open(os.path.join(self.out_dir, "main.log"), "a") as f:
                f.write(main_log + "\n")
        if metrics:
            with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(dict(metrics, time=time.time())) + "\n")
            if self.wandb is not None:
                self.wandb.log(metrics)


def peak_memory(device, reset=False):
    """(GiB, label) of the peak since the last reset: CUDA's high-water mark, or the process's
    VmHWM (writing 5 to clear_refs resets it)."""
    if device.type == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.max_memory_allocated(device) / 2**30, "mem"
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20, "rss"
    except OSError:
        pass
    # No /proc here (some sandboxes): the peak since the process began.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss"


class StepLog:
    """Each step's loss, grad norm and stop flag, copied to the host without waiting for the
    device and read a step later, so that the GPU never idles while the host logs."""

    def __init__(self, cfg, log, device, model):
        self.cfg, self.log, self.device = cfg, log, device
        self.cuda, self.world_size = device.type == "cuda", rank_and_world_size()[1]
        flops_per_token, peak = model.flops_per_token(cfg.seq_length), peak_flops(device)
        self.mfu_scale = None
        peak_text = "unknown (MFU n/a)"
        if peak:
            self.mfu_scale = flops_per_token / (peak * self.world_size)
            peak_text = f"{peak / 1e12:.0f} TFLOP/s per GPU"
        log(f"model: {model.num_params(non_embedding=False):,} parameters "
            f"({model.num_params():,} non-embedding), {flops_per_token / 1e9:.3f} GFLOP/token; "
            f"bf16 peak {peak_text}")
        self.pending = []  # (step, lr, host stats, start, end, peak GiB) not yet logged
        self.recent = []  # (end, host stats) of the steps whose stop flag may be read
        self.stop_flag = torch.zeros((), device=device)
        self.run_peak_gib = 0.0

    def clock(self):
        """A host time, or on a GPU an event recorded in the stream (read once it is done)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self):
        peak_memory(self.device, reset=True)
        self.start = self.clock()

    def end_step(self, step, lr, loss, norm, stop):
        """Queue the step's numbers for the host; whether any rank asked to stop. A GPU reads the
        flag of the step before, which is done by now, so that the host does not wait."""
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # a sharded model's norm is a DTensor
        self.stop_flag.fill_(float(stop.requested()))
        stats = torch.stack([loss, norm.float(), self.stop_flag])
        if dist.is_initialized():
            dist.all_reduce(stats)
        host = torch.empty(3, pin_memory=self.cuda)
        host.copy_(stats, non_blocking=True)
        end = self.clock()
        peak_gib, self.memory_label = peak_memory(self.device)
        self.run_peak_gib = max(self.run_peak_gib, peak_gib)
        self.pending.append((step, lr, host, self.start, end, peak_gib))
        self.recent = (self.recent + [(end, host)])[-2:]
        if self.world_size == 1:
            return stop.requested()
        if not self.cuda:
            return host[2].item() > 0
        if len(self.recent) < 2:
            return False
        end, host = self.recent[0]
        end.synchronize()
        return host[2].item() > 0

    def flush(self, keep_last=True):
        """Log the pending steps (all but the newest when keep_last)."""
        ready, self.pending = self.pending, []
        if keep_last:
            ready, self.pending = ready[:-1], ready[-1:]
        for step, lr, host, start, end, peak_gib in ready:
            self.log_step(step, lr, host, start, end, peak_gib)

    def log_step(self, step, lr, host, start, end, peak_gib):
        if self.cuda:
            end.synchronize()  # the step's device work, the copy of its numbers included, is done
        train_loss, norm = (host[:2] / self.world_size).tolist()
        if not (math.isfinite(train_loss) and math.isfinite(norm)):
            raise FloatingPointError(
                f"step {step}: train loss {train_loss} / grad norm {norm} is not finite; stopped "
                f"without saving this state. {last_good_checkpoint(self.cfg.out_dir)}")
        dt = end - start
        if self.cuda:
            dt = start.elapsed_time(end) / 1000
        tokens_per_s = self.cfg.global_batch_size * self.cfg.seq_length / dt
        mfu, mfu_text = None, "n/a"
        if self.mfu_scale:
            mfu = tokens_per_s * self.mfu_scale
            mfu_text = f"{100 * mfu:.1f}%"
        self.log(f"step {step:5d}/{self.cfg.max_steps} | loss {train_loss:.6f} | lr {lr:.2e} | "
                 f"norm {norm:.4f} | {dt * 1000:.1f} ms | {tokens_per_s:,.0f} tok/s | "
                 f"MFU {mfu_text} | {self.memory_label} {peak_gib:.2f} GiB "
                 f"(run peak {self.run_peak_gib:.2f})",
                 f"s:{step} trl:{train_loss:.4f} lr:{lr:.6f} norm:{norm:.2f}",
                 step=step, train_loss=train_loss, lr=lr, grad_norm=norm, step_ms=dt * 1000,
                 tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gib=peak_gib,
                 run_peak_mem_gib=self.run_peak_gib,
                 consumed_samples=(step + 1) * self.cfg.global_batch_size)


class Training(typing.NamedTuple):
    """What setup() hands the training loop."""
    model: torch.nn.Module
    optimizer: list  # build_optimizer's torch optimizers, stepped and saved together
    start_step: int
    train_data: object  # Megatron's GPTDataset or BlendedDataset samples (indexed_dataset)
    evaluate: Evaluator
    step_log: StepLog
    data: dict  # data_state(train_data): what each checkpoint records of the data


def nothing_left(cfg, resume_path, log):
    """Whether the run in out_dir is already complete (its last checkpoint and hf/), said if so."""
    if not resume_path or cfg.eval_only:
        return False
    if not on_rank0(lambda: already_complete(cfg, resume_path)):
        return False
    saved = on_rank0(lambda: read_train_state(resume_path)["config"])
    # Where the run and its index cache live is no change to the run.
    differ = config_changes({k: v for k, v in saved.items()
                             if k not in ("out_dir", "index_mapping_dir")}, cfg)
    text = f"{cfg.out_dir}: this run is already complete ({resume_path}, exported to hf/); " \
           "nothing to do"
    if differ:
        text += (f"; the config differs from the run's ({'; '.join(differ)}) and a finished run "
                 "takes no change: use a new out_dir, or raise max_steps to train on")
    log(text)
    return True


def setup(cfg, world_size, device, log, stop):
    """out_dir, data, model, optimizer, resume and evaluation, in that order: a Training, or an
    exit status when nothing is left to train (eval_only, or a run already complete)."""
    resume_path = on_rank0(lambda: prepare_out_dir(cfg.out_dir, cfg.eval_only))
    if nothing_left(cfg, resume_path, log):
        return 0
    train_data, val_data = build_data(cfg, log)
    start = f"init from {cfg.init_from or 'GPT-2 init'}"
    if resume_path:
        start = f"resuming from {resume_path}"
    if dist.is_initialized():
        start = f"FSDP2 over a {device.type} mesh of {world_size} ranks; {start}"
    grad_accum_steps = max(1, cfg.global_batch_size // (cfg.local_batch_size * world_size))
    log(f"world size {world_size}, device {device}, dtype {cfg.dtype}, grad accumulation "
        f"{grad_accum_steps}; {start}")
    model_config, init = starting_point(cfg, resume_path)
    # The weights' architecture wins (init_from or a checkpoint): train_config.json says so.
    for key in ARCHITECTURE:
        if getattr(cfg, key) != getattr(model_config, key):
            log(f"{key} {getattr(model_config, key)} from {init[1]} "
                f"(the config's {getattr(cfg, key)} does not apply)")
            setattr(cfg, key, getattr(model_config, key))
    if cfg.seq_length > model_config.block_size:
        raise ValueError(f"config: seq_length {cfg.seq_length} is longer than the model's "
                         f"context ({model_config.block_size} positions)")
    model = build_model(model_config, init, cfg, device)
    optimizer = build_optimizer(model, cfg, device)
    data, step = {}, 0
    if train_data is not None:
        data = data_state(train_data)
    if resume_path is not None:
        step = resume(resume_path, model, optimizer, cfg, data, log, train_data)
    on_rank0(lambda: log.start(cfg, resumed=resume_path is not None))
    evaluate = Evaluator(cfg, val_data, model_config.vocab_size, device, log)
    step_log = StepLog(cfg, log, device, model)
    if not cfg.eval_only:
        return Training(model, optimizer, step, train_data, evaluate, step_log, data)
    log(f"eval_only: the results are appended to {log.out_dir}/main.log and metrics.jsonl (the "
        "config to eval_config.json); the run's own logs are left as they are")
    if evaluate(model, step, stop):
        return 0
    return 128 + (stop.signal or signal.SIGTERM)


def train(cfg, rank, world_size, device, log, stop, checkpoints):
    """Set up, then train from the start step to max_steps; the exit status."""
    training = setup(cfg, world_size, device, log, stop)
    if not isinstance(training, Training):
        return training  # an exit status: nothing left to train
    model, optimizer, start_step, train_data, evaluate, step_log, data = training
    grad_accum_steps = cfg.global_batch_size // (cfg.local_batch_size * world_size)
    sampler = iter(PretrainingSampler(cfg.max_steps * cfg.global_batch_size,
                                      start_step * cfg.global_batch_size,
                                      cfg.local_batch_size, rank, world_size))
    batches = prefetch(train_data, sampler, grad_accum_steps, model.config.vocab_size,
                       device.type == "cuda", stop)

    def save(done, stopping=False):
        """Checkpoint after `done` steps; on a stop, the exit status 128 + signum (143 for
        SIGTERM, also on ranks that only heard of it from another), or the data error raised."""
        checkpoints.save(model, optimizer, done, data, wait=stopping)
        if stop.error is not None:
            raise stop.error
        if stopping:
            since = ""
            if stop.time:
                since = f", {time.perf_counter() - stop.time:.1f} s after the signal"
            log(f"stopped by a signal at step {done}{since}; rerun the same command to resume")
            return 128 + (stop.signal or signal.SIGTERM)  # or another rank's

    if any_rank(stop.requested()):  # a signal during setup: nothing to train before the checkpoint
        return save(start_step, stopping=True)
    for step in range(start_step, cfg.max_steps + 1):
        last_step = step == cfg.max_steps
        if step % cfg.val_every_steps == 0 or last_step:
            step_log.flush(keep_last=False)
            if not evaluate(model, step, stop):  # a stop came during the evaluation
                return save(step, stopping=True)
        if last_step:
            break

        # One optimizer step over global_batch_size sequences; nothing here waits for the device.
        step_log.start_step()
        step_batches = batches.get()
        if isinstance(step_batches, BaseException):
            if world_size == 1:  # the other ranks could not join the checkpoint
                return save(step, stopping=True)
            raise step_batches
        loss_sum = torch.zeros((), device=device)
        for micro_step, (tokens, labels) in enumerate(step_batches):
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            if dist.is_initialized():  # reduce-scatter gradients once per step, not per micro-batch
                model.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
            with evaluate.autocast:
                _, micro_loss = model(tokens, labels)
            (micro_loss / grad_accum_steps).backward()
            loss_sum += micro_loss.detach()
        loss = loss_sum / grad_accum_steps
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        lr = lr_at(step, cfg)
        for opt in optimizer:
            for group in opt.param_groups:
                group["lr"] = lr * group["lr_scale"]
            opt.step()
            opt.zero_grad(set_to_none=True)
        stop_requested = step_log.end_step(step, lr, loss, norm, stop)
        checkpoints.poll()

        done = step + 1
        checkpoint_due = done == cfg.max_steps or \
            (cfg.ckpt_every_steps and done % cfg.ckpt_every_steps == 0)
        if checkpoint_due or stop_requested or done % cfg.log_every_steps == 0:
            # Before a checkpoint every number is read, so that a non-finite step is never saved.
            step_log.flush(keep_last=not (checkpoint_due or stop_requested))
        if checkpoint_due or stop_requested:
            status = save(done, stopping=stop_requested)
            if stop_requested:
                return status
    checkpoints.wait()
    publish_hf(model, cfg)
    return 0


def main(argv=None):
    """Train; the exit status: 0 finished, 128 + signum stopped by SIGTERM/SIGINT after its
    checkpoint."""
    if argv is None:
        argv = sys.argv[1:]
    return run(load_config(argv))


GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
        "Timed out waiting", "NCCL communicator was aborted")


def lost_peer(error):
    """The first line of what says that another rank died or stopped answering (a gloo or NCCL
    error in a collective, also one DCP wraps), or None."""
    causes, seen = [error], set()
    while causes:
        e = causes.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dist.DistError) or \
                (isinstance(e, RuntimeError) and any(words in str(e) for words in GONE)):
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return re.sub(r"^\[[^\]]*\] *", "", line).split(". ")[0]  # gloo's source location off
        causes += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None) or {}
        for failure in failures.values():
            if isinstance(failure, tuple):
                failure = failure[0]
            causes.append(failure)
    return None


def run(cfg, restore_signals=True):
    """Train; with `restore_signals` False (the command line), SIGTERM and SIGINT stay absorbed
    until the process exits, so that a signal during the report of an error cannot cut it short."""
    rank, world_size, device = setup_distributed(cfg.device, cfg.dist_timeout_s)
    log_dir = cfg.out_dir
    if cfg.eval_only:
        log_dir = os.path.join(cfg.out_dir, "eval")
    log = RunLog(log_dir)
    stop = StopRequest()
    checkpoints = Checkpoints(cfg, log)
    try:
        try:
            return train(cfg, rank, world_size, device, log, stop, checkpoints)
        finally:  # a stop, the end of the run or an error: the write in flight is finished first
            checkpoints.wait()
    except Exception as e:
        cause = None
        if world_size > 1:
            cause = lost_peer(e)
        if cause is None:
            raise
        raise PeerLost("lost another rank of the run (it was killed, ended with an error of its "
                       f"own, or its node failed or stopped answering: {cause}); rerun the same "
                       "command to resume from the last checkpoint") from None
    finally:
        if restore_signals:
            stop.restore()
        if log.wandb is not None:
            log.wandb.finish()
        while LOCKS:
            os.close(LOCKS.pop())  # closing the only descriptor drops the flock
        if dist.is_initialized():
            # Free what still refers to the process group (compiled graphs, FSDP state) first:
            # gloo otherwise aborts now and then at exit.
            gc.collect()
            dist.destroy_process_group()


SPACE = "the disk is full: free some space or choose another out_dir"
WRITE = "choose a directory you can write to"
NOT_A_DIRECTORY = "a part of the path is a file, not a directory; choose another path"
OS_ERROR_HINTS = {errno.ENOSPC: SPACE, errno.EDQUOT: SPACE, errno.EACCES: WRITE,
                  errno.EPERM: WRITE, errno.ENOTDIR: NOT_A_DIRECTORY,
                  errno.EEXIST: NOT_A_DIRECTORY, errno.ENOENT: "check the path",
                  errno.EROFS: "the filesystem is read-only; choose another directory"}


def cli(argv=None):
    """`python train_gpt2.py ...`: exit with main()'s status; an error is one line, prefixed with
    the rank under torchrun."""
    if argv is None:
        argv = sys.argv[1:]
    problem = torch_version_problem()
    if problem:
        sys.exit(f"train_gpt2.py: error: {problem}")
    if {"-h", "--help"} & set(argv):
        print(config_help(TrainConfig))
        sys.exit(0)
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = load_config(argv)
    except (ValueError, OSError) as e:
        if rank == 0:  # every rank reads the same config: rank 0 alone says what is wrong
            sys.exit(f"train_gpt2.py: error: {e}")
        sys.exit(1)
    prefix = ""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        prefix = f"[rank {rank}] "
    try:
        sys.exit(run(cfg, restore_signals=False))
    except (ValueError, FloatingPointError, PeerLost) as e:
        sys.exit(f"{prefix}train_gpt2.py: error: {e}")
    except torch.cuda.OutOfMemoryError:
        sys.exit(f"{prefix}train_gpt2.py: error: out of GPU memory; lower local_batch_size (the "
                 "gradient accumulation grows to keep global_batch_size), set "
                 "activation_checkpointing=True, or use more GPUs")
    except OSError as e:  # a file or directory the run cannot use
        text = e.strerror or str(e)
        if e.filename is not None:
            text = f"{e.filename}: {text}"
        if e.errno in OS_ERROR_HINTS:
            text += f"; {OS_ERROR_HINTS[e.errno]}"
        sys.exit(f"{prefix}train_gpt2.py: error: {text}")


if __name__ == "__main__":
    cli()
