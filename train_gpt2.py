"""Pretrain GPT-2 on Megatron-format token datasets (FineWeb-Edu), on one CPU process or many GPUs and nodes.

    python train_gpt2.py configs/demo_cpu.py                                    # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py  # 8 GPUs, FSDP2 (--nnodes for more)
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --compile=False   # --key=value overrides the config

out_dir gets train_config.json, main.log (llm.c's format), metrics.jsonl, ckpt/step_NNNNNNNN/ (torch.distributed.
checkpoint) and, at the end, hf/ (Hugging Face GPT-2). Rerun the command to resume, on any number of ranks.
"""
import sys

if sys.version_info < (3, 10):  # before any import: TrainConfig's `str | None` fields are a TypeError on 3.9
    sys.exit("train_gpt2.py: error: Python 3.10 or newer is needed, this is Python %d.%d" % sys.version_info[:2])

import ast
import dataclasses
import difflib
import errno
import gc
import hashlib
import importlib.util
import inspect
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
import traceback
import typing
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

import hellaswag
from atomic_io import LockHeld, atomic_save, atomic_write, error_reason, fsync_dir, lock_file
from indexed_dataset import (LLMCValWindows, PretrainingSampler, build_gpt_datasets, first_samples_agree,
                             one_epoch_samples, resolve_blend, sequential_samples, token_weighted_blend)
from model import (GPT, LOSS_CHUNK_ROWS, MARKER, GPTConfig, complete_checkpoints, export_hf, init_sharded,
                   is_run_or_checkpoint, load_hf_sharded, load_weights, newest_usable_checkpoint, read_train_state,
                   resolve_checkpoint, resolve_pretrained, set_aside)
from sample import sample_texts
from tokenizer import EOT_ID, VOCAB_SIZE, write_hf_tokenizer


@dataclasses.dataclass
class TrainConfig:
    # data: token datasets written by prepare_fineweb.py (or Megatron's preprocess_data.py)
    data_paths: str | list = "fineweb_edu/megatron_gpt2/processed_data_*_text_document"  # prefix, glob, or blend list
    index_mapping_dir: str | None = None  # dataset index cache; None: beside each prefix, as Megatron does
    split: str = "969,30,1"  # train, validation, test shares of each prefix's documents
    # validation tokens: None = the first val_tokens of the Megatron validation split of data_paths; a prefix (e.g.
    # prepare_fineweb.py's val_text_document) = llm.c's val protocol: windows over [EOT] + its documents in order
    val_data_paths: str | list | None = None
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
    eval_only: bool = False  # evaluate the initial model (init_from, or the out_dir's checkpoint) once and exit
    # outputs
    out_dir: str = "out"
    log_every_steps: int = 1  # loss/norm/timing are read from the device once per this many steps, then all logged
    ckpt_every_steps: int = 1000  # 0 = only at the end and on SIGTERM/SIGINT
    ckpt_keep: int = 2  # complete checkpoints kept, newest first
    # a resume refuses a change of data_paths, the data itself, split, seed, seq_length or the train split's epochs
    resume_allow_data_change: bool = False  # True: resume anyway (the sample order then changes from here on)
    wandb_log: bool = False  # also log every metrics.jsonl record and the config to Weights & Biases (an extra)
    wandb_project: str = "gpt2"
    wandb_run_name: str | None = None  # None: the out_dir's name; a resumed run continues the same wandb run
    # system
    seed: int = 1234  # model init and data order
    device: str = "auto"  # auto (cuda when available), cuda, cpu
    dtype: str = "bfloat16"  # bfloat16: FSDP bf16 params with fp32 gradient reduction, or autocast on one device
    compile: bool = True  # torch.compile each transformer block
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1/3 slower
    dist_timeout_s: int = 900  # a collective that waits longer than this fails instead of hanging


# torch 2.9's checkpoint writer calls tensor.storage() itself: its deprecation warning is torch's, not the user's
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)

# the oldest torch the whole test suite passes on (bench/compat.sh). Before it: torch 2.6 cannot run FSDP2 on a CPU
# (its CPU streams lack record_event); on 2.7 and 2.8 FSDP2 over gloo sums the ranks' gradients where it should
# average them (a 2-rank CPU run's grad norm is twice a 1-process run's, and its clipping and updates differ)
MIN_TORCH = "2.9.1"


def torch_version_problem(version=torch.__version__):
    """None, or the one line saying that this `version` of torch is older than MIN_TORCH."""
    if torch.torch_version.TorchVersion(version) < MIN_TORCH:
        return (f"torch {version} is older than {MIN_TORCH}, the oldest this code is tested on; "
                f"pip install 'torch>={MIN_TORCH}' (or a CUDA build of it for GPUs)")
    return None


# dense bf16 tensor-core peak of one GPU in TFLOP/s, for MFU; the first name found in the device name wins, so a more
# specific name comes before the name it contains ("H200 NVL" before "H200")
PEAK_BF16_TFLOPS = [("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200 NVL", 835), ("H200", 989),
                    ("A100", 312), ("B200", 2250)]


# -----------------------------------------------------------------------------
# config

def parse_config(config_class, argv):
    """`config_class` from config files and --key=value overrides, in order, as nanoGPT's configurator.py."""
    fields, values = {f.name: f for f in dataclasses.fields(config_class)}, {}

    def checked(key, value, where, text=None):
        if key not in fields:
            if key in NANOGPT_KEYS:  # a nanoGPT habit: where its meaning lives here, never a silent alias
                raise ValueError(f"{where}: '{key}' is nanoGPT's name; here {NANOGPT_KEYS[key]}")
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            if key.startswith("wandb_"):
                hint = "; wandb's keys are " + ", ".join(name for name in fields if name.startswith("wandb_"))
            raise ValueError(f"{where}: unknown config key '{key}'{hint}")
        try:
            return field_value(fields[key], value, text)
        except TypeError as e:
            raise ValueError(f"{where}: {key} {e}") from None

    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ValueError(f"{arg}: write overrides as --key=value (--help lists the keys)")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            values[key] = checked(key, value, f"command line {arg}", text)
        elif not os.path.isfile(arg):
            raise FileNotFoundError(f"{arg}: config file not found")
        else:
            read = automodel_yaml if arg.endswith((".yaml", ".yml")) else exec_config
            for key, value in read(arg).items():
                values[key] = checked(key, value, arg)
    return config_class(**values)


def field_value(field, value, text=None):
    """`value` as the dataclass `field` takes it (an int is a fine float; `text`, the value as written, where a str is
    allowed); TypeError naming the types expected otherwise."""
    allowed = typing.get_args(field.type) or (field.type,)
    if float in allowed and type(value) is int:
        value = float(value)
    if any(type(value) is t or (t not in (int, bool) and isinstance(value, t)) for t in allowed):
        return value
    if text is not None and str in allowed:
        return text  # --split=969,30,1 means the string, not a tuple
    names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
    raise TypeError(f"must be {names}, got {value!r} ({type(value).__name__})")


# nanoGPT's train.py keys that are not ours: where each one's meaning lives here
NANOGPT_KEYS = {
    "learning_rate": "it is --lr (the peak learning rate; cosine decay to --min_lr)",
    "block_size": "it is --seq_length (tokens per training sequence; a new model gets seq_length positions)",
    "max_iters": "it is --max_steps (optimizer steps of global_batch_size sequences)",
    "lr_decay_iters": "the cosine decay always ends at --max_steps (nanoGPT's recipes set lr_decay_iters = max_iters)",
    "warmup_iters": "it is --lr_warmup_steps",
    "decay_lr": "the lr always follows warmup and cosine decay; --min_lr=<lr> holds it constant after warmup",
    "eval_interval": "it is --val_every_steps (validation at step 0, every val_every_steps and after the last step)",
    "eval_iters": "validation is counted in tokens: --val_tokens = eval_iters x batch_size x block_size "
                  "(the first val_tokens of the validation split, in order; 0 = off)",
    "log_interval": "every step is logged; --log_every_steps sets how often its numbers are read from the device",
    "batch_size": "it is --local_batch_size (sequences per forward on one rank); --global_batch_size is the "
                  "sequences per optimizer step",
    "gradient_accumulation_steps": "it follows from the batch sizes: global_batch_size / (local_batch_size x world "
                                   "size); set --global_batch_size = gradient_accumulation_steps x batch_size (nanoGPT "
                                   "also divides the accumulation by the world size)",
    "dropout": "the model has no dropout (as GPT-2 pretraining in llm.c and nanoGPT's 0.0); remove the key",
    "bias": "the model always has GPT-2's biases",
    "dataset": "it is --data_paths (token datasets written by prepare_fineweb.py: a prefix, glob or blend list)",
    "always_save_checkpoint": "a checkpoint is written every --ckpt_every_steps and at the end, whatever the val loss",
    "backend": "the backend follows the device: nccl on GPUs, gloo on CPU",
}
# init_from values of nanoGPT's that are not a model here
NANOGPT_INIT_FROM = {
    "resume": "rerunning the same command (the same out_dir) resumes from its newest checkpoint; drop init_from",
    "scratch": "a fresh GPT-2 init is the default, init_from=None; drop init_from",
}


