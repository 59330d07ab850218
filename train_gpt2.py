"""
Pretrain GPT-2 on Megatron-format token datasets (FineWeb-Edu), on one CPU process or many GPUs and nodes.

    python train_gpt2.py configs/demo_cpu.py                                    # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py  # one node, 8 GPUs
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train_gpt2.py CONFIG.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --compile=False   # --key=value overrides the config

Config: the defaults in TrainConfig below, then the config file (top-level assignments), then --key=value arguments.
Under torchrun the model is sharded with FSDP2 (NCCL on GPUs, gloo on CPU); one process trains a plain model.
Everything goes into out_dir: train_config.json, main.log (llm.c's log format, so llm.c's vislog can lay the curves over
its own), metrics.jsonl (every metric), ckpt/step_NNNNNNNN/ (torch.distributed.checkpoint) and, at the end, hf/
(Hugging Face GPT-2 weights). Rerunning the same command resumes from the newest complete checkpoint, on any number of
ranks; out_dir must be on a filesystem every node sees. SIGTERM/SIGINT write a checkpoint at the next step boundary
and exit cleanly.
"""
import ast
import dataclasses
import difflib
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
import traceback
import types
import typing
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, set_model_state_dict)

import hellaswag
from atomic_io import atomic_write, fsync_dir
from checkpoint import (assert_finite, complete_checkpoints, is_run_or_checkpoint, load_checkpoint, load_weights,
                        newest_usable_checkpoint, read_train_state, resolve_checkpoint, save_checkpoint)
from distributed import barrier, broadcast_object, setup_distributed
from indexed_dataset import PretrainingSampler, build_gpt_datasets, sequential_samples
from model import GPT, GPTConfig
from run_dir import HF_MARKER, RunLock, check_out_dir, move_old_logs, os_error_message
from sample import sample_texts
from tokenizer import VOCAB_SIZE


@dataclass
class TrainConfig:
    # data: token datasets written by prepare_fineweb.py (or Megatron's preprocess_data.py)
    data_paths: str | list = "fineweb_edu/megatron_gpt2/processed_data_*_text_document"  # prefix, glob, or blend list
    index_mapping_dir: str | None = None  # dataset index cache; None: beside each prefix, as Megatron does
    split: str = "969,30,1"  # train, validation, test shares of each prefix's documents
    seq_length: int = 1024
    # model; when weights come from init_from or a checkpoint, their architecture is used instead
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    padded_vocab_size: int | None = 50304  # rows of wte/lm_head; 50304 = 64 * 786 runs faster on GPUs
    init_from: str | None = None  # None: GPT-2 init from seed; an HF id/directory; or a train_gpt2 out_dir/checkpoint
    # batch: global_batch_size sequences per optimizer step, local_batch_size per forward on one rank
    global_batch_size: int = 512
    local_batch_size: int = 16
    # AdamW, weight decay on 2-D parameters only; linear warmup, then cosine decay to min_lr at max_steps
    max_steps: int | None = 19073  # about 10B tokens at 524,288 tokens per step; None: one epoch of the train split
    lr: float = 6e-4
    min_lr: float = 0.0  # llm.c's GPT-2 runs decay to 0 (build-nanogpt to 0.1 x lr)
    lr_warmup_steps: int = 700
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    # evaluation at step 0, every val_every_steps and after the last step
    val_every_steps: int = 250
    val_tokens: int = 10_485_760  # the first tokens of the validation split, in order (llm.c: 10,240 x 1024); 0 = off
    hellaswag: str | None = None  # None = off; a HellaSwag jsonl file; or "download"
    hellaswag_limit: int | None = None  # score only the first N examples
    sample_tokens: int = 0  # tokens sampled at each validation when the vocabulary is GPT-2's; 0 = off
    # outputs
    out_dir: str = "out"
    ckpt_every_steps: int = 1000  # 0 = only at the end and on SIGTERM/SIGINT
    ckpt_keep: int = 2  # complete checkpoints kept, newest first
    # system
    seed: int = 1234  # model init and data order
    device: str = "auto"  # auto (cuda when available), cuda, cpu
    dtype: str = "bfloat16"  # bfloat16: FSDP bf16 params with fp32 gradient reduction, or autocast on one device
    compile: bool = True  # torch.compile each transformer block
    dist_timeout_s: int = 900  # a collective that waits longer than this fails instead of hanging


