"""Pretrain GPT-2 on Megatron-format token datasets (FineWeb-Edu): one process, or FSDP2 under torchrun.

    python train_gpt2.py configs/demo_cpu.py                   # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --lr_warmup_steps=10

The run writes into out_dir: train_config.json, main.log (llm.c's format), metrics.jsonl,
ckpt/step_NNNNNNNN/ (torch.distributed.checkpoint) and, at the end, hf/ (a Hugging Face GPT-2).
Rerun the same command to resume, on any number of ranks.

Where the common edits go: the model, its activation, attention and loss are in model.py; the
learning-rate schedule is lr_at(), the optimizer and its parameter groups build_optimizer(), the
update update(), and one training step the loop in train(), whose numerics precision() decides.
"""
import dataclasses
import importlib.util
import math
import os
import signal
import sys
import time
import typing

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hellaswag
from batches import host_batch, prefetch
from checkpoint import (Checkpoints, data_state, last_good_checkpoint, load_init_checkpoint,
                        model_config_of, resume, starting_point)
from configurator import NANOGPT_INIT_FROM, config_help, parse_config
from hf_files import check_function, load_hf_sharded
from indexed_dataset import LLMCValWindows, PretrainingSampler, sequential_samples, train_samples
from model import GPT, GPTConfig, init_sharded, materialize, parameters_on_meta
from muon import ShardedMuon
from processes import (StopRequest, any_rank, clock, deterministic_kernels, end_distributed,
                       exit_with, is_master, on_rank0, peak_flops, peak_memory,
                       rank_and_world_size, setup_distributed, torch_version_problem)
from run_dir import RunLog, nothing_left, prepare_out_dir, publish_hf, unlock_out_dirs
from sample import sample_texts
from tokenizer import VOCAB_SIZE


@dataclasses.dataclass
class TrainConfig(GPTConfig):
    # The model: each field of model.GPTConfig is a key too (--n_layer=24), and a field added there
    # is one here. A run's defaults for two of them:
    block_size: int | None = None  # the model's positions; None: seq_length
    padded_vocab_size: int | None = 50304  # 50,257 rounded up to a multiple of 64: faster matmuls
    # data: token datasets written by prepare_fineweb.py (or Megatron's preprocess_data.py)
    data_paths: str | list = "fineweb_edu/megatron_gpt2/processed_data_*_text_document"  # or a blend
    index_mapping_dir: str | None = None  # the index cache; None: beside each prefix, as Megatron's
    split: str = "969,30,1"  # train, validation, test shares of each prefix's documents
    # validation: None takes the first val_tokens of data_paths' validation split; a prefix (such as
    # prepare_fineweb.py's val_text_document) takes llm.c's windows over [EOT] + its documents
    val_data_paths: str | list | None = None
    seq_length: int = 1024
    # where the weights start; when they come from init_from or a checkpoint, their model wins
    init_from: str | None = None  # None: GPT-2 init; an HF id or directory; a run or checkpoint
    # init_from a run of another model (an edited model.py): the tensors that match by name and
    # shape are loaded, the others start from their init; the model is the config's
    init_from_partial: bool = False
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
    # Muon's own rates, chosen by a sweep on the demo (docs/benchmarks.md); the schedule scales
    # each as it scales lr, so min_lr / lr is their floor too.
    muon_lr: float = 0.01  # for the blocks' matrices
    muon_momentum: float = 0.95  # dion's mu
    muon_adjust_lr: str = "spectral_norm"  # lr x sqrt(fan_out/fan_in); "rms_norm": 0.2 sqrt(max)
    muon_scalar_lr: float | None = None  # AdamW's for biases, LayerNorms; None: 5 x lr (SCALAR_LR_FACTOR)
    muon_embed_lr: float | None = None  # for wte (the tied head) and wpe; None: muon_scalar_lr
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    # evaluation at step 0, every val_every_steps and after the last step
    val_every_steps: int = 250
    val_tokens: int = 10_485_760  # llm.c's 10,240 x 1024 first validation tokens; 0 = off
    hellaswag: str | None = None  # None = off; a HellaSwag jsonl file; or "download"
    hellaswag_limit: int | None = None  # score only the first N examples
    sample_tokens: int = 0  # tokens sampled at each validation (GPT-2's vocabulary); 0 = off
    eval_only: bool = False  # evaluate the initial model (init_from or out_dir's) once and exit
    # hf/ at the end: "auto" where a check before step 1 finds that transformers' GPT-2 computes
    # the model (an edited one may not be GPT-2); "require": stop there otherwise; "off": none
    hf_export: str = "auto"
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
    deterministic: bool = False  # bit for bit on a resume on one GPU too, slower: docs/training.md
    dist_timeout_s: int = 900  # a collective that waits longer than this fails instead of hanging


