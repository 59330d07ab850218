"""GPT-2 as transformers' GPT2LMHeadModel computes it, written to be edited: the activation, the
loss and the blocks each live in one place. Also Hugging Face files in and out (per FSDP2 shard too)
and the reading of train_gpt2.py's checkpoints. It imports no other file of the project."""
import ctypes
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import shutil
import sys
import time
import warnings

import huggingface_hub
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# The MLP's activation, keyed by the name a Hugging Face config.json gives it (activation_function,
# a key of transformers.activations.ACT2FN), so that an export runs in transformers as it trained
# here. To try another activation, add it here under the name transformers knows it by.
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # the same, by another name
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Primer, modded-nanogpt)
    "silu": F.silu,
}


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    # rows of wte and lm_head, e.g. 50304 (a multiple of 64): aligned matmuls run faster
    padded_vocab_size: int = None
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True  # biases in Linears and LayerNorms, as in GPT-2
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"  # a key of ACTIVATIONS

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} is smaller than "
                             f"vocab_size={self.vocab_size}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; "
                             f"choose one of {', '.join(ACTIVATIONS)}")


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding width (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)
        # move the heads forward to be a batch dimension: (B, n_head, T, head size)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # flash attention where the backend has it; is_causal masks the future without a (T, T) mask
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.activation = ACTIVATIONS[config.activation]
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.activation(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------- the loss head

def chunk_loss(logits, targets):
    """The summed loss of one chunk of rows: logits (rows, vocab_size) in the matmul's dtype,
    targets (rows,) with -100 where a position is not scored. Edit this to change the loss (a
    z-loss, a soft cap on the logits): the head differentiates it with autograd, nothing else."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def _real_vocab_chunk_loss(logits, targets, vocab_size):
    # The head's matmul runs over the padded weight, whose aligned shape is faster. Slicing off the
    # padded columns keeps them out of the softmax whatever chunk_loss does. chunk_loss is looked up
    # at each call (torch.compile guards on it), so an edited one is the one that runs.
    return chunk_loss(logits[:, :vocab_size], targets)


@functools.cache
def _compiled_chunk_loss():
    # Compiled on first use rather than at import, because importing the compiler takes a second.
    # AOTAutograd derives the backward; Inductor fuses each direction into a few passes.
    return torch.compile(_real_vocab_chunk_loss)


# Logits the loss head holds at once (rows x vocabulary rows of the weight): 8,192 and 128 rows of
# GPT-2's 50,304. Fewer hold less memory; more make each matmul larger and spread the per-chunk
# cost of adding into the fp32 weight gradient. On the CPU, chunks under glibc's 32 MiB mmap
# threshold are reused from the heap, not faulted in afresh. A small vocabulary gets more rows:
# per-chunk overhead, not memory, is then what counts.
LOSS_CHUNK_LOGITS = dict(cuda=8192 * 50304, cpu=128 * 50304)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The mean of chunk_loss over x @ weight.T, one chunk of rows at a time. The forward also takes
    each chunk's gradients (autograd's, of chunk_loss), so no chunk's logits outlive their turn in
    the loop; the backward only scales them."""

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size, chunk_size, compiled, with_grads):
        x_dtype, weight_dtype = x.dtype, weight.dtype
        device = x.device.type  # meta (FLOP counting) has no autocast to ask about
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            # cast once here, not per chunk as autocast would (it caches leaf parameters only)
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
        loss_fn = _compiled_chunk_loss() if compiled else _real_vocab_chunk_loss
        count = (targets != -100).sum().clamp(min=1)  # an all-ignored batch gives loss 0, not nan
        chunks = [slice(start, start + chunk_size) for start in range(0, len(x), chunk_size)]
        if not with_grads:  # evaluation: the loss alone
            loss = sum(loss_fn(x[rows] @ weight.t(), targets[rows], vocab_size) for rows in chunks)
            return loss / count
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        for rows in chunks:
            logits = (x[rows] @ weight.t()).requires_grad_(True)
            with torch.enable_grad():
                chunk = loss_fn(logits, targets[rows], vocab_size)
            # the gradient of this chunk's share of the mean loss; then the head's own two matmuls
            (grad_logits,) = torch.autograd.grad(chunk, logits, grad_outputs=1 / count)
            loss += chunk.detach()
            torch.mm(grad_logits, weight, out=grad_x[rows])
            if grad_logits.dtype == torch.float32:
                # in place, so no temporary (addmm's out= form, which torch's FLOP counter sees)
                torch.addmm(grad_weight, grad_logits.t(), x[rows], out=grad_weight)
            else:
                grad_weight += grad_logits.t() @ x[rows]  # 16-bit products, summed in fp32
        ctx.save_for_backward(grad_x.to(x_dtype), grad_weight.to(weight_dtype))
        return loss / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_weight = ctx.saved_tensors
        # in place, because the weight gradient is as large as the weight and the backward runs once
        return grad_x * grad_output, grad_weight.mul_(grad_output), None, None, None, None, None