# dense bf16 tensor-core peak of one GPU in TFLOP/s, for MFU; the first name found in the device name wins
PEAK_BF16_TFLOPS = [("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("A100", 312),
                    ("B200", 2250)]


# -----------------------------------------------------------------------------
# config

def load_config(argv):
    """TrainConfig from argv: optional config files (Python, top-level assignments) and --key=value overrides, in
    order. Values are parsed with ast.literal_eval, falling back to the plain string. Unknown keys and wrong types
    raise ValueError naming the key (and the closest valid one)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values = {}

    def checked(key, value, where):
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"{where}: unknown config key '{key}'{hint}")
        allowed = typing.get_args(fields[key].type) or (fields[key].type,)
        if float in allowed and type(value) is int:
            value = float(value)
        if not any(type(value) is t or (t not in (int, bool) and isinstance(value, t)) for t in allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{where}: {key} must be {names}, got {value!r} ({type(value).__name__})")
        return value

    def exec_config(path):
        """The namespace of config file `path` run as Python; its errors become one ValueError naming file:line."""
        namespace = {}
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            exec(compile(text, path, "exec"), namespace)
        except SyntaxError as e:
            raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
        except SystemExit as e:  # a config must not end the run, least of all with exit status 0
            raise ValueError(f"{path}: the config file called sys.exit({e.code!r}); a config only assigns values") \
                from None
        except Exception as e:
            line = next((frame.lineno for frame in reversed(traceback.extract_tb(e.__traceback__))
                         if frame.filename == path), "?")
            raise ValueError(f"{path}:{line}: {type(e).__name__}: {e}") from None
        return namespace

    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ValueError(f"{arg}: write overrides as --key=value")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            try:
                values[key] = checked(key, value, f"command line {arg}")
            except ValueError:
                if key not in fields or str not in typing.get_args(fields[key].type) + (fields[key].type,):
                    raise
                values[key] = text  # --split=969,30,1 means the string, not a tuple
        else:
            if not os.path.isfile(arg):
                raise FileNotFoundError(f"{arg}: config file not found")
            namespace = exec_config(arg)
            for key, value in namespace.items():
                if not key.startswith("_") and not isinstance(value, types.ModuleType):
                    values[key] = checked(key, value, arg)
    cfg = TrainConfig(**values)
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Values that are out of range raise ValueError naming the key."""
    at_least = dict(seq_length=1, n_layer=1, n_head=1, n_embd=1, vocab_size=1, global_batch_size=1, local_batch_size=1,
                    max_steps=1, lr=0.0, min_lr=0.0, lr_warmup_steps=0, weight_decay=0.0, adam_eps=0.0, grad_clip=0.0,
                    val_every_steps=1, val_tokens=0, sample_tokens=0, ckpt_every_steps=0, ckpt_keep=1,
                    dist_timeout_s=1)
    for key, low in at_least.items():
        if getattr(cfg, key) is not None and getattr(cfg, key) < low:
            raise ValueError(f"config: {key} must be >= {low}, got {getattr(cfg, key)}")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"config: n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
    if cfg.padded_vocab_size is not None and cfg.padded_vocab_size < cfg.vocab_size:
        raise ValueError(f"config: padded_vocab_size {cfg.padded_vocab_size} is smaller than vocab_size "
                         f"{cfg.vocab_size}")
    if cfg.hellaswag_limit is not None and cfg.hellaswag_limit < 1:
        raise ValueError(f"config: hellaswag_limit must be None or >= 1, got {cfg.hellaswag_limit}")
    if 0 < cfg.val_tokens < cfg.seq_length:
        raise ValueError(f"config: val_tokens {cfg.val_tokens} is less than one sequence of seq_length "
                         f"{cfg.seq_length}")
    for key, choices in dict(device=("auto", "cuda", "cpu"), dtype=("bfloat16", "float32")).items():
        if getattr(cfg, key) not in choices:
            raise ValueError(f"config: {key} must be one of {', '.join(choices)}, got {getattr(cfg, key)!r}")
    for key in ("lr", "min_lr", "weight_decay", "adam_eps", "grad_clip", "beta1", "beta2"):
        if not math.isfinite(getattr(cfg, key)):
            raise ValueError(f"config: {key} must be a finite number, got {getattr(cfg, key)}")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        raise ValueError(f"config: beta1 and beta2 must be in [0, 1), got {cfg.beta1}, {cfg.beta2}")


# -----------------------------------------------------------------------------
# model

def starting_point(cfg, resume_path, rank):
    """(GPTConfig, source, checkpoint): the architecture, and where the first weights come from: `source`, on rank 0
    a CPU fp32 GPT holding them (GPT-2 init from cfg.seed, or Hugging Face weights; None on other ranks), or the
    checkpoint to load them from (resuming, or init_from a train_gpt2 run). Building the full model in one place
    makes the init identical on any number of ranks. cfg.padded_vocab_size applies to Hugging Face weights; a
    train_gpt2 checkpoint keeps its own."""
    if resume_path is not None:
        model_config = GPTConfig(**read_train_state(resume_path)["model_config"])
        if cfg.init_from is None:
            ours = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                        padded_vocab_size=cfg.padded_vocab_size)
            differ = [f"{k} {getattr(model_config, k)} (config: {v})" for k, v in ours.items()
                      if getattr(model_config, k) != v]
            if differ:
                raise ValueError(f"{resume_path}: the checkpoint to resume from has {', '.join(differ)}; use the "
                                 f"checkpoint's architecture or another out_dir")
        return model_config, None, resume_path
    if cfg.init_from is not None and is_run_or_checkpoint(cfg.init_from):
        ckpt_path = resolve_checkpoint(cfg.init_from)
        return GPTConfig(**read_train_state(ckpt_path)["model_config"]), None, ckpt_path
    if cfg.init_from is None:
        model_config = GPTConfig(block_size=cfg.seq_length, vocab_size=cfg.vocab_size,
                                 padded_vocab_size=cfg.padded_vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                 n_embd=cfg.n_embd)
        if rank != 0:
            return model_config, None, None
        with torch.device("meta"):
            model = GPT(model_config)
        model.to_empty(device="cpu")
        torch.manual_seed(cfg.seed)
        model.init_weights()  # GPT-2 init drawn from this seed alone: padded vocabulary rows change no number
        return model_config, model, None
    source = GPT.from_pretrained(cfg.init_from, padded_vocab_size=cfg.padded_vocab_size) if rank == 0 else None
    return broadcast_object(source.config if rank == 0 else None), source, None