# -------------------------------------------------------------------------------------------------
# the config's checks: a value outside its range stops the run before anything is built

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
        ("muon_lr", 0 < cfg.muon_lr < math.inf, "> 0"),
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
    for key, fine, expected in rules:
        if not fine:
            raise ValueError(f"config: {key} must be {expected}, got {getattr(cfg, key)!r}")
    named = dict(device=("auto", "cuda", "cpu"), dtype=("bfloat16", "float32"),
                 optimizer=("adamw", "muon"),
                 muon_adjust_lr=("spectral_norm", "rms_norm"), hf_export=("auto", "require", "off"))
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


# -------------------------------------------------------------------------------------------------
# model and optimizer

def build_model(model_config, init, cfg, device):
    """The model built on the meta device and sharded with FSDP2 under torchrun; then each rank
    fills in its own rows of the weights."""
    # No memory for GPT-2's weights until each rank has its shard. A parameter that an edit adds
    # keeps its __init__ value, drawn from the seed on every rank alike.
    with parameters_on_meta(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT(model_config)
    # Per block, inside FSDP's and compile's wrapping.
    model.activation_checkpointing = cfg.activation_checkpointing
    model.compile_loss = cfg.compile
    _, _, mp_policy = precision(cfg, device)  # bf16 under torchrun: precision() says why
    mesh = None
    if dist.is_initialized():
        # The mesh of the run's device type: fully_shard's default follows the accelerator.
        mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),))
    # FSDP2 shards each block's parameters by rows over the ranks and all-gathers a block's whole
    # weights just before its forward (and backward), freeing them after: one block at a time is
    # ever whole on a GPU. The root's fully_shard takes the rest (embeddings, head, ln_f).
    for block in model.transformer.h:
        if cfg.compile:
            # Before sharding, so that FSDP's hooks cause no graph breaks and names stay the same.
            block.compile()
        if mesh is not None:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    if mesh is not None:
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    materialize(model, device)
    # Each rank fills only its own rows: GPT-2's init drawn as one process would draw it, a Hugging
    # Face file, or another run's checkpoint.
    kind, source = init
    if kind == "seed":
        init_sharded(model, source)
    elif kind == "hf":
        load_hf_sharded(model, source)
    elif kind == "checkpoint":  # init_from another run: its weights, a fresh optimizer
        if cfg.init_from_partial:  # what the checkpoint lacks starts from GPT-2's init
            init_sharded(model, cfg.seed)
        said = load_init_checkpoint(source, model, cfg.init_from_partial)
        if is_master():
            print(said)
    return model


# Muon's AdamW part trains at this multiple of lr unless muon_scalar_lr is set: the demo's sweep
# found it better at 5x (and 10x) than at 1x or 3x, more than Muon's own lr mattered.
SCALAR_LR_FACTOR = 5


