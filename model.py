"""GPT-2, the same model as Hugging Face's GPT2LMHeadModel, written to be read and trained.

References:
1) OpenAI's GPT-2 release: https://github.com/openai/gpt-2/blob/master/src/model.py
2) Hugging Face's implementation: transformers/models/gpt2/modeling_gpt2.py

Hugging Face GPT-2 files load and export here too (whole, or one FSDP2 shard at a time), so transformers,
lm-eval-harness and vLLM use what we train; and `load_model` reads anything a user may name: a hub id, an HF
directory, a train_gpt2.py run or one of its checkpoints. This file needs no other file of the project.
"""
import dataclasses
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from functools import partial
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


@dataclass
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
    """(summed loss, grad_x, grad_weight) of the mean cross-entropy of the logits x @ weight.T, chunk by chunk.
    The matmuls run in the dtype autocast (or the inputs) give them; log-sum-exp and softmax run in fp32. Gradients
    (softmax - one-hot, over the count of non-ignored targets) are taken here, in the forward, so no chunk's logits
    outlive it; with_grads=False skips them (validation, sampling). grad_weight accumulates in fp32."""
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
    """The loss of a linear output layer: mean F.cross_entropy(x @ weight.T, targets, ignore_index=-100) in fp32
    for x (rows, C), weight (vocab, C), targets (rows,), never materialising the full logits. chunk_size rows
    (default LOSS_CHUNK_ROWS) are processed at a time. Unlike F.cross_entropy, a batch whose targets are all ignored
    gives loss 0 and zero gradients instead of nan."""
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
        # recompute each block's activations in the backward instead of keeping them (torch.utils.checkpoint): less
        # memory for bigger models or batches, about a third more compute. A switch, not a config field: checkpoints
        # and exported weights are the same either way.
        self.activation_checkpointing = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2 init in place: normal(0, 0.02) weights, the two residual projections per block scaled down by
        1/sqrt(2 * n_layer), zero biases, unit LayerNorms. Deterministic for torch's RNG state; the padded vocabulary
        rows are zero, so from the same RNG state a padded model gets (and trains) exactly the numbers of an unpadded
        one. GPT(config) calls it; call it again after building on the meta device and to_empty()."""
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
        """Parameters of the model, counting the tied wte/lm_head once and the real vocabulary rows only (padding
        is a speed trick, not part of the model). non_embedding=True leaves out the position embeddings (wpe);
        the token embeddings stay in because they are also the output layer."""
        n = sum(p.numel() for p in self.parameters())
        n -= (self.transformer.wte.weight.size(0) - self.config.vocab_size) * self.config.n_embd
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len=None):
        """Training (forward + backward) FLOPs per token in llm.c's convention (train_gpt2.cu, gpt2_estimate_mfu),
        so MFU compares with llm.c's: 6*N + 6*L*C*T, N = every parameter as llm.c counts them (wpe and the padded
        vocabulary rows included, the tied wte/lm_head once), L layers, C = n_embd, T = seq_len (default
        block_size); 6*L*C*T is causal attention (half of the T x T square). About 0.80e9 for GPT-2 124M (vocab
        padded to 50304) at T=1024."""
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
        """Extend the LongTensor idx (B, T) by max_new_tokens sampled tokens. temperature 0 (or top_k=1) picks the
        most likely token; the context is cropped to the last block_size tokens. Call model.eval() first."""
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


# ----------------------------------------------------------------------------- GPT-2 init, one shard at a time

@torch.no_grad()
def init_sharded(model, seed):
    """The weights of `torch.manual_seed(seed); model.init_weights()` on a full model on the CPU, bit for bit, for a
    plain or FSDP2-sharded GPT on any device and any number of ranks, never the full model: init_weights itself runs,
    on a stand-in whose parameters are full CPU tensors handed out one at a time (two exist for a moment, the one
    drawn and the one before), and each rank keeps its own rows of each. Every rank draws every number (the
    generator cannot skip ahead): that costs time, not memory. torch's global RNG state is left as it was."""
    if not isinstance(model.transformer.wte.weight, DTensor):
        model.lm_head.weight = model.transformer.wte.weight  # as init_weights ties a model that to_empty() untied
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        GPT.init_weights(_OneParameterAtATime(model))