def build_model(model_config, source, cfg, device):
    """The model to train on `device`. With a process group: built on the meta device, each block compiled and
    sharded with FSDP2, then only this rank's shard is materialised and, when rank 0 has a `source`, filled from it
    (else a checkpoint fills it next). Without one: `source`, or a fresh GPT for a checkpoint, moved to `device`."""
    if not dist.is_initialized():
        model = (source if source is not None else GPT(model_config)).to(device)
        if cfg.compile:
            for block in model.transformer.h:
                block.compile()
        return model

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        model = GPT(model_config)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.dtype == "bfloat16" else MixedPrecisionPolicy()
    for block in model.transformer.h:
        if cfg.compile:
            block.compile()  # before sharding: no graph breaks at FSDP's hooks and state-dict names stay the same
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    model.to_empty(device=device)
    if broadcast_object(source is not None):  # rank 0 holds the weights
        set_model_state_dict(model, source.state_dict() if source is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def lr_at(step, cfg):
    """llm.c's schedule: linear warmup (step 0 already gets lr / lr_warmup_steps), then cosine from lr to min_lr."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    decay_ratio = (step - cfg.lr_warmup_steps) / max(1, cfg.max_steps - cfg.lr_warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg.lr - cfg.min_lr)


def peak_flops(device):
    """Dense bf16 FLOP/s of one `device` from PEAK_BF16_TFLOPS, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


# -----------------------------------------------------------------------------
# data and evaluation

def to_batch(samples, device, vocab_size, data_paths):
    """Stack dataset samples into (tokens, labels) LongTensors on `device`."""
    tokens = np.stack([s["tokens"] for s in samples])
    labels = np.stack([s["labels"] for s in samples])
    largest = max(int(tokens.max()), int(labels.max()))
    if largest >= vocab_size:
        raise ValueError(f"{data_paths}: token id {largest} in the data is outside the model's vocabulary "
                         f"(vocab_size {vocab_size}); the data was tokenized for another vocabulary")
    tokens, labels = torch.from_numpy(tokens), torch.from_numpy(labels)
    if device.type == "cuda":
        tokens, labels = tokens.pin_memory(), labels.pin_memory()
    return tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)