def build_optimizer(model, cfg, device):
    """The optimizers the loop steps: AdamW, with weight decay on the 2-D parameters (matmul weights
    and embeddings) only, as the GPT-2 recipes do; or Muon and AdamW, grouped as dion's Muon is.
    Each group has a name; lr_at()'s rate is multiplied by a group's lr_scale, so that a group of
    its own (say the embedding at 10x) is one more entry here."""
    # Weight decay on the matrices and embeddings, none on biases and LayerNorm gains.
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
    groups = [dict(name="muon", params=[p], lr_scale=scale * cfg.muon_lr / cfg.lr,
                   weight_decay=cfg.weight_decay / scale) for p, scale in zip(matrices, scales)]
    # ShardedMuon: torch.optim.Muon, each FSDP2-sharded matrix orthogonalized whole on one rank.
    adjust_lr_fn = dict(spectral_norm="original", rms_norm="match_rms_adamw")[cfg.muon_adjust_lr]
    muon = ShardedMuon(groups, lr=cfg.muon_lr, momentum=cfg.muon_momentum, nesterov=False,
                       adjust_lr_fn=adjust_lr_fn)
    # AdamW: biases and LayerNorms with weight decay, the 2-D parameters outside the blocks (the
    # embeddings; wte is the head too) without.
    scalar_lr = cfg.muon_scalar_lr or SCALAR_LR_FACTOR * cfg.lr
    embeddings = [p for p in decay if all(p is not q for q in matrices)]  # wte, wpe
    groups = [dict(name="scalar", params=no_decay, weight_decay=cfg.weight_decay,
                   lr_scale=scalar_lr / cfg.lr),
              dict(name="embedding", params=embeddings, weight_decay=0.0,
                   lr_scale=(cfg.muon_embed_lr or scalar_lr) / cfg.lr)]
    return [muon, torch.optim.AdamW(groups, **adamw)]


def build_extra_state(model, cfg):
    """Training state that an edit adds beyond the model, the optimizer and the random generators
    (an EMA of the weights, say): {name: {key: tensor}}. Every checkpoint saves it and a resume
    loads it in place, so the loop updates its tensors in place (docs/training.md shows an EMA)."""
    return {}


def update(model, optimizer, step, cfg):
    """Clip the gradients, then step every optimizer at step's lr: (grad norm, lr)."""
    # The norm of all gradients together (of every rank's shards under FSDP2); above grad_clip,
    # every gradient is scaled down in place by the same factor.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
    # Every group follows the schedule at its own scale (Muon's matrices, a 10x embedding).
    lr = lr_at(step, cfg)
    for opt in optimizer:
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_scale"]
        opt.step()
        opt.zero_grad(set_to_none=True)  # frees the gradients' memory until the next backward
    return norm, lr