def exec_config(path):
    """The top-level assignments of a Python config file; its errors as ValueError naming file:line."""
    namespace = {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        exec(compile(text, path, "exec"), namespace)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except SystemExit as e:  # a config must not end the run, least of all with exit status 0
        raise ValueError(f"{path}: the config file called sys.exit({e.code!r}); a config only assigns values") from None
    except Exception as e:
        line = next((frame.lineno for frame in reversed(traceback.extract_tb(e.__traceback__))
                     if frame.filename == path), "?")
        raise ValueError(f"{path}:{line}: {type(e).__name__}: {e}") from None
    return {k: v for k, v in namespace.items() if not k.startswith("_") and not inspect.ismodule(v)}


# NeMo AutoModel's examples/llm_pretrain/megatron_pretrain_gpt2.yaml, the recipe this project answers: its keys and ours
AUTOMODEL_KEYS = {
    "step_scheduler.global_batch_size": "global_batch_size", "step_scheduler.local_batch_size": "local_batch_size",
    "step_scheduler.ckpt_every_steps": "ckpt_every_steps", "step_scheduler.val_every_steps": "val_every_steps",
    "step_scheduler.max_steps": "max_steps", "rng.seed": "seed", "seed": "seed", "dataset.paths": "data_paths",
    "dataset.index_mapping_dir": "index_mapping_dir", "dataset.seq_length": "seq_length", "dataset.split": "split",
    "optimizer.lr": "lr", "optimizer.weight_decay": "weight_decay", "optimizer.eps": "adam_eps",
    "lr_scheduler.lr_warmup_steps": "lr_warmup_steps", "lr_scheduler.min_lr": "min_lr",
    "checkpoint.checkpoint_dir": "out_dir", "wandb.project": "wandb_project", "wandb.name": "wandb_run_name",
    # transformers.AutoConfig.from_pretrained(name, **these) sizes the model
    "model.config.n_layer": "n_layer", "model.config.n_head": "n_head", "model.config.n_embd": "n_embd",
    "model.config.vocab_size": "vocab_size"}
# keys that change nothing here whatever their value (where files go, logging, the tokenizer of the same token files,
# the checkpoint format); "x." names a section
AUTOMODEL_SAME = ("dataset.tokenizer.", "validation_dataset.tokenizer.", "dataloader.collate_fn",
                  "validation_dataloader.collate_fn", "dataset.splits_to_build", "validation_dataset.splits_to_build",
                  "step_scheduler.num_epochs", "rng.ranked", "dist_env.backend", "checkpoint.enabled",
                  "checkpoint.model_save_format", "checkpoint.save_consolidated", "model.is_meta_device",
                  "distributed.dp_size", "distributed.dp_replicate_size", "wandb.entity", "wandb.save_dir", "wandb.dir",
                  "validation_dataset.paths", "validation_dataset.index_mapping_dir", "validation_dataset.split",
                  "validation_dataset.seq_length", "model.config.use_cache", "model.config.bos_token_id",
                  "model.config.eos_token_id", "optimizer.foreach", "optimizer.fused", "optimizer.capturable",
                  "optimizer.set_grad_none")
# keys that behave as ours at these values only (a class name also matches the end of a dotted _target_)
AUTOMODEL_VALUES = {
    "recipe": ["TrainFinetuneRecipeForNextTokenPrediction"],
    "recipe._target_": ["TrainFinetuneRecipeForNextTokenPrediction"],
    "model._target_": ["NeMoAutoModelForCausalLM.from_config"], "model.config._target_": ["AutoConfig.from_pretrained"],
    "model.torch_dtype": ["auto", "float32", "torch.float32", "bfloat16", "torch.bfloat16"],  # see master weights
    "loss_fn._target_": ["MaskedCrossEntropy"], "rng._target_": ["StatefulRNG"],
    "dataset._target_": ["MegatronPretraining"], "validation_dataset._target_": ["MegatronPretraining"],
    "dataloader._target_": ["StatefulDataLoader"], "validation_dataloader._target_": ["StatefulDataLoader"],
    "dataloader.dataloader_type": ["single"], "validation_dataloader.dataloader_type": ["single"],  # "cyclic" shuffles
    "distributed._target_": ["FSDP2Manager"], "distributed.strategy": ["fsdp2"], "distributed.tp_size": [1, None],
    "distributed.cp_size": [1, None], "distributed.pp_size": [1, None], "distributed.sequence_parallel": [False, None],
    "lr_scheduler.lr_decay_style": ["cosine"],
    "optimizer._target_": ["AdamW", "FusedAdam"], "optimizer.amsgrad": [False], "optimizer.maximize": [False],
    # Transformer Engine's FusedAdam as our AdamW: decoupled weight decay, bias correction, fp32 master weights and
    # moments (store_param_remainders keeps the master's low 16 bits beside the bf16 parameter: the same fp32 numbers)
    "optimizer.adam_w_mode": [True], "optimizer.bias_correction": [True], "optimizer.master_weights": [True],
    "optimizer.store_param_remainders": [True, False], "optimizer.master_weight_dtype": ["torch.float32", "float32"],
    "optimizer.exp_avg_dtype": ["torch.float32", "float32"], "optimizer.exp_avg_sq_dtype": ["torch.float32", "float32"],
    # GPT2Config values the model here has (no dropout: nanoGPT's and llm.c's pretraining use none either)
    "model.config.activation_function": ["gelu_new", "gelu_pytorch_tanh"], "model.config.n_inner": [None],
    "model.config.layer_norm_epsilon": [1e-5], "model.config.initializer_range": [0.02],
    "model.config.tie_word_embeddings": [True], "model.config.scale_attn_weights": [True],
    "model.config.resid_pdrop": [0, 0.0], "model.config.embd_pdrop": [0, 0.0], "model.config.attn_pdrop": [0, 0.0]}
# the optimizer's own defaults, where the recipe leaves a value out: (lr, betas, eps, weight_decay)
AUTOMODEL_OPTIMIZER_DEFAULTS = {"AdamW": (1e-3, [0.9, 0.999], 1e-8, 1e-2), "FusedAdam": (1e-3, [0.9, 0.999], 1e-8, 0.0)}
# GPT-2 sizes by hub name: (n_layer, n_head, n_embd)
GPT2_SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
              "gpt2-xl": (48, 25, 1600)}