@torch.no_grad()
def validation_loss(model, val_data, batch_size, device, autocast, data_paths):
    """Mean cross-entropy per token over every window of `val_data`, all ranks together: rank r scores windows
    r, r + W, ...; token-weighted loss sums are all-reduced. Every rank runs the same number of forwards, since a
    sharded model gathers its weights collectively in each one."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = list(range(rank, len(val_data), world_size))
    num_batches = math.ceil(math.ceil(len(val_data) / world_size) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    model.eval()
    for b in range(num_batches):
        indices = mine[b * batch_size:(b + 1) * batch_size]
        tokens, labels = to_batch([val_data[i] for i in (indices or [0])], device, model.config.vocab_size, data_paths)
        with autocast:
            _, loss = model(tokens, labels)
        if indices:
            totals[0] += loss.double() * labels.numel()
            totals[1] += labels.numel()
    model.train()
    if dist.is_initialized():
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


# -----------------------------------------------------------------------------
# training

class StopRequest:
    """Remembers SIGTERM/SIGINT (preemption, Ctrl-C) so the loop can checkpoint at the next step boundary and exit.
    A second signal gets the previous handler: Ctrl-C twice interrupts at once. `received` keeps the number of the
    latest signal in this process, so main can exit 128 + signum (143 after SIGTERM) and a scheduler requeues the run."""
    received = None

    def __init__(self):
        self.signal = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def handle(self, signum, frame):
        self.signal = signal.Signals(signum).name
        StopRequest.received = signum
        self.restore()

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class RunLog:
    """On rank 0: a console line, a main.log line (llm.c's format, so llm.c's vislog reads it) and a metrics.jsonl
    record (every metric); other ranks stay silent."""

    def __init__(self, out_dir, master):
        self.out_dir, self.master = out_dir, master

    def __call__(self, text, main_log=None, **metrics):
        if not self.master:
            return
        if text:
            print(text, flush=True)
        if main_log:
            with open(os.path.join(self.out_dir, "main.log"), "a") as f:
                f.write(main_log + "\n")
        if metrics:
            with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(dict(metrics, time=time.time())) + "\n")


def prepare_out_dir(cfg, master):
    """Check and lock out_dir, create out_dir/ckpt, write train_config.json, and return (ckpt_root, the newest
    usable checkpoint or None). Rank 0 does the work and every rank raises its error, if any. The lock (see run_dir)
    is taken by global rank 0 only: it stands for the whole run, and the other ranks, on this node or others, belong
    to that same run. A temporary checkpoint directory is what a write interrupted before its rename leaves; it is
    never resumed from. Damaged checkpoints are renamed aside; a fresh run moves an earlier run's logs aside."""
    ckpt_root = os.path.join(cfg.out_dir, "ckpt")
    error = resume_path = None
    if master:
        try:
            check_out_dir(cfg.out_dir)
            os.makedirs(ckpt_root, exist_ok=True)
            RunLock.acquire(cfg.out_dir)
            for name in os.listdir(ckpt_root):
                if name.endswith(".tmp"):  # ours: the lock says no other run is writing it
                    print(f"removing incomplete checkpoint {os.path.join(ckpt_root, name)}")
                    shutil.rmtree(os.path.join(ckpt_root, name))
            resume_path, messages = newest_usable_checkpoint(ckpt_root)
            if resume_path is None:
                messages += move_old_logs(cfg.out_dir)
            for message in messages:
                print(message)
            with atomic_write(os.path.join(cfg.out_dir, "train_config.json"), "w", encoding="utf-8") as f:
                json.dump(dataclasses.asdict(cfg), f, indent=2)
            print(json.dumps(dataclasses.asdict(cfg), indent=2))
        except (ValueError, OSError) as e:
            error = e
    error, resume_path = broadcast_object((error, resume_path))
    if error is not None:
        raise error
    return ckpt_root, resume_path