def lr_at(step, cfg):
    """llm.c's schedule: linear warmup (step 0 already gets lr / lr_warmup_steps), then a cosine
    decay from lr to min_lr at max_steps."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    decay_ratio = (step - cfg.lr_warmup_steps) / max(1, cfg.max_steps - cfg.lr_warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg.lr - cfg.min_lr)


# -------------------------------------------------------------------------------------------------
# data and evaluation

def build_data(cfg, log):
    """(train_data, val_data): Megatron's GPTDataset samples of the train split (None under
    eval_only) and the validation windows (None without validation)."""
    train_data = None if cfg.eval_only else build_train_data(cfg, log)
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
    num_samples = None if cfg.max_steps is None else cfg.max_steps * cfg.global_batch_size
    train_data = train_samples(cfg.data_paths, seq_length=cfg.seq_length, split=cfg.split,
                               seed=cfg.seed, num_samples=num_samples,
                               cache_dir=cfg.index_mapping_dir,
                               fallback_cache_dir=os.path.join(cfg.out_dir, "index_cache"))
    if num_samples is None:
        cfg.max_steps = len(train_data) // cfg.global_batch_size
        if cfg.max_steps < 1:
            raise ValueError(f"{cfg.data_paths}: the train split has {len(train_data):,} samples, "
                             f"fewer than one global batch of {cfg.global_batch_size}")
        log(f"max_steps None: one epoch of the train split is {cfg.max_steps:,} steps")
    return train_data


class Evaluator:
    """Validation loss, HellaSwag and a sample, before step s's update (under eval_only, HellaSwag
    and the sample at step 0 too)."""

    def __init__(self, cfg, val_data, vocab_size, device, log):
        self.cfg, self.val_data, self.vocab_size = cfg, val_data, vocab_size
        self.device, self.log = device, log
        self.autocast, self.autocast_dtype, _ = precision(cfg, device)  # as the step's
        self.sample_tokens = cfg.sample_tokens
        if cfg.sample_tokens and vocab_size != VOCAB_SIZE:
            log(f"sample_tokens ignored: the vocabulary ({vocab_size} tokens) is not GPT-2's")
            self.sample_tokens = 0
        self.hellaswag = None
        if cfg.hellaswag is not None:
            if vocab_size != VOCAB_SIZE:
                raise ValueError("config: hellaswag needs the GPT-2 vocabulary; the model has "
                                 f"{vocab_size} tokens")
            path = None if cfg.hellaswag == "download" else cfg.hellaswag
            # Read, parsed and tokenized once by rank 0 and sent to every rank: other nodes need
            # neither the file nor the internet, and a bad file fails every rank alike.
            self.hellaswag = on_rank0(lambda: hellaswag.render_all(hellaswag.load_examples(path)))

    def __call__(self, model, step, stop):
        """Evaluate the model before step's update; whether a stop came meanwhile (the caller
        then checkpoints and ends). The model is in eval mode, so that a term for training alone
        stays out of it, and runs as written, uncompiled: compiled, evaluation's shapes and
        no_grad would each compile graphs beside training's, seconds to minutes each, until
        dynamo's recompile_limit (8 per function) gives up on them."""
        model.eval()
        try:
            with torch.compiler.set_stance("force_eager"):  # no compiling, not even a guard check
                return self.evaluate(model, step, stop)
        finally:
            model.train()

    def evaluate(self, model, step, stop):
        """Whether a stop came during the evaluation."""
        head = f"step {step:5d}/{self.cfg.max_steps} |"

        def stopped():
            return any_rank(stop.requested())

        if self.val_data is not None and self.validate(model, step, head, stop):
            return True
        if self.hellaswag is not None and (step > 0 or self.cfg.eval_only):
            rank, world_size = rank_and_world_size()
            # As many examples per forward as a training micro-batch has tokens.
            result = hellaswag.evaluate(
                model, self.hellaswag, device=self.device, rank=rank, world_size=world_size,
                autocast_dtype=self.autocast_dtype, limit=self.cfg.hellaswag_limit,
                batch_tokens=self.cfg.local_batch_size * self.cfg.seq_length, stopped=stopped)
            if result is None:  # a stop came
                return True
            self.log(f"{head} hellaswag acc_norm {result['acc_norm']:.4f} "
                     f"({result['correct_norm']}/{result['total']})",
                     f"s:{step} eval:{result['acc_norm']:.4f}", step=step,
                     hellaswag_acc_norm=result["acc_norm"], hellaswag_acc=result["acc"])
        if self.sample_tokens and step > 0:
            with self.autocast:
                text = sample_texts(model, "", max_new_tokens=self.sample_tokens,
                                    seed=self.cfg.seed + step, device=self.device)[0]
            self.log(f"{head} sample: {text!r}", step=step, sample=text)
        return False

    def validate(self, model, step, head, stop):
        """Log the mean loss over the validation windows; whether a stop came during it, or a
        data error (a file cut short), which every rank then stops on and checkpoints, as in
        training."""
        rank, world_size = rank_and_world_size()
        batch_size = self.cfg.local_batch_size
        # Rank r scores windows r, r + W, ...; every rank runs as many forwards, since a sharded
        # forward is a collective.
        t0, mine = time.perf_counter(), list(range(rank, len(self.val_data), world_size))
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        for b in range(math.ceil(len(self.val_data) / (world_size * batch_size))):
            indices = mine[b * batch_size:(b + 1) * batch_size]
            try:
                batch = host_batch(self.val_data, indices or [0], self.vocab_size,
                                   self.device.type == "cuda")
            except ValueError as e:
                stop.error = e
            if any_rank(stop.requested()):  # between batches: a stop never waits behind validation
                return True
            tokens, labels = (t.to(self.device, non_blocking=True) for t in batch)
            with torch.no_grad(), self.autocast:
                _, loss = model(tokens, labels)
            if indices:  # the mean over scored tokens (labels of -100 are not scored)
                scored = (labels != -100).sum()
                totals[0] += loss.double() * scored
                totals[1] += scored
        if dist.is_initialized():
            dist.all_reduce(totals)
        val_loss = (totals[0] / totals[1]).item()
        if not math.isfinite(val_loss):
            raise FloatingPointError(f"step {step}: val loss {val_loss} is not finite; stopped, "
                                     "state not saved")
        self.log(f"{head} val loss {val_loss:.6f} | {time.perf_counter() - t0:.1f} s",
                 f"s:{step} tel:{val_loss:.4f}", step=step, val_loss=val_loss)
        return False