def yaml_value(value):
    """A YAML leaf as AutoModel's config loader reads it: strings such as "6e-4", "none" or "true" become values."""
    if not isinstance(value, str):
        return value
    if value in ("none", "None", "true", "True", "false", "False"):
        return {"none": None, "None": None, "true": True, "True": True}.get(value, False)
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def automodel_yaml(path):
    """Our config keys from the seed recipe's YAML; one error names every key that would change the run."""
    import yaml  # installed with huggingface_hub

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    try:
        with open(path, encoding="utf-8") as f:
            written = dict(flat(yaml.safe_load(f)))
    except (yaml.YAMLError, AttributeError) as e:
        raise ValueError(f"{path}: not a YAML mapping of the recipe's sections: {str(e).splitlines()[0]}") from None
    items = {key: yaml_value(value) for key, value in written.items()}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}

    def typed(key, kinds, expected):  # the recipe's value of `key`, if it is one of the types `kinds`
        if type(items[key]) not in kinds:
            raise ValueError(f"{path}: {key} must be {expected}, got {written[key]!r} ({type(written[key]).__name__})")
        return items[key]

    def behaves_as_ours(key):
        value = items[key]
        return any(value == v and type(value) is type(v) or isinstance(value, str) and isinstance(v, str) and
                   value.endswith("." + v) for v in AUTOMODEL_VALUES[key])

    number, count = (int, float), (int,)
    seq_length = items.get("dataset.seq_length", fields["seq_length"].default)
    optimizer = str(items.get("optimizer._target_", "")).rsplit(".", 1)[-1]
    lr, betas, eps, weight_decay = AUTOMODEL_OPTIMIZER_DEFAULTS.get(optimizer, (None,) * 4)
    ours = {} if lr is None else dict(lr=lr, beta1=betas[0], beta2=betas[1], adam_eps=eps, weight_decay=weight_decay)
    same, differ = [], []
    name = items.get("model.config.pretrained_model_name_or_path")  # its sizes first: model.config's own keys win
    if name is not None and os.path.basename(str(name)) in GPT2_SIZES:
        ours["n_layer"], ours["n_head"], ours["n_embd"] = GPT2_SIZES[os.path.basename(str(name))]
        ours["vocab_size"] = 50257
    for key, value in items.items():
        if key in AUTOMODEL_KEYS:
            try:
                ours[AUTOMODEL_KEYS[key]] = field_value(fields[AUTOMODEL_KEYS[key]], value, written[key])
            except TypeError as e:
                raise ValueError(f"{path}: {key} {e}") from None
        elif key == "optimizer.betas":
            if type(value) not in (list, tuple) or len(value) != 2 or any(type(b) not in number for b in value):
                raise ValueError(f"{path}: {key} must be a list of two numbers [beta1, beta2], got {written[key]!r}")
            ours["beta1"], ours["beta2"] = map(float, value)
        elif key == "dist_env.timeout_minutes":
            ours["dist_timeout_s"] = max(1, round(typed(key, number, "a number of minutes") * 60))
        elif key == "validation_dataset.num_val_samples":
            ours["val_tokens"] = typed(key, count, "an int (validation sequences)") * seq_length
        elif key == "model.config.pretrained_model_name_or_path":
            if "n_layer" in ours:
                same.append(f"{key}={value!r}")
            else:
                differ.append(f"{key}={value!r} (GPT-2 sizes known here: {', '.join(GPT2_SIZES)})")
        elif key in ("model.config.n_positions", "model.config.n_ctx"):
            if typed(key, count, "an int") == seq_length:  # a new model here has seq_length positions
                same.append(f"{key}={value!r}")
            else:
                differ.append(f"{key}={value!r} (the model's context here is dataset.seq_length, {seq_length})")
        elif key in AUTOMODEL_VALUES:
            (same if behaves_as_ours(key) else differ).append(f"{key}={value!r}")
        elif any(key == p or p.endswith(".") and key.startswith(p) for p in AUTOMODEL_SAME):
            same.append(key)
        else:
            differ.append(f"{key}={value!r}")
    for key in ("paths", "split", "seq_length"):
        theirs = items.get(f"validation_dataset.{key}", items.get(f"dataset.{key}"))
        if theirs != items.get(f"dataset.{key}"):
            differ.append(f"validation_dataset.{key}={theirs!r} (validation is a split of dataset.paths here)")
    if str(items.get("model.torch_dtype")) in ("bfloat16", "torch.bfloat16") and not (
            optimizer == "FusedAdam" and items.get("optimizer.master_weights") is True):
        differ.append("model.torch_dtype=bfloat16 without FusedAdam's master_weights (bf16 updates; fp32 here)")
    if differ:
        raise ValueError(f"{path}: not supported by train_gpt2.py: {', '.join(differ)}")
    if "model.config.vocab_size" in items:  # rows of wte/lm_head: a multiple of 64, as GPT-2's 50304
        ours["padded_vocab_size"] = -(-ours["vocab_size"] // 64) * 64
    if "wandb.project" in items or "wandb.name" in items:
        ours["wandb_log"] = True
    if ours.get("max_steps") == -1:
        ours["max_steps"] = None
    dropout = [key for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop") if f"model.config.{key}" not in items]
    if int(os.environ.get("RANK", 0)) == 0:  # before the process group exists
        print(f"{path}: AutoModel recipe read as " + " ".join(f"--{k}={v!r}" for k, v in ours.items())
              + f"; behaves the same here: {', '.join(same)}"
              + (f"; not applied: {name}'s dropout 0.1 (the model here has none)" if name and dropout else ""))
    return ours


def config_help():
    """Every TrainConfig key with its type, default and comment, grouped as in the dataclass (its source is the doc)."""
    lines = ["usage: [torchrun ...] train_gpt2.py [CONFIG.py | RECIPE.yaml] ... [--key=value ...]",
             "Config files (Python assignments, or NeMo AutoModel's YAML recipe) and overrides apply in order.",
             "Keys, as --key: type = default  # what it does:"]
    for line in inspect.getsource(TrainConfig).splitlines()[2:]:
        code, _, comment = (part.strip() for part in line.partition("#"))
        if not code:  # a comment line opens a group
            lines.append(("\n" if lines[-1].startswith("  --") else "") + f"# {comment}")
        else:
            lines.append(f"  --{code}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines)


def load_config(argv):
    """TrainConfig from argv, with the ranges that neither GPTConfig nor AdamW check."""
    cfg = parse_config(TrainConfig, argv)
    at_least = dict(seq_length=1, global_batch_size=1, local_batch_size=1, max_steps=1, lr_warmup_steps=0,
                    val_every_steps=1, val_tokens=0, sample_tokens=0, ckpt_every_steps=0, ckpt_keep=1,
                    log_every_steps=1, dist_timeout_s=1, hellaswag_limit=1, grad_clip=0.0)
    for key, low in at_least.items():
        if getattr(cfg, key) is not None and getattr(cfg, key) < low:
            raise ValueError(f"config: {key} must be >= {low}, got {getattr(cfg, key)}")
    for key in ("lr", "min_lr", "weight_decay", "adam_eps", "grad_clip", "beta1", "beta2"):
        if not math.isfinite(getattr(cfg, key)):
            raise ValueError(f"config: {key} must be a finite number, got {getattr(cfg, key)}")
    for key, choices in dict(device=("auto", "cuda", "cpu"), dtype=("bfloat16", "float32")).items():
        if getattr(cfg, key) not in choices:
            raise ValueError(f"config: {key} must be one of {', '.join(choices)}, got {getattr(cfg, key)!r}")
    if cfg.init_from in NANOGPT_INIT_FROM:
        raise ValueError(f"config: init_from={cfg.init_from!r} is nanoGPT's; here {NANOGPT_INIT_FROM[cfg.init_from]}")
    if 0 < cfg.val_tokens < cfg.seq_length:
        raise ValueError(f"config: val_tokens {cfg.val_tokens} is less than one sequence of {cfg.seq_length}")
    if cfg.wandb_log and importlib.util.find_spec("wandb") is None:
        raise ValueError("config: wandb_log=True needs the wandb package: pip install wandb")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.global_batch_size % (cfg.local_batch_size * world_size) and not cfg.eval_only:
        raise ValueError(f"config: global_batch_size {cfg.global_batch_size} is not divisible by local_batch_size "
                         f"{cfg.local_batch_size} x world size {world_size} = {cfg.local_batch_size * world_size}")
    return cfg


# -----------------------------------------------------------------------------
# processes and the out_dir

def setup_distributed(device_choice="auto", timeout_s=900):
    """(rank, world_size, device); under torchrun a process group: NCCL on GPUs, gloo on CPU."""
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("config: device is 'cuda' but torch sees no CUDA GPU")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    torch.backends.cuda.matmul.allow_tf32 = use_cuda  # TF32 matmuls on GPUs (cuDNN allows them by default)
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=device if use_cuda else None)
    return rank, world_size, device


# every helper below also works without a process group (one process), so callers never branch on it
def rank_and_world_size():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def is_master():
    return rank_and_world_size()[0] == 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


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
    """work() done first by each node's local rank 0 (a hub download into that node's own cache: nodes need not share
    a home directory), then by the node's other ranks, which find it there; the first error raised on every rank."""
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    result = None
    for my_turn in (first, not first):
        error = None
        if my_turn:
            try:
                result = work()
            except (ValueError, OSError) as e:
                error = e
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        if any(e is not None for e in errors):
            raise next(e for e in errors if e is not None)
    return result


def any_rank(flag):
    """Whether `flag` is true on any rank (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return bool(flag)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor(float(bool(flag)), device=device)
    dist.all_reduce(total)
    return total.item() > 0


ROOT = os.path.dirname(os.path.abspath(__file__))
# what a run writes into an out_dir; a non-empty directory holding none of these belongs to someone else
RUN_FILES = ("train_config.json", "ckpt", "main.log", "metrics.jsonl", ".lock")
HF_MARKER = ".train_gpt2.json"  # in every hf/ export: only such an hf/ may be replaced by the next export
LOCKS = []  # this process's out_dir locks, released when main() returns


def lock_out_dir(out_dir):
    """An exclusive flock on out_dir/.lock for the run, dropped when the process dies (NFS/Lustre: across nodes)."""
    try:
        LOCKS.append(lock_file(os.path.join(out_dir, ".lock")))
    except LockHeld as e:
        raise ValueError(f"{out_dir}: another run is training in this out_dir ({e}); "
                         f"wait for it to end, stop it, or choose another out_dir") from None


def cut_torn_line(path):
    """Cut a last line that has no newline (the run was killed inside its write), so that the next record does not
    run into it; a message saying so, or None."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb+") as f:
        text = f.read()
        if not text or text.endswith(b"\n"):
            return None
        keep = text.rfind(b"\n") + 1
        f.truncate(keep)
    return f"{path}: cut its partial last line (the run was killed while writing it): {text[keep:][:60]!r}"


def prepare_out_dir(out_dir, eval_only=False):
    """On rank 0: check and lock out_dir, remove interrupted writes; the newest usable checkpoint or None. Under
    eval_only the run's own logs are left alone: an evaluation appends to out_dir/eval/main.log and metrics.jsonl."""
    if not out_dir.strip():
        raise ValueError("config: out_dir is empty; name a directory for the run, e.g. --out_dir=out")
    path = os.path.realpath(out_dir)
    for name, protected in (("the current directory", os.getcwd()), ("the project directory", ROOT)):
        protected = os.path.realpath(protected)
        if protected == path or protected.startswith(path.rstrip(os.sep) + os.sep):
            raise ValueError(f"{out_dir}: out_dir is {name} or one of its parents; name a directory of its own")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{out_dir}: out_dir is a file; name a directory")
    entries = os.listdir(path) if os.path.isdir(path) else []
    if entries and not set(RUN_FILES) & set(entries):
        raise ValueError(f"{out_dir}: out_dir holds {len(entries)} entries (e.g. {sorted(entries)[0]!r}) but no "
                         f"train_config.json, ckpt/ or main.log: not a training run's directory; name a new one")
    ckpt_root = os.path.join(out_dir, "ckpt")
    os.makedirs(ckpt_root, exist_ok=True)
    lock_out_dir(out_dir)
    for name in os.listdir(ckpt_root):
        if name.endswith(".tmp"):  # ours: the lock says no other run is writing it
            print(f"removing incomplete checkpoint {os.path.join(ckpt_root, name)}")
            shutil.rmtree(os.path.join(ckpt_root, name))
    resume_path, messages = newest_usable_checkpoint(ckpt_root)
    log_dir = os.path.join(out_dir, "eval") if eval_only else out_dir
    os.makedirs(log_dir, exist_ok=True)
    for name in ("main.log", "metrics.jsonl") if resume_path or eval_only else ():  # appended to from here on
        if message := cut_torn_line(os.path.join(log_dir, name)):
            messages.append(message)
    for name in () if resume_path or eval_only else ("main.log", "metrics.jsonl"):  # a fresh run never mixes curves
        log_path, k = os.path.join(out_dir, name), 1
        while os.path.exists(f"{log_path}.{k}"):
            k += 1
        if os.path.exists(log_path):
            os.rename(log_path, f"{log_path}.{k}")
            messages.append(f"{log_path} of an earlier run moved to {log_path}.{k}")
    for message in messages:
        print(message)
    return resume_path


# -----------------------------------------------------------------------------
# checkpoints (model.py reads them: complete_checkpoints, newest_usable_checkpoint, load_model)

def last_good_checkpoint(out_dir):  # where a run stopped for non-finite numbers can be taken up again
    kept = complete_checkpoints(os.path.join(out_dir, "ckpt"))
    return "The last good checkpoint is " + (kept[-1] if kept else "none (none was written)")


def nonfinite(model, optimizer=None):
    """This rank's parameters (and AdamW moments) holding NaN or inf, or a negative exp_avg_sq; one device sync."""
    local = lambda t: t.detach().to_local() if hasattr(t, "to_local") else t.detach()  # noqa: E731
    checks = {name: torch.isfinite(local(p)).all() for name, p in model.named_parameters()}
    names = {p: name for name, p in model.named_parameters()}
    for p, state in (optimizer.state.items() if optimizer is not None else ()):
        sq = local(state["exp_avg_sq"])
        checks[names[p] + " (AdamW moments)"] = torch.isfinite(local(state["exp_avg"])).all() & \
            (torch.isfinite(sq) & (sq >= 0)).all()
    return [name for name, ok in zip(checks, torch.stack(list(checks.values())).tolist()) if not ok]


def assert_finite(model, what, out_dir):
    """Raise FloatingPointError on every rank when any rank's shard holds NaN or inf: none is saved or exported."""
    bad = nonfinite(model)
    if any_rank(bad):
        raise FloatingPointError(f"{what}: parameters hold NaN or inf (" + (", ".join(bad[:3]) or "on another rank")
                                 + f"); nothing was written. {last_good_checkpoint(out_dir)}")


def fsync_tree(path):
    """fsync every file in directory `path`, then the directory; returns {file name: size} for the marker."""
    sizes = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
        sizes[name] = os.path.getsize(os.path.join(path, name))
    fsync_dir(path)
    return sizes


def training_state(model, optimizer, step):
    """The state dict a checkpoint at `step` holds. Before the first update AdamW has no state, and get_state_dict
    would make one up (step 1, zero moments) that changes every later update: a step-0 checkpoint holds the model."""
    if step == 0:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_checkpoint(cfg, model, optimizer, step, data):
    """step_N.tmp (DCP shards, rng.pt, train_state.json) fsynced, its marker, renamed to step_N. Collective."""
    assert_finite(model, f"checkpoint at step {step}", cfg.out_dir)
    ckpt_root = os.path.join(cfg.out_dir, "ckpt")
    final = os.path.join(ckpt_root, f"step_{step:08d}")
    if broadcast_object(os.path.isfile(os.path.join(final, MARKER))):
        return final  # already saved (a run resumed here and stopped at once)
    tmp, master = final + ".tmp", is_master()
    if master:
        if os.path.exists(final):
            print(f"incomplete checkpoint {final} moved to {set_aside(final, 'incomplete')}")
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover of an interrupted write
        os.makedirs(tmp)
    barrier()
    try:
        dcp.save(training_state(model, optimizer, step), checkpoint_id=tmp)
        if master:  # dcp.save returns on rank 0 after every rank's files are written
            rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                       cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
            atomic_save(os.path.join(tmp, "rng.pt"), lambda name: torch.save(rng, name))
            train_state = dict(step=step, consumed_samples=step * cfg.global_batch_size, **data,
                               world_size=rank_and_world_size()[1], model_config=dataclasses.asdict(model.config),
                               config=dataclasses.asdict(cfg))
            with atomic_write(os.path.join(tmp, "train_state.json"), "w", encoding="utf-8") as f:
                json.dump(train_state, f, indent=2)
            sizes = fsync_tree(tmp)
            with atomic_write(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
                json.dump(dict(step=step, sizes=sizes), f, indent=2)
            os.rename(tmp, final)
            fsync_dir(ckpt_root)
    except (Exception, dcp.CheckpointException) as e:
        if master:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space; it never held a marker
        # DCP wraps each rank's exception; a full disk is an OSError or torch's zip writer's RuntimeError
        failures = [(f" on rank {rank}", failure[0] if isinstance(failure, tuple) else failure)
                    for rank, failure in sorted((getattr(e, "failures", None) or {}).items())]
        for where, cause in failures or [("", e)]:
            if isinstance(cause, (OSError, RuntimeError)):
                raise OSError(getattr(cause, "errno", None),
                              f"writing checkpoint {final} failed{where}: {error_reason(cause)}",
                              getattr(cause, "filename", None)) from None
        raise
    if master:
        for old in complete_checkpoints(ckpt_root)[:-cfg.ckpt_keep]:
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(ckpt_path, model, optimizer):
    """Load model, optimizer and RNG states (resharded): train_state.json; one failing on any rank is set aside."""
    older = [path for path in reversed(complete_checkpoints(os.path.dirname(ckpt_path))) if path < ckpt_path]
    for path in [ckpt_path] + broadcast_object(older):
        error = None
        try:
            train_state = read_train_state(path)
            state = training_state(model, optimizer, train_state["step"])
            dcp.load(state, checkpoint_id=path)  # in place
            if "optim" in state:
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            else:  # no update yet: AdamW starts without state, as in the uninterrupted run
                set_model_state_dict(model, state["model"])
                optimizer.state.clear()
            if nonfinite(model, optimizer):
                raise FloatingPointError("it holds NaN or inf weights, or a negative or non-finite Adam moment")
            # every rank was seeded alike and nothing draws per-rank randomness, so rank 0's states serve all
            rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        except (Exception, dcp.CheckpointException) as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not any_rank(error is not None):
            return train_state
        if is_master():
            print(f"skipping checkpoint {path}: it failed to load ({error or 'on another rank'}); kept as "
                  f"{set_aside(path, 'damaged')}")
        barrier()
    raise ValueError(f"{os.path.dirname(ckpt_path)}: no checkpoint loads (damaged ones were renamed *.damaged-*); "
                     "start a fresh run in another out_dir")


def resume(resume_path, model, optimizer, cfg, data, log, train_data=None):
    """The step of the checkpoint loaded; a change to the tokens seen or their order needs resume_allow_data_change."""
    train_state = load_checkpoint(resume_path, model, optimizer)
    step, saved = train_state["step"], train_state["config"]
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):  # the config wins
        group.update(weight_decay=weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
    if cfg.eval_only:  # evaluation reads no training data and needs no step budget
        return step
    batch = saved["global_batch_size"]
    if batch != cfg.global_batch_size:  # the data order and the lr schedule are counted in steps of the saved batch
        raise ValueError(f"{resume_path}: the run was trained with global_batch_size {batch}, the config now says "
                         f"{cfg.global_batch_size}; resume with --global_batch_size={batch} (on any ranks)")
    if step > cfg.max_steps:
        raise ValueError(f"{resume_path}: the checkpoint is at step {step}, beyond max_steps {cfg.max_steps}")
    # what decides which tokens a run sees and in what order, with the data itself and the train split's epochs
    changes = [f"{key} {saved[key]!r} -> {getattr(cfg, key)!r}" for key in ("data_paths", "split", "seed", "seq_length")
               if saved[key] != getattr(cfg, key)]
    before, now = train_state["data"], data["data"]
    changes += [f"data {prefix} fingerprint {before.get(prefix, 'absent')[:12]} -> {now.get(prefix, 'absent')[:12]}"
                for prefix in sorted(set(before) | set(now)) if before.get(prefix) != now.get(prefix)]
    consumed = step * batch
    if not changes and train_state["sample_order"] != data["sample_order"] and consumed:
        # another plan (max_steps changed the epochs or the blend): what matters is the samples already consumed,
        # so the saved run's plan is built again (from the index cache when it is still there) and compared
        saved_plan = build_train_data(dataclasses.replace(cfg, max_steps=saved["max_steps"]),
                                      saved["max_steps"] * batch, lambda *args, **kwargs: None)
        if not first_samples_agree(saved_plan, train_data, consumed):
            changes.append(f"max_steps {saved['max_steps']} -> {cfg.max_steps} (the train split is then built in "
                           f"other epochs or blended otherwise: the {consumed:,} samples consumed differ)")
    if not changes and saved["max_steps"] != cfg.max_steps:
        log(f"max_steps {saved['max_steps']} -> {cfg.max_steps}: the {consumed:,} samples consumed are the same, in "
            f"the same order, in the new plan")
    if changes and not cfg.resume_allow_data_change:
        raise ValueError(f"{resume_path}: resuming would change the tokens the run sees or their order: "
                         f"{'; '.join(changes)}; undo it, use a new out_dir, or set --resume_allow_data_change=True")
    if changes:
        log(f"resuming with changed data (resume_allow_data_change): {'; '.join(changes)}")
    if saved["max_steps"] != cfg.max_steps:
        log(f"max_steps {saved['max_steps']} -> {cfg.max_steps}: the cosine decay to min_lr {cfg.min_lr:g} now ends "
            f"at step {cfg.max_steps}; lr at step {step} is {lr_at(step, cfg):.3e}")
    optimizer_keys = ("lr", "min_lr", "lr_warmup_steps", "weight_decay", "beta1", "beta2", "adam_eps", "grad_clip")
    if changed := config_changes({key: saved[key] for key in optimizer_keys if key in saved}, cfg):
        log(f"{'; '.join(changed)}: the config wins from step {step} on; lr at step {step} is {lr_at(step, cfg):.3e}")
    return step


def config_changes(saved, cfg):
    """'key saved -> now' for each key of the `saved` config dict that `cfg` sets otherwise (max_steps None: unset)."""
    now = dataclasses.asdict(cfg)
    return [f"{key} {value!r} -> {now[key]!r}" for key, value in saved.items()
            if key in now and now[key] != value and not (key == "max_steps" and now[key] is None)]


def data_state(train_data):
    """What a resume compares: each file's fingerprint and a digest of the sample order, from what keys the index
    cache (each file's fingerprint, the split's sequences, seq_length, seed, epochs, the blend's weights), not from
    the index arrays: equal digests are equal samples in the same order, however many of them are planned."""
    parts = getattr(train_data, "datasets", [train_data])  # the GPTDatasets, blended or not
    order = json.dumps(train_data.order, sort_keys=True)
    return dict(data={part.dataset.path_prefix: part.dataset.fingerprint for part in parts},
                sample_order=hashlib.sha256(order.encode()).hexdigest())


def already_complete(cfg, resume_path):
    """Whether out_dir holds the run's last checkpoint and its hf/ export: a rerun then has nothing to do."""
    try:
        with open(os.path.join(cfg.out_dir, "hf", HF_MARKER), encoding="utf-8") as f:
            exported = json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return False
    train_state = read_train_state(resume_path)
    return train_state["step"] == (cfg.max_steps or train_state["config"]["max_steps"]) == exported


def publish_hf(model, cfg):
    """The final weights (and GPT-2's tokenizer) as out_dir/hf; an hf/ without HF_MARKER is moved aside."""
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's last forward unsharded (bf16): back to fp32 shards
        model.reshard()
    assert_finite(model, "Hugging Face export", cfg.out_dir)
    t0, hf_dir = time.perf_counter(), os.path.join(cfg.out_dir, "hf")
    if is_master() and os.path.isdir(hf_dir) and not os.path.exists(os.path.join(hf_dir, HF_MARKER)):
        print(f"{hf_dir} was not written by train_gpt2.py; moved to {set_aside(hf_dir, 'moved')}")

    def extra_files(directory):
        if model.config.vocab_size == VOCAB_SIZE:  # GPT-2's tokenizer, and generation that stops at its EOT
            write_hf_tokenizer(directory, model_max_length=model.config.block_size)  # its context
            with atomic_write(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
                json.dump(dict(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID), f, indent=2)
        with atomic_write(os.path.join(directory, HF_MARKER), "w", encoding="utf-8") as f:
            json.dump(dict(written_by="train_gpt2.py", step=cfg.max_steps), f)

    export_hf(model, hf_dir, extra_files=extra_files)  # one tensor at a time gathered to rank 0, which writes
    barrier()
    if is_master():
        print(f"exported Hugging Face weights to {hf_dir} ({time.perf_counter() - t0:.1f} s)")


# -----------------------------------------------------------------------------
# model and optimizer

def starting_point(cfg, resume_path):
    """(GPTConfig, (kind, source)) of the first weights: resume, checkpoint, hf (padded_vocab_size applies) or seed."""
    if resume_path is not None:
        model_config = GPTConfig(**read_train_state(resume_path)["model_config"])
        keys = ("n_layer", "n_head", "n_embd", "vocab_size", "padded_vocab_size")
        differ = [f"{k} {getattr(model_config, k)} (config: {getattr(cfg, k)})" for k in keys
                  if getattr(model_config, k) != getattr(cfg, k)]
        if differ and cfg.init_from is None:
            raise ValueError(f"{resume_path}: the checkpoint to resume from has {', '.join(differ)}; use the "
                             f"checkpoint's architecture or another out_dir")
        return model_config, ("resume", resume_path)
    if cfg.init_from is not None and is_run_or_checkpoint(cfg.init_from):
        configs = {}  # a live run may delete its newest checkpoint meanwhile: then the next newest is read

        def read(path):
            configs[path] = read_train_state(path)["model_config"]

        model_config = on_rank0(lambda: configs[resolve_checkpoint(cfg.init_from, load=read)])
        return GPTConfig(**model_config), ("checkpoint", cfg.init_from)
    if cfg.init_from is None:
        return GPTConfig(block_size=cfg.seq_length, vocab_size=cfg.vocab_size, padded_vocab_size=cfg.padded_vocab_size,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd), ("seed", cfg.seed)
    directory, hf_config = on_each_node(lambda: resolve_pretrained(cfg.init_from))  # a hub id: downloaded per node
    return dataclasses.replace(hf_config, padded_vocab_size=cfg.padded_vocab_size), ("hf", directory)


def build_model(model_config, init, cfg, device):
    """The model on the meta device, sharded with FSDP2 under torchrun; then each rank fills its own rows of weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # the mesh of the run's device type: fully_shard's default follows the accelerator, not the process group
    mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),)) if dist.is_initialized() else None
    with torch.device("meta"):
        model = GPT(model_config)
    model.activation_checkpointing = cfg.activation_checkpointing  # per block, inside FSDP's and compile's wrapping
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.dtype == "bfloat16" else MixedPrecisionPolicy()
    for block in model.transformer.h:
        if cfg.compile:
            block.compile()  # before sharding: no graph breaks at FSDP's hooks and state-dict names stay the same
        if dist.is_initialized():
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    if dist.is_initialized():
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    model.to_empty(device=device)
    if not dist.is_initialized():  # to_empty() gave a plain model two embedding tensors: tie them again
        model.lm_head.weight = model.transformer.wte.weight
    model.compile_loss = cfg.compile  # the loss head's chunks compiled like the blocks
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


def load_init_checkpoint(source, model):
    """Load the weights of `source` (a checkpoint, or a run's newest usable one) into `model` on every rank; the path.
    Rank 0 chooses with model.resolve_checkpoint, which retries as sample.py does when a live run deletes the chosen
    checkpoint (ckpt_keep) before it is read; every rank loads each path it tries, as a load is collective."""
    def load(path):  # on every rank, the same path
        error = None
        try:
            load_weights(path, model)
        except (ValueError, RuntimeError, OSError, dcp.CheckpointException) as e:
            error = e  # damaged although its files look complete, or deleted meanwhile
        if any_rank(error is not None):  # a RuntimeError, which resolve_checkpoint catches (DCP's is no Exception)
            raise RuntimeError(str(error).strip() if error is not None else "it failed to load on another rank")

    def lead(path):  # rank 0's tries, which the other ranks follow
        broadcast_object(path)
        load(path)

    outcome = None
    if is_master():
        try:
            outcome = resolve_checkpoint(source, load=lead), None
        except (Exception, dcp.CheckpointException) as e:
            outcome = None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        broadcast_object(None)  # no more tries
    else:
        while (path := broadcast_object(None)) is not None:
            try:
                load(path)
            except (Exception, dcp.CheckpointException):
                pass  # rank 0 says what failed
    path, error = broadcast_object(outcome)
    if error is not None:
        raise ValueError(f"init_from {source}: the checkpoint does not load: {error}")
    return path


def memory_plan(model_config, cfg, world_size, device):
    """(text, GiB) of one rank's peak; activations ~34 x tokens x n_embd bytes a layer in 16-bit (Korthikanti 2022)."""
    with torch.device("meta"):
        model = GPT(model_config)
    n = sum(p.numel() for p in model.parameters())
    n_block = sum(p.numel() for p in model.transformer.h[0].parameters())
    gib, sharded = 2**30, dist.is_initialized()
    act_bytes = 2 if cfg.dtype == "bfloat16" else 4
    accumulating = cfg.global_batch_size > cfg.local_batch_size * world_size
    tokens = cfg.local_batch_size * cfg.seq_length
    vocab, L = model_config.padded_vocab_size or model_config.vocab_size, model_config.n_layer
    parts = {
        "parameters": 4 * n / world_size, "gradients": 4 * n / world_size, "optimizer": 8 * n / world_size,
        # FSDP2 accumulates unsharded fp32 gradients between reductions; it gathers two blocks at a time
        "FSDP2 gradient accumulators": 4 * n if sharded and accumulating else 0,
        "FSDP2 gathered blocks": 2 * act_bytes * n_block if sharded else 0,
        "autocast copies": 2 * n if not sharded and cfg.dtype == "bfloat16" else 0,
        "activations": (1 if cfg.activation_checkpointing else 17) * act_bytes * tokens * model_config.n_embd * L,
        "loss head": loss_head_bytes(min(tokens, LOSS_CHUNK_ROWS.get(device.type, 1024)), vocab, model_config.n_embd,
                                     act_bytes, cfg.compile)}
    total = sum(parts.values()) / gib
    free = torch.cuda.mem_get_info(device)[0] / gib if device.type == "cuda" else None
    plan = (f"memory plan per rank ({world_size} rank(s), {cfg.dtype}, micro-batch {tokens:,} tokens): "
            + ", ".join(f"{name} {size / gib:.2f} GiB" for name, size in parts.items() if size)
            + f"; total ~{total:.2f} GiB (estimated); device free " + (f"{free:.1f} GiB" if free else "n/a (CPU)"))
    if free is not None and total > 0.9 * free:
        more = "" if cfg.activation_checkpointing else " or set activation_checkpointing=True"
        plan += f"\nWARNING: this may not fit: lower local_batch_size{more}, or use more ranks"
    return plan, total


def loss_head_bytes(rows, vocab, n_embd, act_bytes, compiled):
    """What model.chunked_cross_entropy holds at its peak: the reused buffer of one chunk's logits (the compute dtype)
    and its fp32 weight gradient; eagerly also an fp32 chunk for the logsumexp (and an fp32 copy of 16-bit logits),
    which the compiled chunk's fused kernels never write: 0.97 GB at 8,192 rows of 50,304 in bf16, compiled."""
    eager = 0 if compiled else rows * vocab * 4 * (1 if act_bytes == 4 else 2)
    return rows * vocab * act_bytes + eager + 4 * vocab * n_embd


def build_optimizer(model, cfg, device):
    """AdamW with weight decay on the 2-D parameters (matmul weights and embeddings) only, as GPT-2 recipes do."""
    groups = [dict(params=[p for p in model.parameters() if p.dim() >= 2], weight_decay=cfg.weight_decay),
              dict(params=[p for p in model.parameters() if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                             fused=device.type == "cuda")


def lr_at(step, cfg):
    """llm.c's schedule: linear warmup (step 0 already gets lr / lr_warmup_steps), then cosine from lr to min_lr."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    decay_ratio = (step - cfg.lr_warmup_steps) / max(1, cfg.max_steps - cfg.lr_warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg.lr - cfg.min_lr)


def peak_flops(device):
    """Dense bf16 FLOP/s of one `device` from PEAK_BF16_TFLOPS, or None (CPU, unknown GPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


# -----------------------------------------------------------------------------
# data and evaluation

def build_data(cfg, log):
    """(train_data, val_data): Megatron's GPTDataset samples (None under eval_only) and the validation windows."""
    train_data = val_data = None
    if not cfg.eval_only:
        train_data = build_train_data(cfg, None if cfg.max_steps is None else cfg.max_steps * cfg.global_batch_size, log)
        if cfg.max_steps is None:
            cfg.max_steps = len(train_data) // cfg.global_batch_size
            if cfg.max_steps < 1:
                raise ValueError(f"{cfg.data_paths}: the train split has {len(train_data):,} samples, fewer than "
                                 f"one global batch of {cfg.global_batch_size}")
            log(f"max_steps None: one epoch of the train split is {cfg.max_steps:,} steps")
    if cfg.val_tokens and cfg.val_data_paths is not None:
        val_data = LLMCValWindows(cfg.val_data_paths, cfg.seq_length, cfg.val_tokens)
    elif cfg.val_tokens:
        val_data = sequential_samples(cfg.data_paths, seq_length=cfg.seq_length, split=cfg.split, split_index=1,
                                      max_samples=cfg.val_tokens // cfg.seq_length)
        if val_data is None:
            log(f"no validation: split {cfg.split!r} gives the validation split no share")
        elif len(val_data) < cfg.val_tokens // cfg.seq_length:  # refused, as LLMCValWindows refuses it
            raise ValueError(f"{cfg.data_paths}: the validation split ({cfg.split!r}) holds {val_data.num_tokens:,} "
                             f"tokens, fewer than the {cfg.val_tokens // cfg.seq_length * cfg.seq_length + 1:,} that "
                             f"val_tokens {cfg.val_tokens:,} needs; lower val_tokens or give validation a larger share")
    if val_data is not None:
        log(f"validation: {len(val_data)} windows of {cfg.seq_length} tokens from "
            f"{cfg.val_data_paths or cfg.data_paths}")
    return train_data, val_data


def build_train_data(cfg, num_samples, log):
    """The train split's samples for `num_samples` (None: one epoch), built once: an unweighted list of prefixes gives
    at most one epoch of each (Megatron's limit), so past that it is blended by token count from the start."""
    paths, (prefixes, weights) = cfg.data_paths, resolve_blend(cfg.data_paths)
    if num_samples is not None and weights is None and len(prefixes) > 1:
        epoch = one_epoch_samples(paths, seq_length=cfg.seq_length, split=cfg.split)
        if num_samples > epoch:
            log(f"{paths}: {num_samples:,} samples are more than one epoch ({epoch:,}); the prefixes are blended by "
                f"token count, each repeated in whole epochs")
            paths = token_weighted_blend(paths)
            prefixes, weights = resolve_blend(paths)
    train_data, _, _ = build_gpt_datasets(paths, seq_length=cfg.seq_length, split=cfg.split, seed=cfg.seed,
                                          sizes=(num_samples, 0, 0), cache_dir=cfg.index_mapping_dir,
                                          fallback_cache_dir=os.path.join(cfg.out_dir, "index_cache"))
    if train_data is None:
        raise ValueError(f"{cfg.data_paths}: the train split is empty (split {cfg.split!r})")
    if weights is not None:  # said at every start: the dataset cache only says it when it builds the blend
        shares = [w / sum(weights) for w in weights]
        log("train blend: " + (", ".join(f"{prefix} {share:.4f}" for prefix, share in zip(prefixes, shares, strict=True))
                               if len(prefixes) <= 8 else
                               f"{len(prefixes)} prefixes, weights {min(shares):.4f} to {max(shares):.4f}"))
    return train_data


def host_batch(dataset, indices, vocab_size, pin):
    """Samples `indices` as (tokens, labels) on the host; an id outside the vocabulary named here, not a GPU assert."""
    samples = [dataset[i] for i in indices]
    tokens, labels = np.stack([s["tokens"] for s in samples]), np.stack([s["labels"] for s in samples])
    # on the host, no device sync; ids below 0 come from signed (int32) datasets and index the embedding from its end
    top = np.maximum(tokens.max(axis=1), labels.max(axis=1))
    bottom = np.minimum(tokens.min(axis=1), labels.min(axis=1))
    for ids, row in ((top, int(top.argmax())), (bottom, int(bottom.argmin()))):
        if not 0 <= ids[row] < vocab_size:
            raise ValueError(f"token id {ids[row]} in {dataset.describe(indices[row])} is outside the model's "
                             f"vocabulary (vocab_size {vocab_size})")
    tokens, labels = torch.from_numpy(tokens), torch.from_numpy(labels)
    return (tokens.pin_memory(), labels.pin_memory()) if pin else (tokens, labels)


def prefetch(dataset, sampler, grad_accum_steps, vocab_size, pin, depth=2):
    """A queue of each step's host micro-batches, read ahead by a thread started now; last, what ended the thread."""
    ready = queue.Queue(maxsize=depth)

    def produce():
        try:
            while True:
                ready.put([host_batch(dataset, next(sampler), vocab_size, pin) for _ in range(grad_accum_steps)])
        except BaseException as e:
            ready.put(e)

    threading.Thread(target=produce, daemon=True).start()
    return ready


class Evaluator:
    """Validation loss, HellaSwag and a sample before step s's update (HellaSwag and samples at s:0 under eval_only)."""

    def __init__(self, cfg, val_data, vocab_size, device, log):
        self.cfg, self.val_data, self.vocab_size, self.device, self.log = cfg, val_data, vocab_size, device, log
        # bf16 on one device is autocast; sharded, FSDP's mixed-precision policy already computes in bf16
        self.autocast_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" and not dist.is_initialized() else None
        self.autocast = torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        self.sample_tokens = cfg.sample_tokens if vocab_size == VOCAB_SIZE else 0
        if cfg.sample_tokens and not self.sample_tokens:
            log(f"sample_tokens ignored: the vocabulary ({vocab_size} tokens) is not GPT-2's")
        self.hellaswag = None
        if cfg.hellaswag is not None:
            if vocab_size != VOCAB_SIZE:
                raise ValueError(f"config: hellaswag needs the GPT-2 vocabulary; the model has {vocab_size} tokens")
            path = None if cfg.hellaswag == "download" else cfg.hellaswag
            # read (downloaded into its cache), parsed and tokenized once, by rank 0 alone, and sent to every rank:
            # other nodes need neither the file (no shared home) nor internet, and a bad file fails every rank alike
            self.hellaswag = on_rank0(lambda: hellaswag.render_all(hellaswag.load_examples(path)))

    def __call__(self, model, step, stop, logged=()):
        """Whether the evaluation ran to its end (False: a stop was requested during it). `logged`: the results
        (metrics.jsonl keys) already logged for this step before a restart, not evaluated again."""
        cfg, log, stopped = self.cfg, self.log, lambda: any_rank(stop.signal is not None)
        rank, world_size = rank_and_world_size()
        head, batch_size = f"step {step:5d}/{cfg.max_steps} |", cfg.local_batch_size
        if logged:
            log(f"{head} {', '.join(sorted(logged))} of this step logged before the restart; not evaluated again")
        if self.val_data is not None and "val_loss" not in logged:
            # rank r scores windows r, r + W, ..., every rank in as many forwards (a sharded forward is collective)
            t0, mine = time.perf_counter(), list(range(rank, len(self.val_data), world_size))
            totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
            for b in range(math.ceil(len(self.val_data) / (world_size * batch_size))):
                if stopped():  # between batches: a stop never waits behind an evaluation
                    return False
                indices = mine[b * batch_size:(b + 1) * batch_size]
                batch = host_batch(self.val_data, indices or [0], self.vocab_size, self.device.type == "cuda")
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
                raise FloatingPointError(f"step {step}: val loss {val_loss} is not finite; stopped, state not saved")
            log(f"{head} val loss {val_loss:.6f} | {time.perf_counter() - t0:.1f} s", f"s:{step} tel:{val_loss:.4f}",
                step=step, val_loss=val_loss)
        if self.hellaswag is not None and (step > 0 or cfg.eval_only) and "hellaswag_acc_norm" not in logged:
            # as many examples per forward as a training micro-batch has tokens
            result = hellaswag.evaluate(model, self.hellaswag, device=self.device, rank=rank, world_size=world_size,
                                        autocast_dtype=self.autocast_dtype, limit=cfg.hellaswag_limit,
                                        batch_tokens=batch_size * cfg.seq_length, stopped=stopped)
            if result is None:
                return False
            log(f"{head} hellaswag acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/{result['total']})",
                f"s:{step} eval:{result['acc_norm']:.4f}", step=step, hellaswag_acc_norm=result["acc_norm"],
                hellaswag_acc=result["acc"])
        if self.sample_tokens and step > 0 and "sample" not in logged:
            with self.autocast:
                text = sample_texts(model, "", max_new_tokens=self.sample_tokens, seed=cfg.seed + step,
                                    device=self.device)[0]
            log(f"{head} sample: {text!r}", step=step, sample=text)
        return True


# -----------------------------------------------------------------------------
# the training loop

class StopRequest:
    """SIGTERM/SIGINT remembered: the run checkpoints at the next step (or between evaluation batches) and exits
    128 + signum. While it stops, more SIGTERMs are absorbed (a scheduler signals every process, then torchrun
    forwards its own): none may kill the worker before its checkpoint. A person's second Ctrl-C is told that the
    checkpoint is being written; a third one aborts at once without it, as kill -9 does."""

    def __init__(self):
        self.signal = self.time = None
        self.interrupts, self.told = 0, False  # SIGINTs after the first signal; the repeated SIGTERM said
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def handle(self, signum, frame):
        if self.signal is None:
            self.signal, self.time = signum, time.perf_counter()
            return
        if signum == signal.SIGTERM:
            if not self.told and is_master():
                print("SIGTERM again while stopping: ignored, the checkpoint is being written", file=sys.stderr,
                      flush=True)
            self.told = True
            return
        self.interrupts += 1
        if self.interrupts == 1 and is_master():
            print("stopping: the checkpoint is being written; Ctrl-C again (or kill -9) aborts without it, and a rerun "
                  "then resumes from the checkpoint before", file=sys.stderr, flush=True)
        elif self.interrupts > 1:  # the person insists: die by SIGINT now, with no traceback and no checkpoint
            print("aborted without a checkpoint; rerun the same command to resume from the last one", file=sys.stderr,
                  flush=True)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class PeerLost(Exception):
    """Another rank died or stopped answering: this rank ends with one line, and rerunning resumes."""


class RunLog:
    """On rank 0: a console line, a main.log line (llm.c's format), a metrics.jsonl record (and wandb's), in out_dir
    (a run's, or its eval/ subdirectory under eval_only)."""

    def __init__(self, out_dir):
        self.out_dir, self.master, self.wandb = out_dir, is_master(), None

    def start(self, cfg, resumed):
        """On rank 0, once the config is accepted: train_config.json (eval_config.json under eval_only) and, with
        wandb_log, the wandb run of this directory."""
        name = "eval_config.json" if cfg.eval_only else "train_config.json"
        with atomic_write(os.path.join(self.out_dir, name), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        if not cfg.wandb_log:
            return
        import wandb
        id_path = os.path.join(self.out_dir, "wandb_run_id")
        run_id = open(id_path).read().strip() if resumed and os.path.exists(id_path) else os.urandom(4).hex()
        with atomic_write(id_path, "w") as f:
            f.write(run_id)
        self.wandb = wandb.init(project=cfg.wandb_project, id=run_id, resume="allow", dir=self.out_dir,
                                name=cfg.wandb_run_name or os.path.basename(os.path.abspath(cfg.out_dir)),
                                config=dataclasses.asdict(cfg))
        self.wandb.define_metric("*", step_metric="step")  # plotted against the training step, not wandb's counter

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
    """(GiB, label) of the peak since the last reset: CUDA's high-water mark, or VmHWM (5 to clear_refs resets it)."""
    if device.type == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.max_memory_allocated(device) / 2**30, "mem"
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20, "rss"
    except (OSError, StopIteration):  # no /proc here (some sandboxes): the peak since the process began
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss"


class StepLog:
    """Each step's loss, grad norm and stop flag, copied to the host asynchronously and read a step late."""

    def __init__(self, cfg, log, device, model):
        self.cfg, self.log, self.device = cfg, log, device
        self.cuda, self.world_size = device.type == "cuda", rank_and_world_size()[1]
        flops_per_token, peak = model.flops_per_token(cfg.seq_length), peak_flops(device)
        self.mfu_scale = flops_per_token / (peak * self.world_size) if peak else None
        log(f"model: {model.num_params(non_embedding=False):,} parameters ({model.num_params():,} non-embedding), "
            f"{flops_per_token / 1e9:.3f} GFLOP/token; bf16 peak "
            + (f"{peak / 1e12:.0f} TFLOP/s per GPU" if peak else "unknown (MFU n/a)"))
        self.pending = []  # (step, lr, host stats, start, end, peak GiB): start/end are CUDA events or host times
        self.recent = []  # (end, host stats) of the steps the stop flag is read from: a GPU's last two, a CPU's last
        self.stop_flag, self.run_peak_gib = torch.zeros((), device=device), 0.0

    def clock(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self):
        peak_memory(self.device, reset=True)
        self.start = self.clock()

    def end_step(self, step, lr, loss, norm, stop):
        """Queue the step's numbers for the host; whether any rank asked to stop (a GPU's last step, a CPU's this)."""
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a sharded model's norm is a DTensor
        self.stop_flag.fill_(float(stop.signal is not None))
        stats = torch.stack([loss, norm.float(), self.stop_flag])
        if dist.is_initialized():
            dist.all_reduce(stats)
        host = torch.empty(3, pin_memory=self.cuda)
        host.copy_(stats, non_blocking=True)
        end = self.clock()
        peak_gib, self.memory_label = peak_memory(self.device)
        self.run_peak_gib = max(self.run_peak_gib, peak_gib)
        self.pending.append((step, lr, host, self.start, end, peak_gib))
        self.recent = (self.recent + [(end, host)])[-2 if self.cuda else -1:]
        if self.world_size == 1:
            return stop.signal is not None
        if self.cuda and len(self.recent) < 2:
            return False
        end, host = self.recent[0]
        if self.cuda:
            end.synchronize()
        return host[2].item() > 0

    def flush(self, keep_last=True):
        """Log the pending steps (all but the newest when keep_last)."""
        ready, self.pending = (self.pending[:-1], self.pending[-1:]) if keep_last else (self.pending, [])
        for step, lr, host, start, end, peak_gib in ready:
            if self.cuda:
                end.synchronize()  # this step's device work, the copy of its numbers included, is done
            train_loss, norm, _ = (host / torch.tensor([self.world_size, self.world_size, 1])).tolist()
            if not (math.isfinite(train_loss) and math.isfinite(norm)):
                raise FloatingPointError(
                    f"step {step}: train loss {train_loss} / grad norm {norm} is not finite; stopped without saving "
                    f"this state. {last_good_checkpoint(self.cfg.out_dir)}")
            dt = start.elapsed_time(end) / 1000 if self.cuda else end - start
            tokens_per_s = self.cfg.global_batch_size * self.cfg.seq_length / dt
            mfu = tokens_per_s * self.mfu_scale if self.mfu_scale else None
            self.log(f"step {step:5d}/{self.cfg.max_steps} | loss {train_loss:.6f} | lr {lr:.2e} | norm {norm:.4f} "
                     f"| {dt * 1000:.1f} ms | {tokens_per_s:,.0f} tok/s | MFU "
                     + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a")
                     + f" | {self.memory_label} {peak_gib:.2f} GiB (run peak {self.run_peak_gib:.2f})",
                     f"s:{step} trl:{train_loss:.4f} lr:{lr:.6f} norm:{norm:.2f}",
                     step=step, train_loss=train_loss, lr=lr, grad_norm=norm, step_ms=dt * 1000,
                     tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gib=peak_gib, run_peak_mem_gib=self.run_peak_gib,
                     consumed_samples=(step + 1) * self.cfg.global_batch_size)


class Training(typing.NamedTuple):
    """What setup() hands the training loop."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    start_step: int
    train_data: object  # Megatron's GPTDataset or BlendedDataset samples (indexed_dataset)
    evaluate: Evaluator
    step_log: StepLog
    data: dict  # data_state(train_data): what each checkpoint records of the data


def setup(cfg, world_size, device, log, stop):
    """out_dir, data, model, optimizer, resume, evaluation, in that order: a Training, or an exit status when nothing
    is left to train (eval_only, or a run already complete)."""
    resume_path = on_rank0(lambda: prepare_out_dir(cfg.out_dir, cfg.eval_only))
    if resume_path and not cfg.eval_only and on_rank0(lambda: already_complete(cfg, resume_path)):
        saved = on_rank0(lambda: read_train_state(resume_path)["config"])
        differ = config_changes({k: v for k, v in saved.items() if k not in ("out_dir", "index_mapping_dir")},
                                cfg)  # where the run and its index cache live is no change to the run
        log(f"{cfg.out_dir}: this run is already complete ({resume_path}, exported to hf/); nothing to do"
            + (f"; the config differs from the run's ({'; '.join(differ)}) and a finished run takes no change: "
               f"use a new out_dir, or raise max_steps to train on" if differ else ""))
        return 0
    train_data, val_data = build_data(cfg, log)
    log(f"world size {world_size}, device {device}, dtype {cfg.dtype}, grad accumulation "
        f"{max(1, cfg.global_batch_size // (cfg.local_batch_size * world_size))}; "
        + (f"FSDP2 over a {device.type} mesh of {world_size} ranks; " if dist.is_initialized() else "")
        + (f"resuming from {resume_path}" if resume_path else f"init from {cfg.init_from or 'GPT-2 init'}"))
    model_config, init = starting_point(cfg, resume_path)
    # the weights' architecture wins (init_from or a checkpoint): train_config.json records the model trained
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "padded_vocab_size"):
        if getattr(cfg, key) != getattr(model_config, key):
            log(f"{key} {getattr(model_config, key)} from {init[1]} (the config's {getattr(cfg, key)} does not apply)")
            setattr(cfg, key, getattr(model_config, key))
    if cfg.seq_length > model_config.block_size:
        raise ValueError(f"config: seq_length {cfg.seq_length} is longer than the model's context "
                         f"({model_config.block_size} positions)")
    plan, plan_gib = memory_plan(model_config, cfg, world_size, device)
    log(plan, memory_plan_gib=plan_gib, memory_baseline_gib=peak_memory(device, reset=True)[0])
    model = build_model(model_config, init, cfg, device)
    optimizer = build_optimizer(model, cfg, device)
    data = {} if train_data is None else data_state(train_data)
    step = 0 if resume_path is None else resume(resume_path, model, optimizer, cfg, data, log, train_data)
    on_rank0(lambda: log.start(cfg, resumed=resume_path is not None))
    evaluate = Evaluator(cfg, val_data, model_config.vocab_size, device, log)
    step_log = StepLog(cfg, log, device, model)
    if cfg.eval_only:
        log(f"eval_only: the results are appended to {log.out_dir}/main.log and metrics.jsonl (the config to "
            f"eval_config.json); the run's own logs are left as they are")
        return 0 if evaluate(model, step, stop) else 128 + (stop.signal or signal.SIGTERM)
    return Training(model, optimizer, step, train_data, evaluate, step_log, data)


def evaluations_logged(out_dir, step):
    """Which evaluation results (val_loss, hellaswag_acc_norm, sample) out_dir/metrics.jsonl holds for `step`."""
    found = set()
    try:
        with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("step") == step:
                    found |= {key for key in ("val_loss", "hellaswag_acc_norm", "sample") if key in record}
    except FileNotFoundError:
        pass
    return found


def train(cfg, rank, world_size, device, log, stop):
    training = setup(cfg, world_size, device, log, stop)
    if not isinstance(training, Training):
        return training  # an exit status: nothing left to train
    model, optimizer, start_step, train_data, evaluate, step_log, data = training
    # a restart at a step whose evaluation was logged (a stop during HellaSwag, a raised max_steps) logs it once
    logged = on_rank0(lambda: evaluations_logged(cfg.out_dir, start_step))
    grad_accum_steps = cfg.global_batch_size // (cfg.local_batch_size * world_size)
    sampler = iter(PretrainingSampler(cfg.max_steps * cfg.global_batch_size, start_step * cfg.global_batch_size,
                                      cfg.local_batch_size, rank, world_size))
    batches = prefetch(train_data, sampler, grad_accum_steps, model.config.vocab_size, device.type == "cuda")

    def save(done, stopping=False):
        t0 = time.perf_counter()
        path = save_checkpoint(cfg, model, optimizer, done, data)
        log(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f} s)")
        if stopping:  # exit 128 + signum (143 for SIGTERM), also on ranks that only heard of it
            since = f", {time.perf_counter() - stop.time:.1f} s after the signal" if stop.time else ""
            log(f"stopped by a signal at step {done}{since}; rerun the same command to resume")
            return 128 + (stop.signal or signal.SIGTERM)

    for step in range(start_step, cfg.max_steps + 1):
        last_step = step == cfg.max_steps
        if step % cfg.val_every_steps == 0 or last_step:
            step_log.flush(keep_last=False)
            if not evaluate(model, step, stop, logged):  # a stop request came during the evaluation
                return save(step, stopping=True)
        if last_step:
            break
        logged = ()

        # one optimizer step over global_batch_size sequences; nothing here waits for the device
        step_log.start_step()
        lr = lr_at(step, cfg)
        if isinstance(step_batches := batches.get(), BaseException):  # e.g. a token id outside the vocabulary
            raise step_batches
        loss_sum = torch.zeros((), device=device)
        for micro_step, batch in enumerate(step_batches):
            tokens, labels = (t.to(device, non_blocking=True) for t in batch)  # pinned: the copy does not wait
            if dist.is_initialized():  # reduce-scatter gradients once per step, not once per micro-batch
                model.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
            with evaluate.autocast:
                _, micro_loss = model(tokens, labels)
            (micro_loss / grad_accum_steps).backward()
            loss_sum += micro_loss.detach()
        loss = loss_sum / grad_accum_steps
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stop_requested = step_log.end_step(step, lr, loss, norm, stop)

        done = step + 1
        checkpoint_due = done == cfg.max_steps or (cfg.ckpt_every_steps and done % cfg.ckpt_every_steps == 0)
        if checkpoint_due or stop_requested or done % cfg.log_every_steps == 0:
            # before a checkpoint every number is read, so a non-finite step is never saved
            step_log.flush(keep_last=not (checkpoint_due or stop_requested))
        if checkpoint_due or stop_requested:
            status = save(done, stopping=stop_requested)
            if stop_requested:
                return status
    publish_hf(model, cfg)
    return 0


def main(argv=None):
    """Train; return the exit status: 0 finished, 128 + signum stopped early by SIGTERM/SIGINT after its checkpoint."""
    return run(load_config(sys.argv[1:] if argv is None else argv))


def lost_peer(error):
    """The first line of what says that another rank died or stopped answering (a gloo/NCCL error in a
    collective, also one DCP wraps), or None."""
    causes, seen = [error], set()
    while causes:
        e = causes.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and any(
                words in str(e) for words in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                              "Timed out waiting", "NCCL communicator was aborted")):
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return re.sub(r"^\[[^\]]*\] *", "", line).split(". ")[0]  # gloo's source location and advice off
        causes += [e.__cause__, e.__context__]
        causes += [f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()]
    return None


def run(cfg, restore_signals=True):
    """Train; `restore_signals` False (the command line): SIGTERM/SIGINT stay absorbed until the process exits,
    so a signal that arrives while an error is reported (torchrun's, after a peer died) cannot cut it short."""
    rank, world_size, device = setup_distributed(cfg.device, cfg.dist_timeout_s)
    log = RunLog(os.path.join(cfg.out_dir, "eval") if cfg.eval_only else cfg.out_dir)
    stop = StopRequest()
    try:
        return train(cfg, rank, world_size, device, log, stop)
    except Exception as e:
        cause = lost_peer(e) if world_size > 1 else None
        if cause is None:
            raise
        raise PeerLost(f"lost another rank of the run (it was killed, ended with an error of its own, or its node "
                       f"failed or stopped answering: {cause}); rerun the same command to resume from the last "
                       f"checkpoint") from None
    finally:
        if restore_signals:
            stop.restore()
        if log.wandb is not None:
            log.wandb.finish()
        while LOCKS:
            os.close(LOCKS.pop())  # closing the only descriptor drops the flock
        if dist.is_initialized():
            # free what still refers to the process group (compiled graphs, FSDP state) before destroying it:
            # gloo otherwise aborts now and then at exit ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


def cli(argv=None):
    """`python train_gpt2.py ...`: main()'s exit status; an error is one line, prefixed with the rank under torchrun."""
    argv = sys.argv[1:] if argv is None else argv
    if problem := torch_version_problem():
        sys.exit(f"train_gpt2.py: error: {problem}")
    if {"-h", "--help"} & set(argv):
        print(config_help())
        sys.exit(0)
    try:
        cfg = load_config(argv)
    except (ValueError, OSError) as e:  # every rank reads the same config: rank 0 alone says what is wrong
        sys.exit(f"train_gpt2.py: error: {e}" if int(os.environ.get("RANK", 0)) == 0 else 1)
    prefix = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        sys.exit(run(cfg, restore_signals=False))
    except (ValueError, FloatingPointError, PeerLost) as e:
        sys.exit(f"{prefix}train_gpt2.py: error: {e}")
    except OSError as e:  # a file or directory the run cannot use: full disk, read-only, a file in the path
        space, write = "free some space or choose another out_dir", "choose a directory you can write to"
        not_dir = "a part of the path is a file, not a directory; choose another path"
        hints = {errno.ENOSPC: space, errno.EDQUOT: space, errno.EACCES: write, errno.EPERM: write,
                 errno.EROFS: "the filesystem is read-only; choose another directory", errno.ENOTDIR: not_dir,
                 errno.EEXIST: not_dir, errno.ENOENT: "check the path"}
        text = f"{e.filename}: {e.strerror or e}" if e.filename is not None else e.strerror or str(e)
        sys.exit(f"{prefix}train_gpt2.py: error: {text}" + (f"; {hints[e.errno]}" if e.errno in hints else ""))


if __name__ == "__main__":
    cli()