def build_data(cfg, log, master):
    """(train_data, val_data): the train split in Megatron's shuffled order, the validation split in order (or None).
    max_steps None becomes one epoch of the train split."""
    train_samples = None if cfg.max_steps is None else cfg.max_steps * cfg.global_batch_size
    train_data, _, _ = build_gpt_datasets(cfg.data_paths, seq_length=cfg.seq_length, split=cfg.split, seed=cfg.seed,
                                          sizes=(train_samples, 0, 0), cache_dir=cfg.index_mapping_dir)
    if train_data is None:
        raise ValueError(f"{cfg.data_paths}: the train split is empty (split {cfg.split!r})")
    # an unweighted glob is one epoch at most (as in Megatron and AutoModel): fail now, not at the step that runs out
    epoch_steps = len(train_data) // cfg.global_batch_size
    if cfg.max_steps is None:
        if epoch_steps < 1:
            raise ValueError(f"{cfg.data_paths}: the train split has {len(train_data):,} samples, fewer than one "
                             f"global batch of {cfg.global_batch_size}")
        cfg.max_steps = epoch_steps
        log(f"max_steps None: one epoch of the train split is {cfg.max_steps:,} steps")
    elif len(train_data) < train_samples:
        raise ValueError(f"{cfg.data_paths}: the train split has {len(train_data):,} samples of {cfg.seq_length} "
                         f"tokens, fewer than max_steps x global_batch_size = {train_samples:,} (an unweighted glob "
                         f"gives one epoch at most); set max_steps <= {epoch_steps:,}, or max_steps=None for one epoch")
    val_data = None
    if cfg.val_tokens:
        val_data = sequential_samples(cfg.data_paths, seq_length=cfg.seq_length, split=cfg.split, split_index=1,
                                      max_samples=cfg.val_tokens // cfg.seq_length)
        if val_data is None:
            log(f"no validation: split {cfg.split!r} gives the validation split no share")
        elif master:
            print(f"validation: {len(val_data) * cfg.seq_length:,} tokens")
    return train_data, val_data


def build_optimizer(model, cfg, device):
    """AdamW with weight decay on the 2-D parameters (matmul weights and embeddings) only, as GPT-2 recipes do."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=device.type == "cuda")


def resume(resume_path, model, optimizer, cfg):
    """(step, consumed_samples) of the checkpoint loaded into model and optimizer, or (0, 0) for a fresh run."""
    if resume_path is None:
        return 0, 0
    train_state = load_checkpoint(resume_path, model, optimizer)
    step, consumed_samples = train_state["step"], train_state["consumed_samples"]
    if step > cfg.max_steps:
        raise ValueError(f"{resume_path}: the checkpoint is at step {step}, beyond max_steps {cfg.max_steps}")
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):  # the config wins
        group.update(weight_decay=weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
    return step, consumed_samples


def load_hellaswag(cfg, master):
    """The HellaSwag examples (downloaded once, by rank 0, before the other ranks read the cached file), or None."""
    if cfg.hellaswag is None:
        return None
    path = None if cfg.hellaswag == "download" else cfg.hellaswag
    examples = hellaswag.load_examples(path) if master else None
    barrier()
    return examples if master else hellaswag.load_examples(path)


def evaluate(model, step, cfg, ctx):
    """Validation loss, HellaSwag and a sample at an evaluation step, before that step's update: s:0 is the model at
    init, s:max_steps the final one. Every rank takes part: a sharded model's forward is collective."""
    log = ctx.log
    if ctx.val_data is not None:
        t0 = time.perf_counter()
        val_loss = validation_loss(model, ctx.val_data, cfg.local_batch_size, ctx.device, ctx.autocast,
                                   cfg.data_paths)
        log(f"step {step:5d}/{cfg.max_steps} | val loss {val_loss:.6f} | {time.perf_counter() - t0:.1f} s",
            f"s:{step} tel:{val_loss:.4f}", step=step, val_loss=val_loss)
    if ctx.hellaswag_examples is not None and step > 0:
        result = hellaswag.evaluate(model, ctx.hellaswag_examples, device=ctx.device, rank=ctx.rank,
                                    world_size=ctx.world_size, autocast_dtype=ctx.autocast_dtype,
                                    limit=cfg.hellaswag_limit)
        log(f"step {step:5d}/{cfg.max_steps} | hellaswag acc_norm {result['acc_norm']:.4f} "
            f"({result['correct_norm']}/{result['total']})", f"s:{step} eval:{result['acc_norm']:.4f}",
            step=step, hellaswag_acc_norm=result["acc_norm"], hellaswag_acc=result["acc"])
    if ctx.sample_tokens and step > 0:
        with ctx.autocast:
            text = sample_texts(model, "", max_new_tokens=ctx.sample_tokens, seed=cfg.seed + step,
                                device=ctx.device)[0]
        log(f"step {step:5d}/{cfg.max_steps} | sample: {text!r}", step=step, sample=text)


def forward_backward(model, batches, ctx):
    """Gradients of the mean loss over `batches` (one per micro-step) in the model; returns the summed loss."""
    loss_sum = torch.zeros((), device=ctx.device)
    for micro_step, (tokens, labels) in enumerate(batches):
        if ctx.distributed:  # reduce-scatter gradients once per step, not once per micro-batch
            model.set_requires_gradient_sync(micro_step == len(batches) - 1)
        with ctx.autocast:
            _, loss = model(tokens, labels)
        (loss / len(batches)).backward()
        loss_sum += loss.detach()
    return loss_sum


def step_stats(loss_sum, norm, stop, ctx, grad_accum_steps):
    """(mean loss over every token of the step on every rank, grad norm, whether any rank was asked to stop)."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    stop_flag = torch.tensor(float(stop.signal is not None), device=ctx.device)
    stats = torch.stack([loss_sum / grad_accum_steps, stop_flag])
    if ctx.distributed:
        dist.all_reduce(stats)
    return stats[0].item() / ctx.world_size, norm.item(), stats[1].item() > 0


def memory_in_use(device):
    """(GiB, label): the CUDA allocator's peak, or the process's peak resident set size on the CPU (Linux: KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "mem"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss"


def export_hf(model, cfg, master):
    """The final weights for transformers (and everything else that reads Hugging Face GPT-2 directories), written to
    a temporary directory and renamed to out_dir/hf. An hf/ there is replaced only when it carries HF_MARKER (or is
    an export of the code before markers: config.json and model.safetensors alone); anything else is moved aside."""
    assert_finite(model, "Hugging Face export", os.path.join(cfg.out_dir, "ckpt"))
    t0 = time.perf_counter()
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    hf_dir = os.path.join(cfg.out_dir, "hf")
    if master:
        tmp = os.path.join(cfg.out_dir, f".hf.{os.getpid()}.tmp")
        model.save_pretrained(tmp, state_dict=full_state)
        with atomic_write(os.path.join(tmp, HF_MARKER), "w", encoding="utf-8") as f:
            json.dump(dict(written_by="train_gpt2.py", step=cfg.max_steps), f)
        old = None
        if os.path.isdir(hf_dir):
            entries = set(os.listdir(hf_dir))
            ours = HF_MARKER in entries or entries <= {"config.json", "model.safetensors", "generation_config.json"}
            old = os.path.join(cfg.out_dir, f".hf.{os.getpid()}.old") if ours else \
                f"{hf_dir}.moved-{time.strftime('%Y%m%d-%H%M%S')}"
            os.rename(hf_dir, old)
            if not ours:
                print(f"{hf_dir} was not written by train_gpt2.py; moved to {old}")
        os.rename(tmp, hf_dir)
        fsync_dir(cfg.out_dir)
        if old is not None and old.endswith(".old"):
            shutil.rmtree(old)
        print(f"exported Hugging Face weights to {hf_dir} ({time.perf_counter() - t0:.1f} s)")
    barrier()


def setup(cfg, rank, world_size, device):
    """Everything the loop needs, in the order it must happen: out_dir, data, model, optimizer, resume, evaluation
    inputs. Returns (model, optimizer, step, consumed_samples, ctx)."""
    master = rank == 0
    if cfg.global_batch_size % (cfg.local_batch_size * world_size):
        raise ValueError(f"config: global_batch_size {cfg.global_batch_size} is not divisible by local_batch_size "
                         f"{cfg.local_batch_size} x world size {world_size} = {cfg.local_batch_size * world_size}")
    log = RunLog(cfg.out_dir, master)
    ckpt_root, resume_path = prepare_out_dir(cfg, master)
    train_data, val_data = build_data(cfg, log, master)
    grad_accum_steps = cfg.global_batch_size // (cfg.local_batch_size * world_size)
    if master:
        print(f"world size {world_size}, device {device}, dtype {cfg.dtype}, grad accumulation {grad_accum_steps}; "
              + (f"resuming from {resume_path}" if resume_path else f"init from {cfg.init_from or 'GPT-2 init'}"))
    model_config, source, weights_checkpoint = starting_point(cfg, resume_path, rank)
    if cfg.seq_length > model_config.block_size:
        raise ValueError(f"config: seq_length {cfg.seq_length} is longer than the model's context "
                         f"({model_config.block_size} positions)")
    if cfg.hellaswag is not None and model_config.vocab_size != VOCAB_SIZE:
        raise ValueError(f"config: hellaswag needs the GPT-2 vocabulary; the model has {model_config.vocab_size} "
                         f"tokens")
    model = build_model(model_config, source, cfg, device)
    del source
    if weights_checkpoint is not None and resume_path is None:
        load_weights(weights_checkpoint, model)
    optimizer = build_optimizer(model, cfg, device)
    # bf16 on one device is autocast; sharded, FSDP's mixed-precision policy already computes in bf16
    autocast_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" and not dist.is_initialized() else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    step, consumed_samples = resume(resume_path, model, optimizer, cfg)
    peak = peak_flops(device)
    ctx = types.SimpleNamespace(
        rank=rank, world_size=world_size, device=device, master=master, distributed=dist.is_initialized(), log=log,
        ckpt_root=ckpt_root, model_config=model_config, train_data=train_data, val_data=val_data,
        grad_accum_steps=grad_accum_steps, tokens_per_step=cfg.global_batch_size * cfg.seq_length,
        autocast_dtype=autocast_dtype,
        autocast=torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
        flops_per_token=model.flops_per_token(cfg.seq_length), peak_flops=peak,
        hellaswag_examples=load_hellaswag(cfg, master),
        sample_tokens=cfg.sample_tokens if model_config.vocab_size == VOCAB_SIZE else 0)
    if master:
        print(f"model: {model.num_params(non_embedding=False):,} parameters ({model.num_params():,} non-embedding), "
              f"{ctx.flops_per_token / 1e9:.3f} GFLOP/token; bf16 peak "
              + (f"{peak / 1e12:.0f} TFLOP/s per GPU" if peak else "unknown (MFU n/a)"))
    if cfg.sample_tokens and not ctx.sample_tokens:
        log(f"sample_tokens ignored: the vocabulary ({model_config.vocab_size} tokens) is not GPT-2's")
    return model, optimizer, step, consumed_samples, ctx


def train(cfg, rank, world_size, device):
    model, optimizer, step, consumed_samples, ctx = setup(cfg, rank, world_size, device)
    log, vocab_size = ctx.log, ctx.model_config.vocab_size
    sampler = iter(PretrainingSampler(cfg.max_steps * cfg.global_batch_size, consumed_samples, cfg.local_batch_size,
                                      rank, world_size))
    stop = StopRequest()
    try:
        for step in range(step, cfg.max_steps + 1):
            last_step = step == cfg.max_steps
            if step % cfg.val_every_steps == 0 or last_step:
                evaluate(model, step, cfg, ctx)
            if last_step:
                break

            # one optimizer step over global_batch_size sequences
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            batches = [to_batch([ctx.train_data[i] for i in next(sampler)], ctx.device, vocab_size, cfg.data_paths)
                       for _ in range(ctx.grad_accum_steps)]
            loss_sum = forward_backward(model, batches, ctx)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
            train_loss, norm, stop_requested = step_stats(loss_sum, norm, stop, ctx, ctx.grad_accum_steps)
            if not (math.isfinite(train_loss) and math.isfinite(norm)):
                kept = complete_checkpoints(ctx.ckpt_root)
                raise FloatingPointError(
                    f"step {step}: train loss {train_loss} / grad norm {norm} is not finite; stopped before the "
                    f"update. The last good checkpoint is " + (kept[-1] if kept else "none (none was written)"))
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            consumed_samples += cfg.global_batch_size

            dt = time.perf_counter() - t0
            tokens_per_s = ctx.tokens_per_step / dt
            mfu = tokens_per_s * ctx.flops_per_token / (ctx.peak_flops * world_size) if ctx.peak_flops else None
            peak_mem_gib, memory = memory_in_use(ctx.device)
            log(f"step {step + 1:5d}/{cfg.max_steps} | loss {train_loss:.6f} | lr {lr:.2e} | norm {norm:.4f} | "
                f"{dt * 1000:.1f} ms | {tokens_per_s:,.0f} tok/s | MFU "
                + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a") + f" | {memory} {peak_mem_gib:.1f} GiB",
                f"s:{step} trl:{train_loss:.4f} lr:{lr:.6f} norm:{norm:.2f}",
                step=step, train_loss=train_loss, lr=lr, grad_norm=norm, step_ms=dt * 1000,
                tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gib=peak_mem_gib, consumed_samples=consumed_samples)

            done = step + 1
            if stop_requested or done == cfg.max_steps or (cfg.ckpt_every_steps and done % cfg.ckpt_every_steps == 0):
                t0 = time.perf_counter()
                train_state = dict(step=done, consumed_samples=consumed_samples, world_size=world_size,
                                   model_config=dataclasses.asdict(ctx.model_config), config=dataclasses.asdict(cfg))
                path = save_checkpoint(ctx.ckpt_root, model, optimizer, train_state, cfg.ckpt_keep, rank)
                log(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f} s)")
            if stop_requested:
                log(f"stopped by a signal after step {done}; rerun the same command to resume")
                return
    finally:
        stop.restore()
    export_hf(model, cfg, ctx.master)


def main(argv=None):
    """Train; return the exit status: 0 when the run finished, 128 + signum when SIGTERM/SIGINT stopped it early
    (after its checkpoint), so a scheduler sees an interrupted run and requeues it."""
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    rank, world_size, device = setup_distributed(cfg.device, cfg.dist_timeout_s)
    StopRequest.received = None
    try:
        train(cfg, rank, world_size, device)
    finally:
        RunLock.release_all()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if StopRequest.received is None else 128 + StopRequest.received


if __name__ == "__main__":
    prefix = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        status = main()
    except (ValueError, FloatingPointError) as e:
        sys.exit(f"{prefix}train_gpt2.py: error: {e}")
    except OSError as e:  # a file or directory the run cannot use: full disk, read-only, a file in the path
        sys.exit(f"{prefix}train_gpt2.py: error: {os_error_message(e)}")
    sys.exit(status)