class _OneParameterAtATime:
    """A stand-in for a GPT in GPT.init_weights: named_parameters() hands out each parameter of `model` as a full
    CPU tensor and, once init_weights has moved on to the next one, copies this rank's block of it into `model`."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        tied = SimpleNamespace(weight=None)
        self.lm_head, self.transformer = tied, SimpleNamespace(wte=tied)  # init_weights' tie check finds them tied

    def named_parameters(self):
        for name, p in self.model.named_parameters():
            local, index = local_block(p)
            full = torch.empty(p.shape, dtype=p.dtype)
            yield name, full
            local.copy_(full[index])


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
    """Write config.json and model.safetensors in the layout transformers writes for GPT2LMHeadModel: padded rows
    trimmed, Conv1D weights transposed back, lm_head left out (tied); above max_shard_size bytes, numbered files and
    model.safetensors.index.json, as transformers shards. `state_dict` (our key names, e.g. a full state dict
    gathered from FSDP) replaces model.state_dict(). A model without biases is written with zero biases, which
    compute the same function. Each file appears complete or not at all."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    _write_hf(save_directory, model.config, state_dict, max_shard_size, f"save_pretrained({save_directory})")


def resolve_pretrained(name_or_path):
    """(local directory, GPTConfig) of a Hugging Face GPT-2: a directory as is, a hub id downloaded (or found in the
    cache). Reads config.json only, so every rank can call it before building the model on the meta device."""
    directory = _model_directory(name_or_path)
    return directory, _read_config(os.path.join(directory, "config.json"))


@torch.no_grad()
def load_hf_sharded(model, name_or_path):
    """Fill `model`, a GPT whose config matches the checkpoint's (padding aside), from a Hugging Face GPT-2 directory
    or hub id, every key and shape checked first. A plain model is filled whole. For a model sharded with FSDP2
    (every rank calls this) each rank reads from the safetensors files only the rows its shards hold, so no rank
    ever holds the full model: returns "sharded". A pytorch_model.bin is a pickle, which cannot be read in slices:
    rank 0 reads it whole and sends one tensor at a time to every rank: returns "full"."""
    directory, config = resolve_pretrained(name_or_path)
    _check_fits(model.config, config, os.path.join(directory, "config.json"))
    params = dict(model.named_parameters())  # the tied lm_head.weight is listed once, as transformer.wte.weight
    sharded = any(isinstance(p, DTensor) for p in params.values())
    device = next(iter(params.values())).device
    where, paths = _weight_files(directory)
    pickled = paths[0].endswith(".bin")
    shapes, sources = _open_weights(paths, from_rank0=sharded and pickled)
    keys = _match_layout(where, config, shapes)

    def read(key, index):  # the block `index` (a tuple of slices) of file tensor `key`
        if not (sharded and pickled):
            return _read_slice(sources[key], key, index)
        full = (sources[key].float() if dist.get_rank() == 0 else torch.empty(shapes[key])).to(device)
        dist.broadcast(full, src=0)
        return full[index]

    for name, p in params.items():
        local, index = local_block(p)
        name = "transformer.wte.weight" if name == "lm_head.weight" else name  # an untied copy of the same weight
        _fill_param(local, read, keys[name], name, index, config.vocab_size)
    if "lm_head.weight" in keys:  # tied in the file as well? each rank compares its rows, then all ranks agree
        rows, columns = local_block(model.transformer.wte.weight)[1]
        rows = (_real_rows(rows, config.vocab_size), columns)
        same = torch.equal(read("lm_head.weight", rows), read(keys["transformer.wte.weight"], rows))
        differs = torch.tensor([0 if same else 1], device=device)
        if sharded:
            dist.all_reduce(differs)
        if differs.item():
            untied = "lm_head.weight differs from wte.weight (untied output embeddings are not supported)"
            raise ValueError(_mismatch(where, config, [untied]))
    return "full" if pickled else "sharded"