# Dynamo cannot trace the autograd.grad in the head's forward. Inside a whole-model torch.compile
# the head runs as it does outside one, and compile_loss compiles its chunks.
@torch.compiler.disable
def chunked_cross_entropy(x, weight, targets, chunk_size=None, vocab_size=None, compiled=False):
    """Mean chunk_loss of x @ weight[:vocab_size].T over the scored targets, chunk by chunk."""
    if chunk_size is None:
        budget = LOSS_CHUNK_LOGITS.get(x.device.type, LOSS_CHUNK_LOGITS["cuda"])
        chunk_size = max(1, budget // weight.size(0))
    vocab_size = vocab_size or weight.size(0)
    # Validation needs no gradients, and then the head computes the loss alone.
    with_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return ChunkedLinearCrossEntropy.apply(x, weight, targets, vocab_size, chunk_size, compiled,
                                           with_grads)


# ----------------------------------------------------------------------------- the model

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
        # Switches rather than config fields, because a checkpoint is the same either way.
        # activation_checkpointing recomputes each block in the backward: less memory, more compute
        self.activation_checkpointing = False
        self.compile_loss = False  # torch.compile the loss head's chunks, as the blocks are
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, named_parameters=None):
        """GPT-2's init in place (also after meta and to_empty()); padded rows are zero."""
        # Tied here rather than in __init__, because to_empty() makes two of the tied parameter.
        self.lm_head.weight = self.transformer.wte.weight
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)  # GPT-2's for residual projections
        # named_parameters() lists the tied weight once, as transformer.wte.weight
        for name, p in named_parameters or self.named_parameters():
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
        """Parameters as transformers counts them (real vocabulary rows), less wpe's if asked."""
        n = sum(p.numel() for p in self.parameters())
        n -= (self.transformer.wte.weight.size(0) - self.config.vocab_size) * self.config.n_embd
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len=None):
        """llm.c's count (gpt2_estimate_mfu): 6 per parameter, plus 6*L*C*T for attention."""
        n = sum(p.numel() for p in self.parameters())  # the tied weight counts once
        T = seq_len or self.config.block_size
        return 6 * n + 6 * self.config.n_layer * self.config.n_embd * T

    def forward(self, idx, targets=None, logits_at=None):
        """(logits, None) without targets, (None, mean loss) with them. logits_at, a pair of index
        tensors (rows, positions), asks for the logits there only (HellaSwag scores its endings)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than the model's block_size "
                             f"{self.config.block_size}")
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
        checkpointing = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.transformer.h:
            if checkpointing:  # per block, as torchtitan does: it composes with compile and FSDP2
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:  # the loss alone: a training batch's logits are never held at once
            loss = chunked_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                         vocab_size=self.config.vocab_size,
                                         compiled=self.compile_loss)
            return None, loss
        if logits_at is not None:
            x = x[logits_at]
        # the matmul runs over the padded weight (aligned); only the real vocabulary comes out
        logits = F.linear(x, self.lm_head.weight)[..., :self.config.vocab_size]
        return logits.contiguous(), None

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """idx (B, T) and max_new_tokens sampled tokens after it; temperature 0 is greedy."""
        if temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"temperature must be >= 0 and top_k None or >= 1, "
                             f"got {temperature} and {top_k}")
        for _ in range(max_new_tokens):
            # crop the context to block_size, and keep the logits at the last position only
            logits = self(idx[:, -self.config.block_size:])[0][:, -1, :].float()
            if temperature == 0 or top_k == 1:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits[logits < kth] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


@torch.no_grad()
def init_sharded(model, seed):
    """`torch.manual_seed(seed); model.init_weights()` bit for bit, for a plain or FSDP2 GPT."""

    def named_parameters():
        # Every rank draws each parameter whole on the CPU, because the generator cannot skip ahead
        # to a shard's numbers; each rank then keeps its own block.
        for name, p in model.named_parameters():
            local, index = local_block(p)
            full = torch.empty(p.shape, dtype=p.dtype)
            yield name, full
            local.copy_(full[index])

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model.init_weights(named_parameters())


def local_block(param):
    """(the tensor this rank holds, its block of the full parameter as a tuple of slices)."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return param.to_local(), tuple(slice(start, start + n) for start, n in zip(offset, shape))


