"""GPT-2, the same model as Hugging Face's GPT2LMHeadModel, written to be read and trained.

References:
1) OpenAI's GPT-2 release: https://github.com/openai/gpt-2/blob/master/src/model.py
2) Hugging Face's implementation: transformers/models/gpt2/modeling_gpt2.py

It also reads and writes Hugging Face GPT-2 files (whole, or one FSDP2 shard at a time), so transformers,
lm-eval-harness and vLLM use what we train, and `load_model` reads a hub id, an HF directory, or a train_gpt2.py run
or one of its checkpoints. This file needs no other file of the project.
"""
import dataclasses
import json
import math
import os
import pathlib
import re
import time
import warnings
from types import SimpleNamespace

import huggingface_hub
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    padded_vocab_size: int = None  # rows of wte/lm_head, e.g. 50304 (a multiple of 64) for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True  # biases in Linears and LayerNorms, as in GPT-2
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}")


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention where the backend has it
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


# Rows of the (B*T, vocab) logits the loss head holds at once: 1024 x 50304 fp32 is 206 MB, against 1.65 GB for all
# 8 x 1024 rows, and each chunk's matmul is still large enough to run at full speed.
LOSS_CHUNK_ROWS = 1024


def _loss_chunks(x, weight, targets, chunk_size, with_grads):
    """(mean loss, grad_x, grad_weight) of cross-entropy on the logits x @ weight.T, chunk by chunk, log-sum-exp and
    softmax in fp32. The gradients (softmax - one-hot, over the count of valid targets) are taken here, in the
    forward, so no chunk's logits outlive it; with_grads=False skips them (validation, sampling)."""
    # cast once, not per chunk and per matmul as autocast would (it caches casts of leaf parameters only)
    device_type = x.device.type
    autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    valid = targets != -100  # F.cross_entropy's default ignore_index
    count = valid.sum().clamp(min=1)  # an all-ignored batch gives loss 0, not nan
    safe_targets = torch.where(valid, targets, 0)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if with_grads else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if with_grads else None
    for start in range(0, x.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        x_chunk, t_chunk, v_chunk = x[rows], safe_targets[rows, None], valid[rows]
        logits = (x_chunk @ weight.t()).float()
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + ((lse - logits.gather(1, t_chunk).squeeze(1)) * v_chunk).sum()
        if with_grads:
            probs = logits.sub_(lse[:, None]).exp_()  # softmax in place: one fp32 chunk alive at a time
            probs.scatter_add_(1, t_chunk, torch.full_like(t_chunk, -1, dtype=probs.dtype))
            grad_logits = probs.mul_(v_chunk[:, None] / count).to(weight.dtype)
            grad_x[rows] = grad_logits @ weight
            if grad_logits.dtype == torch.float32:
                torch.addmm(grad_weight, grad_logits.t(), x_chunk, out=grad_weight)  # no (vocab x C) temporary
            else:
                grad_weight += (grad_logits.t() @ x_chunk).float()
    return loss / count, grad_x, grad_weight


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean cross_entropy(x @ weight.T, targets, ignore_index=-100) without the (rows x vocab) logits: the forward
    takes the gradients chunk by chunk and keeps only grad_x and grad_weight, the backward scales them."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_size):
        loss, grad_x, grad_weight = _loss_chunks(x, weight, targets, chunk_size, with_grads=True)
        ctx.save_for_backward(grad_x.to(x.dtype), grad_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_weight = ctx.saved_tensors
        return grad_x * grad_output, grad_weight * grad_output, None, None


def chunked_cross_entropy(x, weight, targets, chunk_size=None):
    """Mean F.cross_entropy(x @ weight.T, targets, ignore_index=-100) in fp32 for x (rows, C), weight (vocab, C),
    targets (rows,), chunk_size rows (default LOSS_CHUNK_ROWS) at a time, never the full logits. A batch whose
    targets are all ignored gives loss 0 and zero gradients, where F.cross_entropy gives nan."""
    chunk_size = chunk_size or LOSS_CHUNK_ROWS
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk_size)
    return _loss_chunks(x, weight, targets, chunk_size, with_grads=False)[0]


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        rows = config.padded_vocab_size or config.vocab_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(rows, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, rows, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        # recompute each block's activations in the backward (less memory, about a third more compute); a switch,
        # not a config field, because checkpoints and exported weights are the same either way
        self.activation_checkpointing = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2 init in place, deterministic for torch's RNG state: normal(0, 0.02), residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, unit LayerNorms. Padded vocabulary rows are zero, so a padded model gets
        (and trains) exactly the numbers of an unpadded one. Call it again after building on meta and to_empty()."""
        # to_empty() after building on the meta device unties the two; tie them again before drawing anything
        if self.lm_head.weight is not self.transformer.wte.weight:
            self.lm_head.weight = self.transformer.wte.weight
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # the tied lm_head.weight is listed once, as transformer.wte.weight
            if name == "transformer.wte.weight":
                nn.init.normal_(p[:self.config.vocab_size], std=0.02)
                nn.init.zeros_(p[self.config.vocab_size:])
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=residual_std)
            elif p.dim() == 2:  # Linear and Embedding weights
                nn.init.normal_(p, std=0.02)
            elif name.endswith(".weight"):  # the only 1-D weights are LayerNorm gains
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def num_params(self, non_embedding=True):
        """Parameters as transformers counts them: the tied wte/lm_head once, real vocabulary rows only;
        non_embedding=True leaves out wpe (wte stays: it is also the output layer)."""
        n = sum(p.numel() for p in self.parameters())
        n -= (self.transformer.wte.weight.size(0) - self.config.vocab_size) * self.config.n_embd
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token as llm.c's gpt2_estimate_mfu counts them, so MFU compares with llm.c's: 6*N (every
        parameter, wpe and padded rows included, the tied weight once) + 6*L*C*T (causal attention), T = seq_len or
        block_size. About 0.80e9 for GPT-2 124M (vocab padded to 50304) at T=1024."""
        cfg = self.config
        T = seq_len or cfg.block_size
        n = sum(p.numel() for p in self.parameters())  # parameters() lists the tied weight once
        return 6 * n + 6 * cfg.n_layer * cfg.n_embd * T

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than the model's block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        checkpointing = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.transformer.h:
            # per block, as torchtitan applies it; composes with block.compile() and FSDP2's per-block fully_shard
            x = checkpoint(block, x, use_reentrant=False) if checkpointing else block(x)
        x = self.transformer.ln_f(x)
        # the padded vocabulary rows are sliced off the weight, so no logit, loss or gradient ever reaches them
        weight = self.lm_head.weight[:self.config.vocab_size]
        if targets is None:  # sampling and evaluation: the logits of the real vocabulary
            return F.linear(x, weight), None
        # training and validation: the loss alone, in fp32 (the softmax over 50K logits loses too much in bf16),
        # taken chunk by chunk so the full logits are never held; the caller must not ask for them
        return None, chunked_cross_entropy(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens, the context cropped to block_size; temperature 0 (or
        top_k=1) is greedy. Call model.eval() first."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {top_k}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float()
            if temperature == 0 or top_k == 1:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


@torch.no_grad()
def init_sharded(model, seed):
    """`torch.manual_seed(seed); model.init_weights()` of a full CPU model, bit for bit, for a plain or FSDP2 GPT on
    any device and number of ranks, never holding the full model. torch's global RNG state is left as it was."""
    if not isinstance(model.transformer.wte.weight, DTensor):
        model.lm_head.weight = model.transformer.wte.weight  # as init_weights ties a model that to_empty() untied

    def named_parameters():
        # each parameter as a full CPU tensor for init_weights to draw, of which this rank then keeps its block; every
        # rank draws every number (the generator cannot skip ahead): that costs time, not memory
        for name, p in model.named_parameters():
            local, index = local_block(p)
            full = torch.empty(p.shape, dtype=p.dtype)
            yield name, full
            local.copy_(full[index])

    tied = SimpleNamespace(weight=None)  # init_weights' tie check finds the stand-in's lm_head and wte tied
    stand_in = SimpleNamespace(config=model.config, named_parameters=named_parameters, lm_head=tied,
                               transformer=SimpleNamespace(wte=tied))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        GPT.init_weights(stand_in)


def local_block(param):
    """(the tensor this rank fills, its block of the full parameter as a tuple of slices): all of a plain tensor, the
    local shard of a DTensor. FSDP2 shards dim 0 like torch.chunk: the last ranks may hold fewer rows, or none."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(start, start + n) for start, n in zip(offset, shape))


# ----------------------------------------------------------------------------- Hugging Face GPT-2 files

# Hugging Face stores these four as Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# activation_function values that mean the tanh approximation of GELU we implement
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# the GPTConfig fields a Hugging Face checkpoint fixes (padded_vocab_size is ours to choose)
ARCHITECTURE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "layer_norm_eps", "bias")


def from_pretrained(name_or_path, padded_vocab_size=None):
    """A GPT-2 in fp32 on the CPU from a hub id ("gpt2", "gpt2-xl", "openai-community/gpt2", any GPT-2 repo) or a
    local directory with config.json and model.safetensors (or its sharded index) or pytorch_model.bin."""
    directory, config = resolve_pretrained(name_or_path)
    with torch.device("meta"):  # no random init: every parameter is read from the file
        model = GPT(dataclasses.replace(config, padded_vocab_size=padded_vocab_size))
    model.to_empty(device="cpu")
    model.lm_head.weight = model.transformer.wte.weight  # to_empty() made two Parameters of the tied one
    load_hf_sharded(model, directory)
    return model


def save_pretrained(model, save_directory, state_dict=None, max_shard_size=5 * 10**9):
    """Write config.json and model.safetensors as transformers does for GPT2LMHeadModel (numbered files and an index
    above max_shard_size bytes), from `state_dict` (our names, e.g. gathered from FSDP) or model.state_dict(). A model
    without biases is written with zero biases, the same function. Each file appears complete or not at all."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    _write_hf(save_directory, model.config, state_dict, max_shard_size, f"save_pretrained({save_directory})")


def export_hf(model, directory, max_shard_size=5 * 10**9):
    """save_pretrained for a plain or FSDP2-sharded model, a collective: parameters are gathered one at a time and
    rank 0 writes, holding one file's tensors at most. Renaming a fresh directory into place is the caller's job."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    _write_hf(directory, model.config, dict(model.named_parameters()), max_shard_size, f"export_hf({directory})",
              writer)


def resolve_pretrained(name_or_path):
    """(local directory, GPTConfig) of a Hugging Face GPT-2, a directory or a hub id (downloaded or found in the cache),
    refusing any config.json of another function. Reads no weights: every rank can call it before building on meta."""
    if os.path.isdir(name_or_path):
        directory = name_or_path
    elif os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path}: a file; expected a model directory or a Hugging Face hub id")
    else:
        try:
            directory = huggingface_hub.snapshot_download(
                name_or_path, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"])
            if not any(f.endswith(".safetensors") for f in os.listdir(directory)):  # older repos: only the pickle
                directory = huggingface_hub.snapshot_download(name_or_path, allow_patterns=["pytorch_model.bin"])
        except (OSError, ValueError) as e:  # not found, offline without a cached copy, invalid repo id
            raise FileNotFoundError(f"{name_or_path}: no such local directory, and not available from the Hugging "
                                    f"Face hub ({type(e).__name__}: {e})") from e
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; a GPT-2 model directory needs config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: not a config (a JSON {type(hf).__name__}, expected an object)")
    if hf.get("model_type") != "gpt2" and "GPT2LMHeadModel" not in (hf.get("architectures") or []):
        raise ValueError(f"{path}: not a GPT-2 config (model_type {hf.get('model_type')!r}); only the GPT-2 "
                         f"architecture is supported")
    n_embd = hf.get("n_embd", 768)
    problems = []
    if hf.get("activation_function", "gelu_new") not in TANH_GELUS:
        problems.append(f"activation_function {hf['activation_function']!r} (supported: {', '.join(TANH_GELUS)})")
    if hf.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner {hf['n_inner']} (supported: null or 4 * n_embd = {4 * n_embd})")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("a non-standard attention scaling (scale_attn_weights / scale_attn_by_inverse_layer_idx)")
    if hf.get("add_cross_attention", False):
        problems.append("cross-attention")
    if problems:
        raise ValueError(f"{path}: unsupported GPT-2 variant: {'; '.join(problems)}")
    try:
        config = GPTConfig(block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
                           vocab_size=hf.get("vocab_size", 50257), n_layer=hf.get("n_layer", 12),
                           n_head=hf.get("n_head", 12), n_embd=n_embd,
                           layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return directory, config


@torch.no_grad()
def load_hf_sharded(model, name_or_path):
    """Fill `model`, plain or FSDP2-sharded (every rank calls), from a Hugging Face GPT-2 of its config, every key and
    shape checked first. Returns "sharded" for safetensors, of which each rank reads only its shards' rows, or "full"
    for pytorch_model.bin, a pickle that cannot be read in slices: rank 0 reads it whole and broadcasts each tensor."""
    directory, config = resolve_pretrained(name_or_path)
    differ = [f"{k} {getattr(model.config, k)} (file: {getattr(config, k)})" for k in ARCHITECTURE
              if getattr(model.config, k) != getattr(config, k)]
    if differ:
        raise ValueError(f"{os.path.join(directory, 'config.json')}: the model to load into differs: "
                         f"{', '.join(differ)}")
    params = dict(model.named_parameters())  # the tied lm_head.weight is listed once, as transformer.wte.weight
    sharded = any(isinstance(p, DTensor) for p in params.values())
    device = next(iter(params.values())).device
    where, keys, sources = _open_weights(directory, config, sharded)
    pickled = where.endswith(".bin")

    def read(key, index):  # the block `index` (a tuple of slices) of file tensor `key`
        if sharded and pickled:  # rank 0 holds the tensors, the other ranks their shapes
            full = (sources[key].float() if dist.get_rank() == 0 else torch.empty(sources[key])).to(device)
            dist.broadcast(full, src=0)
            return full[index]
        if pickled:
            return sources[key][index]
        with safe_open(sources[key], "pt") as f:  # opened per tensor, so its mapped pages go once the block is read
            return f.get_slice(key)[index]

    untied = torch.zeros(1, device=device)  # whether this rank's rows of the file's lm_head.weight differ from wte
    for name, p in params.items():
        local, index = local_block(p)
        if name.endswith(CONV1D_WEIGHTS):  # our rows of a Conv1D weight are the file's columns
            local.copy_(read(keys[name], index[::-1]).t())
        elif name in ("transformer.wte.weight", "lm_head.weight"):  # lm_head.weight: a copy to_empty() untied
            in_file = (slice(min(index[0].start, config.vocab_size), min(index[0].stop, config.vocab_size)), *index[1:])
            rows = read(keys["transformer.wte.weight"], in_file)
            if "lm_head.weight" in keys:
                untied += not torch.equal(rows, read(keys["lm_head.weight"], in_file))
            local[:rows.size(0)].copy_(rows)
            local[rows.size(0):].zero_()  # the padded rows, past vocab_size
        else:
            local.copy_(read(keys[name], index))
    if sharded:  # every rank fails alike
        dist.all_reduce(untied)
    if untied.item():
        raise ValueError(f"{where}: lm_head.weight differs from wte.weight (untied output embeddings are not "
                         f"supported)")
    return "full" if pickled else "sharded"


def _open_weights(directory, config, sharded):
    """(name for messages, {our name: file key}, {key: source}) of the weight files, checked against `config`. A
    source is a safetensors file, read later in slices, or a pickle's tensor (its shape where only rank 0 unpickles)."""
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")  # the first found is read
    found = [os.path.join(directory, name) for name in names if os.path.isfile(os.path.join(directory, name))]
    if not found:
        raise FileNotFoundError(f"{directory}: no weights (model.safetensors, model.safetensors.index.json or "
                                f"pytorch_model.bin)")
    where, paths = found[0], found[:1]
    if where.endswith(".json"):
        try:
            with open(where) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{where}: not a safetensors index (expected JSON with a weight_map; {e!r})") from e
        where, paths = f"{where} ({len(files)} shards)", [os.path.join(directory, name) for name in files]
    from_rank0 = sharded and where.endswith(".bin")
    shapes, sources, error = {}, {}, None
    if not from_rank0 or dist.get_rank() == 0:
        try:
            for path in paths:
                if path.endswith(".bin"):
                    sources.update(torch.load(path, map_location="cpu", weights_only=True))
                    shapes.update((key, tuple(t.shape)) for key, t in sources.items())
                else:
                    with safe_open(path, "pt") as f:  # the header only
                        for key in f.keys():
                            shapes[key], sources[key] = tuple(f.get_slice(key).get_shape()), path
        except Exception as e:  # whatever the parser says, the file is the problem: name it
            error = f"{path}: not a readable weights file ({type(e).__name__}: {e})"
    if from_rank0:  # rank 0's shapes, or its error: every rank fails alike, none waits for rank 0 in vain
        box = [(shapes, error)]
        dist.broadcast_object_list(box, src=0)
        shapes, error = box[0]
        sources = sources if dist.get_rank() == 0 else shapes
    if error:
        raise ValueError(error)
    # both layouts of real files pass: keys with or without the "transformer." prefix, lm_head.weight or not, and
    # the attn.bias / attn.masked_bias causal-mask buffers of older transformers versions, which are not weights
    expected = _hf_shapes(config)
    expected["lm_head.weight"] = expected["transformer.wte.weight"]  # the tied weight again, or not there
    keys = {}  # our name -> the file's key
    for key in shapes:
        name = key if key.startswith("transformer.") or key == "lm_head.weight" else "transformer." + key
        if name in expected or not name.endswith((".attn.bias", ".attn.masked_bias")):
            keys[name] = key
    problems = [f"unexpected tensor {key}" for name, key in keys.items() if name not in expected]
    problems += [f"{key} has shape {shapes[key]}, expected {expected[name]}"
                 for name, key in keys.items() if name in expected and shapes[key] != expected[name]]
    problems += [f"missing tensor {name}" for name in expected if name not in keys and name != "lm_head.weight"]
    if problems:
        raise ValueError(f"{where}: does not match its config.json ({config.n_layer} layers, n_embd {config.n_embd}, "
                         f"vocab {config.vocab_size}, context {config.block_size}): {_first_five(problems)}")
    return where, keys, sources


def _hf_shapes(config):
    """Tensor name -> shape in the Hugging Face file (Conv1D layout) for a GPT-2 with biases and no padding."""
    with torch.device("meta"):
        model = GPT(dataclasses.replace(config, padded_vocab_size=None, bias=True))
    return {name: _file_shape(name, p.shape, config.vocab_size)
            for name, p in model.state_dict().items() if name != "lm_head.weight"}


def _file_shape(name, shape, vocab_size):
    """The shape our parameter `name` has in the file: wte without padded rows, Conv1D weights transposed."""
    if name == "transformer.wte.weight":
        shape = (min(shape[0], vocab_size), *shape[1:])
    return tuple(reversed(shape) if name.endswith(CONV1D_WEIGHTS) else shape)


def _first_five(problems):
    return "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")


@torch.no_grad()
def _write_hf(directory, cfg, state_dict, max_shard_size, who, writer=True):
    """Check `state_dict` (our names and layout) against `cfg`, then write the Hugging Face directory; DTensors are
    gathered one at a time (a collective every rank joins), and only the `writer` writes."""
    expected = _hf_shapes(cfg)
    zero_biases = [] if cfg.bias else [name for name in expected if name.endswith(".bias")]
    shapes = {name: _file_shape(name, t.shape, cfg.vocab_size) for name, t in state_dict.items()}
    problems = [f"unexpected tensor {name}" for name in shapes if name not in expected and name != "lm_head.weight"]
    problems += [f"{name} has shape {shape} in the file layout, expected {expected[name]}"
                 for name, shape in shapes.items() if name in expected and shape != expected[name]]
    problems += [f"missing tensor {name}" for name in expected if name not in state_dict and name not in zero_biases]
    if problems:
        raise ValueError(f"{who}: the state dict does not fit this model's config: {_first_five(problems)}")
    dtype = state_dict["transformer.wte.weight"].dtype

    def file_tensor(name):
        if name in zero_biases:  # a model without biases computes what one with zero biases does
            return torch.zeros(expected[name], dtype=dtype)
        tensor = state_dict[name]
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if name == "transformer.wte.weight":
            tensor = tensor[:cfg.vocab_size]
        return (tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor).cpu().contiguous() if writer else None

    def write_json(name, obj):
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
        _publish(os.path.join(directory, name), lambda tmp: pathlib.Path(tmp).write_text(text))

    # transformers' own sharding: tensors in state-dict order, a new file when the next would pass max_shard_size
    split = huggingface_hub.split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=state_dict[name].dtype if name in state_dict else dtype, device="meta")
         for name, shape in expected.items()}, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        tensors = {name: file_tensor(name) for name in names}  # gathered by every rank, kept by the writer
        if writer:
            os.makedirs(directory, exist_ok=True)
            _publish(os.path.join(directory, filename), lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if not writer:
        return
    written = set(split.filename_to_tensors)
    if split.is_sharded:
        written.add("model.safetensors.index.json")
        write_json("model.safetensors.index.json",
                   {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
    # GPT-2's <|endoftext|>, said outright: transformers would assume it even where the vocabulary has no such id
    endoftext = 50256 if cfg.vocab_size > 50256 else None
    write_json("config.json", {  # transformers' config.json for GPT2LMHeadModel
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "tie_word_embeddings": True,
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": endoftext, "eos_token_id": endoftext})
    for stale in set(os.listdir(directory)) - written:  # weights of an earlier save that readers would mix in
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(directory, stale))


def _publish(path, write):
    """`write(tmp)` a hidden file beside `path`, then rename it over `path`: a reader never sees half a file."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # safetensors creates 0600 files
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------- train_gpt2.py's checkpoints, read

# A checkpoint directory out_dir/ckpt/step_NNNNNNNN/ holds the DCP files of model and optimizer, train_state.json
# (step, consumed samples, architecture, config) and rng.pt. It is complete once MARKER is in it: train_gpt2.py
# writes the marker last, after every other file and the directory were fsynced.
MARKER = "complete.json"

# a checkpoint saved or loaded without a process group is meant to be: one process trains, or reads, it whole
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def complete_checkpoints(ckpt_root):
    """Paths of the complete checkpoints under ckpt_root, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    names = [name for name in os.listdir(ckpt_root) if re.fullmatch(r"step_\d{8}", name)]
    return sorted(os.path.join(ckpt_root, name) for name in names
                  if os.path.isfile(os.path.join(ckpt_root, name, MARKER)))


def read_train_state(ckpt_path):
    with open(os.path.join(ckpt_path, "train_state.json"), encoding="utf-8") as f:
        return json.load(f)


def check_checkpoint(path):
    """None when the files of checkpoint `path` are all there and readable, else why not (naming the file). Cheap:
    reads train_state.json, rng.pt and .metadata, and checks each file's size against what was written."""
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
            if os.path.getsize(name) < end:
                return f"{name}: truncated ({os.path.getsize(name)} bytes, .metadata needs {end})"
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
    renamed aside, never deleted. One process only (train_gpt2's rank 0 broadcasts the choice)."""
    messages = []
    for path in reversed(complete_checkpoints(ckpt_root)):
        problem = check_checkpoint(path)
        if problem is None:
            return path, messages
        messages.append(f"skipping damaged checkpoint {path}: {problem}; kept as {set_aside(path, 'damaged')}")
    return None, messages


def is_run_or_checkpoint(path):
    """Whether `path` is what train_gpt2.py writes: an out_dir (with ckpt/) or one checkpoint directory."""
    return os.path.isdir(os.path.join(path, "ckpt")) or os.path.isfile(os.path.join(path, "train_state.json"))


def resolve_checkpoint(path):
    """A checkpoint directory, or the newest complete checkpoint of a train_gpt2 out_dir."""
    if os.path.isfile(os.path.join(path, "train_state.json")):
        return path
    found = complete_checkpoints(os.path.join(path, "ckpt"))
    if not found:
        raise FileNotFoundError(f"{path}: neither a checkpoint directory nor an out_dir with a complete checkpoint "
                                f"under ckpt/")
    return found[-1]


def load_weights(ckpt_path, model):
    """Load only the model weights of a checkpoint into `model` (plain or sharded, any number of ranks)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=ckpt_path)
    set_model_state_dict(model, state["model"])


def load_model(name_or_path):
    """A GPT in fp32 on the CPU from a hub name, an HF GPT-2 directory, or a training out_dir / checkpoint
    directory (with the architecture stored in the checkpoint). Call it where no process group is initialised."""
    if os.path.isdir(name_or_path) and is_run_or_checkpoint(name_or_path):
        ckpt_path = resolve_checkpoint(name_or_path)
        model = GPT(GPTConfig(**read_train_state(ckpt_path)["model_config"]))
        load_weights(ckpt_path, model)
        return model
    if not os.path.exists(name_or_path) and name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name_or_path}: no such model directory")
    return from_pretrained(name_or_path)