def export_hf(model, directory, max_shard_size=5 * 10**9):
    """Collective (every rank calls it): write `model`, plain or sharded with FSDP2, as save_pretrained does, from
    rank 0. Each parameter is gathered alone and moved to the CPU at once, so no GPU ever holds the full model, and
    rank 0 holds at most one file's tensors (max_shard_size bytes). Each file appears complete or not at all; writing
    into a fresh directory and renaming it once every rank has returned is the caller's job."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    _write_hf(directory, model.config, dict(model.named_parameters()), max_shard_size, f"export_hf({directory})",
              writer)


@torch.no_grad()
def _write_hf(directory, cfg, state_dict, max_shard_size, who, writer=True):
    """Check `state_dict` (our names and layout) against `cfg`, then write the Hugging Face directory. DTensors are
    gathered one at a time, a collective every rank joins; only the `writer` writes."""
    expected = _hf_shapes(cfg)
    problems = []
    for name, tensor in state_dict.items():
        if name == "lm_head.weight":
            continue
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
        elif _file_shape(name, tensor.shape, cfg.vocab_size) != expected[name]:
            problems.append(f"{name} has shape {_file_shape(name, tensor.shape, cfg.vocab_size)} in the file layout, "
                            f"expected {expected[name]}")
    zero_biases = [] if cfg.bias else [name for name in expected if name.endswith(".bias")]
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

    # transformers' own sharding: tensors in state-dict order, a new file when the next would pass max_shard_size
    split = huggingface_hub.split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=state_dict[name].dtype if name in state_dict else dtype, device="meta")
         for name, shape in expected.items()}, max_shard_size=max_shard_size)
    if writer:
        os.makedirs(directory, exist_ok=True)
    for filename, names in split.filename_to_tensors.items():
        tensors = {name: file_tensor(name) for name in names}  # gathered by every rank, kept by the writer
        if writer:
            _publish(os.path.join(directory, filename), partial(save_file, tensors, metadata={"format": "pt"}))
    if not writer:
        return
    written = set(split.filename_to_tensors)
    if split.is_sharded:
        written.add("model.safetensors.index.json")
        _write_json(os.path.join(directory, "model.safetensors.index.json"),
                    {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
    _write_json(os.path.join(directory, "config.json"), _hf_config(cfg, dtype))
    for stale in set(os.listdir(directory)) - written:  # weights of an earlier save that readers would mix in
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(directory, stale))


def _hf_config(cfg, dtype):
    """transformers' config.json for GPT2LMHeadModel with our architecture."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": 0.0,  # we train without dropout
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # GPT-2's <|endoftext|>; transformers would default to it even where the vocabulary has no such id
        "bos_token_id": 50256 if cfg.vocab_size > 50256 else None,
        "eos_token_id": 50256 if cfg.vocab_size > 50256 else None,
    }


def _write_json(path, obj):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    _publish(path, write)


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


def _model_directory(name_or_path):
    """A local directory as is; anything else is a hub repo id, fetched (or found in the cache) by huggingface_hub."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path}: a file; expected a model directory or a Hugging Face hub id")
    try:
        directory = huggingface_hub.snapshot_download(
            name_or_path, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"])
        if not any(f.endswith(".safetensors") for f in os.listdir(directory)):  # older repos: only the pickle
            directory = huggingface_hub.snapshot_download(name_or_path, allow_patterns=["pytorch_model.bin"])
    except (OSError, ValueError) as e:  # not found, offline without a cached copy, invalid repo id
        raise FileNotFoundError(f"{name_or_path}: no such local directory, and not available from the Hugging Face "
                                f"hub ({type(e).__name__}: {e})") from e
    return directory


def _read_config(path):
    """GPTConfig from a Hugging Face GPT-2 config.json, refusing anything that would compute a different function."""
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
        return GPTConfig(block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
                         vocab_size=hf.get("vocab_size", 50257), n_layer=hf.get("n_layer", 12),
                         n_head=hf.get("n_head", 12), n_embd=n_embd, layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _check_fits(model_config, config, path):
    """The model to fill has the architecture of config.json at `path` (its padded vocabulary rows aside)."""
    differ = [f"{k} {getattr(model_config, k)} (file: {getattr(config, k)})" for k in ARCHITECTURE
              if getattr(model_config, k) != getattr(config, k)]
    if differ:
        raise ValueError(f"{path}: the model to load into differs: {', '.join(differ)}")


def _weight_files(directory):
    """(file name(s) for messages, paths): model.safetensors, the files of its sharded index, or pytorch_model.bin."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    pickled = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(single):
        return single, [single]
    if os.path.isfile(pickled) and not os.path.isfile(index):
        return pickled, [pickled]
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{directory}: no weights (model.safetensors, model.safetensors.index.json or "
                                f"pytorch_model.bin)")
    try:
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (expected JSON with a weight_map; {e!r})") from e
    return f"{index} ({len(files)} shards)", [os.path.join(directory, name) for name in files]