# ------------------------------------------------------------------------- Hugging Face GPT-2 files

# Hugging Face stores these four as Conv1D, whose weight is (in, out): the transpose of nn.Linear's.
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")

# config.json's keys and the GPTConfig fields they set; n_positions comes after n_ctx, so it wins
HF_CONFIG_KEYS = dict(n_ctx="block_size", n_positions="block_size", vocab_size="vocab_size",
                      n_layer="n_layer", n_head="n_head", n_embd="n_embd",
                      layer_norm_epsilon="layer_norm_eps", activation_function="activation")


def from_pretrained(name_or_path, padded_vocab_size=None):
    """A GPT-2 in fp32 on the CPU from a hub id ("gpt2") or a Hugging Face directory."""
    directory, config = resolve_pretrained(name_or_path)
    with torch.device("meta"):  # no random init: every parameter is read from the file
        model = GPT(dataclasses.replace(config, padded_vocab_size=padded_vocab_size))
    model.to_empty(device="cpu")
    model.lm_head.weight = model.transformer.wte.weight  # to_empty() made two of the tied one
    load_hf_sharded(model, directory)
    return model


def resolve_pretrained(name_or_path):
    """(local directory, GPTConfig) of a Hugging Face directory or hub id; reads no weights."""
    directory = name_or_path
    if not os.path.isdir(directory):
        if os.path.exists(directory) or directory.startswith((".", "/", "~")):
            raise FileNotFoundError(f"{directory}: no such model directory")
        try:  # the config and the safetensors only: never a pickle, nor another framework's weights
            patterns = ["config.json", "*.safetensors", "*.safetensors.index.json"]
            directory = huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns)
        except (OSError, ValueError) as e:  # not found, offline and not cached, an invalid id
            raise FileNotFoundError(f"{name_or_path}: no such local directory, and not available "
                                    f"online ({e!r})") from e
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; a GPT-2 model directory needs config.json (a "
                                f"train_gpt2.py run is read from its out_dir or from one "
                                f"checkpoint, out_dir/ckpt/step_N)")
    try:
        return directory, config_from_hf(json.loads(pathlib.Path(path).read_text()))
    except ValueError as e:  # not JSON, or a config we do not compute: one line naming the file
        raise ValueError(f"{path}: {e}") from e


def config_from_hf(hf):
    """The GPTConfig of a config.json's contents; ValueError for a variant we do not compute."""
    if not isinstance(hf, dict):
        raise ValueError(f"not a config (a JSON {type(hf).__name__}, expected an object)")
    if hf.get("model_type") != "gpt2" and "GPT2LMHeadModel" not in (hf.get("architectures") or []):
        raise ValueError(f"not a GPT-2 config (model_type {hf.get('model_type')!r}); "
                         f"only GPT-2 is supported")
    # the values of these keys that the model implements, the default first
    supported = dict(scale_attn_weights=(True,), scale_attn_by_inverse_layer_idx=(False,),
                     n_inner=(None, 4 * hf.get("n_embd", 768)))
    for key, ok in supported.items():
        if hf.get(key, ok[0]) not in ok:
            raise ValueError(f"unsupported GPT-2 variant: {key} {hf[key]!r}, "
                             f"not {' or '.join(map(repr, ok))}")
    return GPTConfig(**{field: hf[key] for key, field in HF_CONFIG_KEYS.items() if key in hf})


