"""GPT-2, the same model as Hugging Face's GPT2LMHeadModel, written to be read and trained.

References:
1) OpenAI's GPT-2 release: https://github.com/openai/gpt-2/blob/master/src/model.py
2) Hugging Face's implementation: transformers/models/gpt2/modeling_gpt2.py

Hugging Face weights load and export through hf_weights.py, so lm-eval-harness, vLLM and transformers can use what
we train.
"""
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
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
