"""GPT-2 as transformers' GPT2LMHeadModel computes it, written to be edited: the activation, the
loss and the blocks each live in one place. It imports no other file of the project; hf_files.py
reads and writes its Hugging Face files, checkpoint.py its checkpoints."""
import contextlib
import dataclasses
import functools
import math

import torch
import torch.nn as nn
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
    # The model's one description: each field is a train_gpt2.py config key and is recorded in
    # every checkpoint, so that a field added here reaches the model from the command line.
    block_size: int = 1024  # positions (rows of wpe): the longest sequence the model reads
    vocab_size: int = 50257  # GPT-2's BPE
    # rows of wte and lm_head, e.g. 50304 (a multiple of 64): aligned matmuls run faster
    padded_vocab_size: int = None
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True  # biases in Linears and LayerNorms, as in GPT-2
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"  # the MLP's: a key of ACTIVATIONS (add yours there)

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
        # Four times wider inside, as GPT-2; the activation is config.activation's entry.
        return self.c_proj(self.activation(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        # Pre-LayerNorm residual block, as GPT-2: each branch reads a normalized copy of the stream
        # and adds its output back.
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------- the loss head

def chunk_loss(logits, targets, training):
    """The summed loss of one chunk of rows: logits (rows, vocab_size) in the matmul's dtype,
    targets (rows,) with -100 where a position is not scored. Edit this to change the loss (a
    z-loss, a soft cap on the logits): the head differentiates it with autograd, nothing else.
    `training` is False in validation, which runs the model in eval mode: a term for training
    alone (label smoothing, say) goes under `if training:`, and validation stays the plain loss."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def _real_vocab_chunk_loss(logits, targets, vocab_size, training):
    # The head's matmul runs over the padded weight, whose aligned shape is faster. Slicing off the
    # padded columns keeps them out of the softmax whatever chunk_loss does. chunk_loss is looked up
    # at each call (torch.compile guards on it), so an edited one is the one that runs.
    return chunk_loss(logits[:, :vocab_size], targets, training)


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
    def forward(ctx, x, weight, targets, vocab_size, chunk_size, compiled, with_grads, training):
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
            loss = sum(loss_fn(x[rows] @ weight.t(), targets[rows], vocab_size, training)
                       for rows in chunks)
            return loss / count
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        for rows in chunks:
            logits = (x[rows] @ weight.t()).requires_grad_(True)
            with torch.enable_grad():
                chunk = loss_fn(logits, targets[rows], vocab_size, training)
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
        return grad_x * grad_output, grad_weight.mul_(grad_output), *[None] * 7


# Dynamo cannot trace the autograd.grad in the head's forward. Inside a whole-model torch.compile
# the head runs as it does outside one, and compile_loss compiles its chunks.
@torch.compiler.disable
def chunked_cross_entropy(x, weight, targets, chunk_size=None, vocab_size=None, compiled=False,
                          training=True):
    """Mean chunk_loss of x @ weight[:vocab_size].T over the scored targets, chunk by chunk."""
    if chunk_size is None:
        budget = LOSS_CHUNK_LOGITS.get(x.device.type, LOSS_CHUNK_LOGITS["cuda"])
        chunk_size = max(1, budget // weight.size(0))
    vocab_size = vocab_size or weight.size(0)
    # Validation needs no gradients, and then the head computes the loss alone.
    with_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return ChunkedLinearCrossEntropy.apply(x, weight, targets, vocab_size, chunk_size, compiled,
                                           with_grads, training)


# ----------------------------------------------------------------------------- the model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        rows = config.padded_vocab_size or config.vocab_size  # padded: a faster matmul's shape
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(rows, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, rows, bias=False)
        # The head is the token embedding (tied, as in GPT-2). Delete this line for a head of its
        # own: it then trains, checkpoints and exports untied (tie_word_embeddings: false).
        self.lm_head.weight = self.transformer.wte.weight
        # Switches rather than config fields, because a checkpoint is the same either way.
        self.activation_checkpointing = False  # recompute each block in the backward: less memory
        self.compile_loss = False  # torch.compile the loss head's chunks, as the blocks are
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2's init in place (also after a meta build and materialize())."""
        for _, param, fill in self.init_plan():
            fill(param)

    def init_plan(self):
        """(name, parameter, fill) for the modules GPT-2's init knows, as nanoGPT's _init_weights:
        Linear and Embedding weights N(0, 0.02), the residual projections (c_proj) scaled by
        1/sqrt(2 n_layer) so that the stream's variance does not grow with depth, biases zero,
        LayerNorm gains one. A parameter an edit adds elsewhere keeps its __init__ value."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        vocab_rows = (self.transformer.wte, self.lm_head)
        plan, seen = [], set()  # a tied parameter is filled once, by its first module
        for module_name, module in self.named_modules():
            fills = {}
            if isinstance(module, nn.Linear) and module not in vocab_rows:
                std = residual_std if module_name.endswith("c_proj") else 0.02
                fills = dict(weight=functools.partial(nn.init.normal_, std=std), bias=nn.init.zeros_)
            elif isinstance(module, (nn.Embedding, nn.Linear)):
                rows = self.config.vocab_size if module in vocab_rows else None
                fills = dict(weight=functools.partial(normal_rows, rows=rows))
            elif isinstance(module, nn.LayerNorm):
                fills = dict(weight=nn.init.ones_, bias=nn.init.zeros_)
            for name, fill in fills.items():
                param = getattr(module, name)
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    plan.append((f"{module_name}.{name}", param, fill))
        return plan

    def num_params(self, non_embedding=True):
        """Parameters as transformers counts them (real vocabulary rows), less wpe's if asked."""
        n = sum(p.numel() for p in self.parameters())  # a tied weight counts once
        padded_rows = self.transformer.wte.weight.size(0) - self.config.vocab_size
        heads = {id(self.transformer.wte.weight), id(self.lm_head.weight)}  # one if tied
        n -= len(heads) * padded_rows * self.config.n_embd
        if non_embedding and "wpe" in self.transformer:  # a model may have positions of its own
            n -= self.transformer.wpe.weight.numel()
        return n

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
        # Token and position embeddings, then the blocks, then the final LayerNorm.
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
                                         compiled=self.compile_loss, training=self.training)
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


def normal_rows(weight, rows=None, std=0.02):
    """N(0, std) in the first `rows` rows of `weight` (all by default); the padded rows zero."""
    nn.init.normal_(weight[:rows], std=std)
    nn.init.zeros_(weight[weight.size(0) if rows is None else rows:])


# The modules whose parameters GPT.init_plan fills: a meta build needs no values for them.
INIT_BY_PLAN = (nn.Linear, nn.Embedding, nn.LayerNorm)


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device (no memory, no init) and their
    buffers on the CPU. A parameter that init_plan does not fill (an edit's) keeps the value its
    __init__ left, reset_parameters() included, on the side as buffers do: materialize() puts
    both back, where a meta build and to_empty() alone leave garbage."""
    register, kept = nn.Module.register_parameter, []

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            if isinstance(module, INIT_BY_PLAN):
                param = nn.Parameter(param.to("meta"), param.requires_grad)
            else:  # moved to meta once __init__ is done with it
                kept.append((module, name))
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
        moved = {}  # a parameter that several modules share stays one
        for module, name in kept:
            param = module._parameters.get(name)
            if param is not None and param.device.type != "meta" and id(param) not in moved:
                module.__dict__.setdefault("_init_values", {})[name] = param.detach().clone()
                moved[id(param)] = nn.Parameter(param.detach().to("meta"), param.requires_grad)
            module._parameters[name] = moved.get(id(param), param)
    finally:
        nn.Module.register_parameter = register


@torch.no_grad()
def materialize(model, device):
    """model.to_empty(device=device), keeping what __init__ made: the buffers, the parameters kept
    by parameters_on_meta (each rank its block), the sharing of a tied head (to_empty() unties)."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    first_of, shared = {}, {}  # each parameter's first name; each name's first name
    for name, param in model.named_parameters(remove_duplicate=False):
        shared[name] = first_of.setdefault(id(param), name)
    model.to_empty(device=device)
    for name, first in shared.items():
        if name != first and model.get_parameter(name) is not model.get_parameter(first):
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, model.get_parameter(first))
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    for module in model.modules():
        for name, value in module.__dict__.pop("_init_values", {}).items():
            local, index = local_block(getattr(module, name))
            local.copy_(value[index])


@torch.no_grad()
def init_sharded(model, seed):
    """`torch.manual_seed(seed); model.init_weights()` bit for bit, for a plain or FSDP2 GPT."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        # Every rank draws each parameter whole on the CPU, because the generator cannot skip ahead
        # to a shard's numbers; each rank then keeps its own block.
        for _, param, fill in model.init_plan():
            local, index = local_block(param)
            full = torch.empty(param.shape, dtype=param.dtype)
            fill(full)
            local.copy_(full[index])


def local_block(param):
    """(the tensor this rank holds, its block of the full parameter as a tuple of slices)."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return param.to_local(), tuple(slice(start, start + n) for start, n in zip(offset, shape))