def tensor_sources(directory, config):
    """Our parameter name -> (the file's key, the file) of a Hugging Face directory's safetensors,
    sharded or not, checked against `config`'s shapes."""
    where = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(where):
        where += ".index.json"  # a sharded model: the index names its files
    if not os.path.isfile(where):
        raise FileNotFoundError(f"{directory}: no weights (model.safetensors or model.safetensors"
                                ".index.json; convert a pytorch_model.bin to safetensors first)")
    shapes, sources, path = {}, {}, where
    try:  # whatever the parser says, the file is the problem: name it
        paths = [where]
        if where.endswith(".json"):
            weight_map = json.loads(pathlib.Path(where).read_text())["weight_map"]
            paths = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        for path in paths:
            with safe_open(path, "pt") as f:  # reads the header only
                for key in f.keys():
                    shapes[key], sources[key] = tuple(f.get_slice(key).get_shape()), path
    except Exception as e:
        raise ValueError(f"{path}: not a readable weights file ({type(e).__name__}: {e})") from e
    # Hub files name keys with or without "transformer.", hold lm_head.weight or not, and older
    # ones hold the attention's causal-mask buffers, which are not weights.
    ours = {}
    for key in shapes:
        if not key.endswith((".attn.bias", ".attn.masked_bias")):
            ours[key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key] = key
    expected = _hf_shapes(config)
    problems = [f"missing tensor {name}" for name in expected if name not in ours]
    expected["lm_head.weight"] = expected["transformer.wte.weight"]  # the tied weight, if stored
    for name, key in ours.items():
        if name not in expected:
            problems.append(f"unexpected tensor {key}")
        elif shapes[key] != expected[name]:
            problems.append(f"{key} has shape {shapes[key]}, expected {expected[name]}")
    if problems:  # the first five: a file of another size has a problem in every tensor
        raise ValueError(f"{where}: does not match its config.json ({'; '.join(problems[:5])})")
    return {name: (key, sources[key]) for name, key in ours.items()}


@torch.no_grad()
def load_hf_sharded(model, name_or_path):
    """Fill `model`, plain or FSDP2 (every rank calls), each rank reading only its own rows."""
    directory, config = resolve_pretrained(name_or_path)
    theirs = dataclasses.asdict(config)  # padded_vocab_size is ours to choose
    differ = [f"{field} {ours} (file: {theirs[field]})" for field, ours in
              dataclasses.asdict(model.config).items()
              if field != "padded_vocab_size" and ours != theirs[field]]
    if differ:
        raise ValueError(f"{directory}/config.json: the model to load into differs: "
                         f"{', '.join(differ)}")
    sources = tensor_sources(directory, config)

    def read(name, index):  # the block `index` (slices) of the file's tensor for our `name`
        key, path = sources[name]
        with safe_open(path, "pt") as f:  # opened per tensor: its mapped pages go once read
            return f.get_slice(key)[index]

    params = dict(model.named_parameters())  # the tied weight once, as transformer.wte.weight
    untied = torch.zeros(1, device=next(iter(params.values())).device)  # lm_head's rows differ
    for name, p in params.items():
        local, index = local_block(p)
        if name.endswith(CONV1D_WEIGHTS):  # our rows of a Conv1D weight are the file's columns
            local.copy_(read(name, index[::-1]).t())
        elif name in ("transformer.wte.weight", "lm_head.weight"):  # lm_head: to_empty()'s copy
            stop = min(index[0].stop, config.vocab_size)
            in_file = (slice(min(index[0].start, stop), stop), *index[1:])
            rows = read("transformer.wte.weight", in_file)
            if "lm_head.weight" in sources:
                untied += not torch.equal(rows, read("lm_head.weight", in_file))
            local[:rows.size(0)].copy_(rows)
            local[rows.size(0):].zero_()  # the padded rows, past vocab_size
        else:
            local.copy_(read(name, index))
    if any(isinstance(p, DTensor) for p in params.values()):  # so that every rank fails alike
        dist.all_reduce(untied)
    if untied.item():
        raise ValueError(f"{sources['lm_head.weight'][1]}: lm_head.weight differs from wte.weight "
                         f"(untied embeddings are not supported)")