# -------------------------------------------------------------------------------------------------
# the training loop

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

    def start_step(self):
        peak_memory(self.device, reset=True)
        self.start = clock(self.device)

    def end_step(self, step, lr, loss, norm, stop):
        """Queue the step's numbers for the host; whether any rank asked to stop. A GPU reads the
        flag of the step before, which is done by now, so that the host does not wait."""
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # a sharded model's norm is a DTensor
        # One all-reduce sums the ranks' loss shares, their (equal) norms and their stop flags, so
        # that every rank stops at the same step; the copy to pinned host memory is queued behind
        # the step's work, and nothing here waits for it.
        self.stop_flag.fill_(float(stop.requested()))
        stats = torch.stack([loss, norm.float(), self.stop_flag])
        if dist.is_initialized():
            dist.all_reduce(stats)
        host = torch.empty(3, pin_memory=self.cuda)
        host.copy_(stats, non_blocking=True)
        end = clock(self.device)
        peak_gib, self.memory_label = peak_memory(self.device)
        self.run_peak_gib = max(self.run_peak_gib, peak_gib)
        self.pending.append((step, lr, host, self.start, end, peak_gib))
        self.recent = (self.recent + [(end, host)])[-2:]
        if self.world_size == 1:
            return stop.requested()
        if not self.cuda:
            return host[2].item() > 0
        # On a GPU, the flag of the step before: its copy is done by now, so reading it costs no
        # wait, and a stop lands one step later on every rank alike.
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
        # The ranks' shares of the loss add up to the step's mean; each rank has the whole norm.
        train_loss, norm = host[0].item(), (host[1] / self.world_size).item()
        if not (math.isfinite(train_loss) and math.isfinite(norm)):
            raise FloatingPointError(
                f"step {step}: train loss {train_loss} / grad norm {norm} is not finite; stopped "
                f"without saving this state. {last_good_checkpoint(self.cfg.out_dir)}")
        dt = start.elapsed_time(end) / 1000 if self.cuda else end - start
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
    extra_state: dict  # build_extra_state's: saved and loaded with the optimizer
    start_step: int
    batches: object  # prefetch()'s queue of each step's micro-batches
    evaluate: Evaluator
    step_log: StepLog
    recorded: dict  # what each checkpoint records for a resume to compare: data, function
    exportable: bool  # whether hf/ is written at the end (check_function)
    grad_accum_steps: int  # micro-batches per step on each rank