def _open_weights(paths, from_rank0=False):
    """({key: shape}, {key: source}) of the weight files: a source is the safetensors file, read lazily in slices, or
    the tensor of an unpickled pytorch_model.bin. from_rank0: only rank 0 unpickles; the others get its shapes (or
    its error, so that every rank fails alike)."""
    if from_rank0:
        shapes, sources, error = {}, {}, None
        if dist.get_rank() == 0:
            try:
                shapes, sources = _open_weights(paths)
            except ValueError as e:
                error = str(e)
        box = [(shapes, error)]
        dist.broadcast_object_list(box, src=0)
        shapes, error = box[0]
        if error:
            raise ValueError(error)
        return shapes, sources
    shapes, sources = {}, {}
    for path in paths:
        try:
            if path.endswith(".bin"):
                sources.update(torch.load(path, map_location="cpu", weights_only=True))
                shapes.update((key, tuple(t.shape)) for key, t in sources.items())
            else:
                with safe_open(path, "pt") as f:  # the header only
                    for key in f.keys():
                        shapes[key], sources[key] = tuple(f.get_slice(key).get_shape()), path
        except Exception as e:  # whatever the parser says, the file is the problem: name it
            raise ValueError(f"{path}: not a readable weights file ({type(e).__name__}: {e})") from e
    return shapes, sources


def _match_layout(where, config, shapes):
    """{our name: file key} for the file's {key: shape}, or one error listing every key and shape that does not fit.
    Both layouts of real files pass: with or without the "transformer." prefix, with or without the attn.bias /
    attn.masked_bias causal-mask buffers, lm_head.weight present or not."""
    expected = _hf_shapes(config)
    keys, problems = {}, []
    for key, shape in shapes.items():
        name = key if key.startswith("transformer.") or key == "lm_head.weight" else "transformer." + key
        if name.endswith((".attn.bias", ".attn.masked_bias")) and name not in expected:
            continue  # causal-mask buffers of older transformers versions, not weights
        keys[name] = key
        want = expected["transformer.wte.weight"] if name == "lm_head.weight" else expected.get(name)
        if want is None:
            problems.append(f"unexpected tensor {key}")
        elif shape != want:
            problems.append(f"{key} has shape {shape}, expected {want}")
    problems += [f"missing tensor {name}" for name in expected if name not in keys]
    if problems:
        raise ValueError(_mismatch(where, config, problems))
    return keys


def _mismatch(where, config, problems):
    return (f"{where}: does not match its config.json ({config.n_layer} layers, n_embd {config.n_embd}, vocab "
            f"{config.vocab_size}, context {config.block_size}): {_first_five(problems)}")


def _fill_param(local, read, key, name, index, vocab_size):
    """Fill `local`, block `index` of our parameter `name`, from file tensor `key`: our rows of a Conv1D weight are
    the file's columns, and wte's rows past vocab_size are padding: zeros."""
    if name.endswith(CONV1D_WEIGHTS):
        local.copy_(read(key, index[::-1]).t())
    elif name == "transformer.wte.weight":
        real = read(key, (_real_rows(index[0], vocab_size), *index[1:]))
        local[:real.size(0)].copy_(real)
        local[real.size(0):].zero_()
    else:
        local.copy_(read(key, index))


def _real_rows(rows, vocab_size):
    return slice(min(rows.start, vocab_size), min(rows.stop, vocab_size))


def _read_slice(source, key, index):
    """tensor[index] of a loaded tensor, or of tensor `key` of safetensors file `source`, reading only that block.
    The file is opened per tensor so that its mapped pages go when the block is read."""
    if isinstance(source, torch.Tensor):
        return source[index]
    with safe_open(source, "pt") as f:
        return f.get_slice(key)[index]


def _first_five(problems):
    return "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")


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