def _hf_shapes(config):
    """Tensor name -> shape in a Hugging Face file (Conv1D layout, real vocabulary rows)."""
    with torch.device("meta"):
        model = GPT(dataclasses.replace(config, padded_vocab_size=None, bias=True))
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    del shapes["lm_head.weight"]
    for name in shapes:
        if name.endswith(CONV1D_WEIGHTS):
            shapes[name] = shapes[name][::-1]
    return shapes


def hf_config(cfg, dtype):
    """transformers' config.json for a GPT2LMHeadModel of our config's shapes and activation."""
    # GPT-2's <|endoftext|> said outright: transformers assumes it even where no such id exists
    endoftext = 50256 if cfg.vocab_size > 50256 else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "tie_word_embeddings": True,
            "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": cfg.activation, "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": endoftext,
            "eos_token_id": endoftext, "torch_dtype": str(dtype).removeprefix("torch.")}


@torch.no_grad()
def export_hf(model, directory, max_shard_size=5 * 10**9, extra_files=None):
    """Write `model` (plain, compiled or FSDP2; every rank calls) as save_pretrained does, swapped
    in whole: a reader finds the old directory or the new one, never a half-written one."""
    model = getattr(model, "_orig_mod", model)  # the module inside torch.compile(model)
    cfg, params, expected = model.config, dict(model.named_parameters()), _hf_shapes(model.config)
    dtype = params["transformer.wte.weight"].dtype
    writer = not dist.is_initialized() or dist.get_rank() == 0
    parent, base = os.path.split(os.path.abspath(directory))
    new = os.path.join(parent, f".{base}.{os.getpid()}.tmp")
    is_export = os.path.isfile(os.path.join(directory, "config.json"))
    if writer and os.path.exists(directory) and not is_export:  # else nothing, or an export
        if not os.path.isdir(directory) or os.listdir(directory):  # an empty directory may go
            raise ValueError(f"{directory}: exists and is not a model directory; not replaced")
    if writer and os.path.isdir(parent):
        for name in os.listdir(parent):  # what a killed export left behind
            if re.fullmatch(rf"\.{re.escape(base)}\.\d+\.(tmp|old)", name):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def file_tensor(name):  # every rank gathers, one tensor at a time; the writer keeps it
        if name not in params:  # a model without biases computes what one with zero biases does
            return torch.zeros(expected[name], dtype=dtype)
        tensor = params[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if not writer:
            return None
        if name == "transformer.wte.weight":
            tensor = tensor[:cfg.vocab_size]
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        return tensor.cpu().contiguous()

    # transformers' own sharding: in order, a new file when the next tensor would not fit
    split = huggingface_hub.split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in expected.items()},
        max_shard_size=max_shard_size)
    files = {"config.json": hf_config(cfg, dtype)}
    if split.is_sharded:
        files["model.safetensors.index.json"] = {"metadata": split.metadata,
                                                 "weight_map": split.tensor_to_filename}
    try:
        if writer:
            os.makedirs(new, exist_ok=True)
        for filename, names in split.filename_to_tensors.items():
            tensors = {name: file_tensor(name) for name in names}
            if writer:
                save_file(tensors, os.path.join(new, filename), metadata={"format": "pt"})
        if not writer:
            return
        for name, obj in files.items():
            pathlib.Path(new, name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        if extra_files is not None:
            extra_files(new)  # e.g. the tokenizer's files, inside the same swap
        for name in os.listdir(new):
            os.chmod(os.path.join(new, name), 0o644)  # safetensors creates 0600 files
            _fsync(os.path.join(new, name))
        _fsync(new)
        swap_in(new, directory)
    except BaseException as e:
        shutil.rmtree(new, ignore_errors=True)  # frees the space at once
        # a full disk or a read-only directory is one line naming the directory, not a traceback
        if isinstance(e, SafetensorError):
            raise OSError(f"cannot write {directory}: {str(e).strip()}") from None
        if isinstance(e, OSError) and e.strerror:
            raise OSError(f"cannot write {directory}: {e.strerror}") from None
        raise  # extra_files' own one-line errors among them


def swap_in(new, directory):
    """Put directory `new` in the place of `directory`: a reader finds one or the other whole."""
    parent, base = os.path.split(os.path.abspath(directory))
    # renameat2(RENAME_EXCHANGE) swaps the two at once (Linux); elsewhere the old one moves aside
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    exchanged = False
    if os.path.exists(directory) and renameat2 is not None:
        AT_FDCWD, RENAME_EXCHANGE = -100, 2
        paths = os.fsencode(new), os.fsencode(directory)
        exchanged = renameat2(AT_FDCWD, paths[0], AT_FDCWD, paths[1], RENAME_EXCHANGE) == 0
    old = new  # after an exchange the old directory is where the new one was
    if not exchanged:
        old = os.path.join(parent, f".{base}.{os.getpid()}.old")
        if os.path.exists(directory):
            os.rename(directory, old)
        os.rename(new, directory)
    _fsync(parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a file or a directory
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- train_gpt2.py's checkpoints

# A checkpoint, out_dir/ckpt/step_NNNNNNNN/ (DCP files, train_state.json, rng.pt), is complete once
# train_gpt2.py has written MARKER, which it writes last.
MARKER = "complete.json"

# A checkpoint saved or loaded without a process group is meant to be: one process uses it whole.
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")


def complete_checkpoints(ckpt_root):
    """Paths of the complete checkpoints under ckpt_root, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    names = [name for name in os.listdir(ckpt_root) if re.fullmatch(r"step_\d{8}", name)]
    paths = [os.path.join(ckpt_root, name) for name in names]
    return sorted(path for path in paths if os.path.isfile(os.path.join(path, MARKER)))


def read_train_state(ckpt_path):
    return json.loads(pathlib.Path(ckpt_path, "train_state.json").read_text(encoding="utf-8"))


def check_checkpoint(path):
    """None if each file of checkpoint `path` has its written size and its state reads; else why."""
    name = os.path.join(path, MARKER)
    try:
        # MARKER lists every file's size as written, the model and optimizer shards among them
        for file, size in json.loads(pathlib.Path(name).read_text())["sizes"].items():
            name = os.path.join(path, file)
            actual = os.path.getsize(name)
            if actual != size:
                return f"{name}: truncated or changed ({actual} bytes, {size} when written)"
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


def newest_usable_checkpoint(ckpt_root, read_only=False, load=None):
    """(the newest complete checkpoint that check_checkpoint and load(path), if given, pass, or
    None; messages naming those skipped). Damaged ones are renamed aside, or with read_only left."""
    messages, damaged = [], []
    while found := [path for path in complete_checkpoints(ckpt_root) if path not in damaged]:
        newest = found[-1]
        problem = check_checkpoint(newest)
        if problem is None and load is not None:
            try:
                load(newest)
            except Exception as e:  # whatever failed to read, the checkpoint is the problem
                first_line = (str(e).strip().splitlines() or [""])[0]
                problem = f"{type(e).__name__}: {first_line}"
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
        if load is not None:
            load(path)
        return path
    ckpt_root = os.path.join(path, "ckpt")
    found, messages = newest_usable_checkpoint(ckpt_root, read_only=True, load=load)
    for message in messages:
        print(message, file=sys.stderr)
    if found is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint nor a run with a usable checkpoint "
                                f"under ckpt/")
    return found


def load_weights(ckpt_path, model):
    """A checkpoint's weights into `model` (plain or FSDP2); NaN or inf raise on every rank."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=ckpt_path)
    set_model_state_dict(model, state["model"])
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
        models[path] = GPT(GPTConfig(**read_train_state(path)["model_config"]))
        load_weights(path, models[path])

    return models[resolve_checkpoint(name_or_path, load)]