def setup(cfg, world_size, device, log, stop):
    """out_dir, data, model, optimizer, resume and evaluation, in that order: a Training, or an
    exit status when nothing is left to train (eval_only, or a run already complete)."""
    # Rank 0 checks and locks out_dir and picks the checkpoint to resume from, if any.
    resume_path = on_rank0(lambda: prepare_out_dir(cfg.out_dir, cfg.eval_only))
    if nothing_left(cfg, resume_path, log):
        return 0
    # The data first: a wrong path or a short split fails in seconds, before any model is built.
    train_data, val_data = build_data(cfg, log)
    if not cfg.eval_only and cfg.lr_warmup_steps > cfg.max_steps:  # a short try, as in nanoGPT
        log(f"lr_warmup_steps {cfg.lr_warmup_steps} is more than max_steps {cfg.max_steps}: the "
            f"warmup does not finish, and lr peaks at {lr_at(cfg.max_steps - 1, cfg):.2e}")
    start = f"init from {cfg.init_from or 'GPT-2 init'}"
    if resume_path:
        start = f"resuming from {resume_path}"
    if dist.is_initialized():
        start = f"FSDP2 over a {device.type} mesh of {world_size} ranks; {start}"
    # At least 1: an eval_only run need not divide its batch (check_config).
    grad_accum_steps = max(1, cfg.global_batch_size // (cfg.local_batch_size * world_size))
    log(f"world size {world_size}, device {device}, dtype {cfg.dtype}, grad accumulation "
        f"{grad_accum_steps}; {start}")
    # The model: its architecture and where its first weights come from, said before step 1 with
    # whether its hf/ export will compute what it does.
    model_config, init = starting_point(cfg, resume_path)  # resume, init_from or the config
    # The weights' architecture wins (init_from or a checkpoint): train_config.json says so.
    configured = model_config_of(cfg)
    for key, value in dataclasses.asdict(model_config).items():
        if value != getattr(configured, key):
            log(f"{key} {value} from {init[1]} (the config's {getattr(cfg, key)} does not apply)")
            setattr(cfg, key, value)
    if cfg.seq_length > model_config.block_size:
        raise ValueError(f"config: seq_length {cfg.seq_length} is longer than the model's "
                         f"context ({model_config.block_size} positions)")
    # One check of what model.py computes, over the model's whole context: whether hf/ will be
    # written (an edited model may compute what no GPT-2 does), and the fingerprint that every
    # checkpoint records, so that a resume notices an edit that keeps every tensor's shape.
    export = cfg.hf_export != "off" and not cfg.eval_only
    exportable, line, function = on_rank0(lambda: check_function(model_config, export))
    if export:
        log(line)
        if not exportable and cfg.hf_export == "require":
            raise ValueError(f"config: hf_export='require', and {line}")
    model = build_model(model_config, init, cfg, device)
    optimizer = build_optimizer(model, cfg, device)
    extra_state = build_extra_state(model, cfg)
    # What each checkpoint records besides the state, for a resume to compare: the data and the
    # function that model.py computes.
    recorded, step = dict(function=function), 0
    if train_data is not None:
        recorded.update(data_state(train_data))
    # A resume loads the model, the optimizer, the extra state and the random generators, after
    # checking that neither the data nor the model changed under the run.
    if resume_path is not None:
        step, changed = resume(resume_path, model, optimizer, extra_state, cfg, recorded, log,
                               train_data)
        if changed:
            log(f"{'; '.join(changed)}: the config wins from step {step} on; "
                f"lr at step {step} is {lr_at(step, cfg):.3e}")
    on_rank0(lambda: log.start(cfg, resumed=resume_path is not None))
    evaluate = Evaluator(cfg, val_data, model_config.vocab_size, device, log)
    step_log = StepLog(cfg, log, device, model)
    if not cfg.eval_only:
        # Megatron's sampler: rank r takes its local batches from the consumed-sample count on, so
        # a resume on any number of ranks reads the samples the uninterrupted run would have read.
        rank, world_size = rank_and_world_size()
        sampler = iter(PretrainingSampler(cfg.max_steps * cfg.global_batch_size,
                                          step * cfg.global_batch_size,
                                          cfg.local_batch_size, rank, world_size))
        batches = prefetch(train_data, sampler, grad_accum_steps, model_config.vocab_size,
                           device.type == "cuda", stop)
        return Training(model, optimizer, extra_state, step, batches, evaluate, step_log,
                        recorded, exportable, grad_accum_steps)
    log(f"eval_only: the results are appended to {log.out_dir}/main.log and metrics.jsonl (the "
        "config to eval_config.json); the run's own logs are left as they are")
    if not evaluate(model, step, stop):  # no stop came
        return 0
    return 128 + (stop.signal or signal.SIGTERM)


def token_shares(step_batches, device):
    """Each micro-batch's share of the step's scored tokens (labels of -100 are not scored) on all
    ranks, on the device: counted on the host, copied once, summed over the ranks by one
    all-reduce, so that nothing waits for the device."""
    scored = torch.stack([(labels != -100).sum() for _, labels in step_batches])
    scored = scored.to(device, non_blocking=True)
    total = scored.sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    return scored / total.clamp(min=1)  # a step with no scored token has loss 0, not nan


def precision(cfg, device):
    """The numerics of the training step and of evaluation, decided here for both: (autocast,
    entered around every forward; its dtype, None when off; FSDP2's MixedPrecisionPolicy). In
    bf16 one process (python) runs autocast over fp32 weights, so that the residual stream stays
    fp32. Under torchrun FSDP2 casts the gathered weights to bf16 instead, which halves the
    all-gathers' bytes: the blocks compute in bf16 throughout and reduce the gradients in fp32.
    docs/training.md#precision compares the two."""
    bf16 = cfg.dtype == "bfloat16"
    sharded = dist.is_initialized()
    autocast_dtype = torch.bfloat16 if bf16 and not sharded else None
    mp_policy = MixedPrecisionPolicy()  # FSDP2 computes in the parameters' own dtype
    if bf16 and sharded:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=bf16 and not sharded)
    return autocast, autocast_dtype, mp_policy


def train(cfg, world_size, device, log, stop, checkpoints):
    """Set up, then train from the start step to max_steps; the exit status."""
    training = setup(cfg, world_size, device, log, stop)
    if not isinstance(training, Training):
        return training  # an exit status: nothing left to train
    model, optimizer, extra_state, start_step, batches, evaluate, step_log, recorded, \
        exportable, grad_accum_steps = training
    autocast, _, _ = precision(cfg, device)

    def save(done, stopping=False):
        """Checkpoint after `done` steps; on a stop, the exit status 128 + signum (143 for
        SIGTERM, also on ranks that only heard of it from another), or the data error raised."""
        checkpoints.save(model, optimizer, done, recorded, extra_state, wait=stopping)
        if stop.error is not None:
            raise stop.error
        if stopping:
            return stop.stopped(done, log)

    if any_rank(stop.requested()):  # a signal during setup: nothing to train before the checkpoint
        return save(start_step, stopping=True)
    for step in range(start_step, cfg.max_steps + 1):
        # Evaluate before the update of step s, so that step 0 is the initial model and the last
        # evaluation is of the final one, as in llm.c's logs.
        last_step = step == cfg.max_steps
        if step % cfg.val_every_steps == 0 or last_step:
            step_log.flush(keep_last=False)
            stopped = evaluate(model, step, stop)
            if stopped:  # a SIGTERM or SIGINT came during the evaluation
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
        # Gradient accumulation: backward() adds each micro-batch's gradient into .grad, weighed by
        # its share of the step's scored tokens on all ranks (x world_size: FSDP2 averages ranks).
        shares = token_shares(step_batches, device)
        loss = torch.zeros((), device=device)  # this rank's share of the step's mean loss
        for micro_step, (tokens, labels) in enumerate(step_batches):
            # From pinned host memory on a GPU: the copy runs beside the work already queued.
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            if dist.is_initialized():
                # FSDP2 reduce-scatters the gradients to their shards in the backward of the last
                # micro-batch only; the ones before accumulate the whole gradients locally.
                model.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
            with autocast:  # bf16 matmuls in one process; a no-op otherwise (precision() says why)
                _, micro_loss = model(tokens, labels)
            share = micro_loss * shares[micro_step]
            (share * world_size).backward()
            loss += share.detach()
        norm, lr = update(model, optimizer, step, cfg)
        # Loss, norm and stop flag go to the host without waiting, to be logged a step later: the
        # device always has the next step queued. All ranks agree on the stop (SIGTERM, SIGINT).
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
    # The last checkpoint is on disk before hf/ is written from the same weights.
    checkpoints.wait()
    if exportable:
        publish_hf(model, cfg)
    elif cfg.hf_export != "off":
        log("hf/ was not written: the model is not GPT-2's (the check before step 1 said why); "
            "its checkpoints are in ckpt/, which sample.py and hellaswag.py read")
    return 0


def main(argv=None):
    """Train; the exit status: 0 finished, 128 + signum stopped by SIGTERM/SIGINT after its
    checkpoint."""
    return run(load_config(sys.argv[1:] if argv is None else argv))


def run(cfg, restore_signals=True):
    """Train; with `restore_signals` False (the command line), SIGTERM and SIGINT stay absorbed
    until the process exits, so that a signal during the report of an error cannot cut it short."""
    with deterministic_kernels(cfg.deterministic):  # from before CUDA starts, when asked for
        _, world_size, device = setup_distributed(cfg.device, cfg.dist_timeout_s)
        log = RunLog(os.path.join(cfg.out_dir, "eval") if cfg.eval_only else cfg.out_dir)
        stop = StopRequest()
        checkpoints = Checkpoints(cfg, log)
        try:
            try:
                return train(cfg, world_size, device, log, stop, checkpoints)
            finally:  # a stop, the end of the run or an error: the write in flight finishes first
                checkpoints.wait()
        finally:
            stop.ended = True
            if restore_signals:
                stop.restore()
            log.close()
            unlock_out_dirs()
            end_distributed()


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
    exit_with(lambda: run(cfg, restore_signals=False), "train_gpt2.py")


if __name__ == "__main__":
    cli()
