"""The training path of model.GPT: the chunked linear + cross-entropy loss head against F.cross_entropy on the full
logits (values and gradients), bf16 autocast, torch.compile, the FLOP count in llm.c's convention and activation
checkpointing."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import model as model_module
from model import GPT, GPTConfig, chunked_cross_entropy

TOL = 1e-5
SMALL = dict(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32, padded_vocab_size=128)


def random_model(seed=0, **overrides):
    """A small GPT with padded vocabulary rows (zero, as init leaves them) and every other parameter random."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SMALL, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "transformer.wte.weight":
                p[:model.config.vocab_size] += 0.05 * torch.randn_like(p[:model.config.vocab_size])
            else:
                p.add_(0.05 * torch.randn_like(p))
    return model


def tokens(vocab_size=100, shape=(3, 32), seed=1):
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, shape, generator=generator)
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    targets[0, 5:9] = -100
    targets[2, -1] = -100
    return idx, targets


def loss_and_grads(model, idx, targets, plain=False):
    """(loss, {name: grad}) of one forward + backward; plain=True takes F.cross_entropy of the returned logits."""
    model.zero_grad(set_to_none=True)
    if plain:
        logits, _ = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    else:
        logits, loss = model(idx, targets)
        assert logits is None  # with targets the model hands back the loss alone
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_close(a, b, tol):
    assert (a - b).abs().max().item() < tol


# ----------------------------------------------------------------------------- the loss head alone

@pytest.mark.parametrize("chunk_size", [7, 16, 96, 1000], ids=["7-odd", "16", "96-one-chunk", "1000-larger"])
def test_chunked_loss_and_gradients_equal_cross_entropy(chunk_size):
    """96 rows, a padded 128-row weight of which 100 rows are the vocabulary, ignored targets, chunk sizes that do
    and do not divide the rows."""
    torch.manual_seed(0)
    x = torch.randn(96, 24, requires_grad=True)
    weight = torch.randn(128, 24, requires_grad=True)
    targets = torch.randint(0, 100, (96,))
    targets[::5] = -100
    loss = chunked_cross_entropy(x, weight[:100], targets, chunk_size=chunk_size)
    loss.backward()
    grad_x, grad_weight = x.grad, weight.grad
    x.grad = weight.grad = None
    expected = F.cross_entropy(x @ weight[:100].t(), targets, ignore_index=-100)
    expected.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - expected.item()) < TOL
    assert_close(grad_x, x.grad, TOL)
    assert_close(grad_weight, weight.grad, TOL)
    assert torch.equal(grad_weight[100:], torch.zeros(28, 24))  # padded rows get exactly nothing
    # a scaled loss (gradient accumulation divides it) scales the gradients
    x.grad = None
    (chunked_cross_entropy(x, weight[:100], targets, chunk_size=chunk_size) / 4).backward()
    assert_close(x.grad * 4, grad_x, TOL)


def test_chunked_loss_without_grad_and_all_ignored():
    torch.manual_seed(0)
    x, weight, targets = torch.randn(20, 8), torch.randn(30, 8), torch.randint(0, 30, (20,))
    with torch.no_grad():
        loss = chunked_cross_entropy(x, weight, targets, chunk_size=6)
    assert abs(loss.item() - F.cross_entropy(x @ weight.t(), targets).item()) < TOL
    x.requires_grad_(True)
    ignored = chunked_cross_entropy(x, weight, torch.full_like(targets, -100), chunk_size=6)
    ignored.backward()
    assert ignored.item() == 0 and torch.equal(x.grad, torch.zeros_like(x))  # 0, not F.cross_entropy's nan


# ----------------------------------------------------------------------------- through the whole model

@pytest.mark.parametrize("chunk_rows", [1024, 40], ids=["one-chunk", "40-rows"])
def test_model_loss_and_all_gradients_equal_plain_cross_entropy(monkeypatch, chunk_rows):
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", chunk_rows)  # 96 rows: 3 chunks, the last one 16 rows
    model = random_model()
    idx, targets = tokens()
    loss, grads = loss_and_grads(model, idx, targets)
    expected_loss, expected_grads = loss_and_grads(model, idx, targets, plain=True)
    assert abs(loss.item() - expected_loss.item()) < TOL
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_close(grads[name], expected_grads[name], TOL)
    assert model.lm_head.weight is model.transformer.wte.weight  # one tied tensor takes both gradients
    assert torch.equal(grads["transformer.wte.weight"][100:], torch.zeros(28, 32))


def test_logits_only_without_targets():
    model = random_model()
    idx, targets = tokens()
    logits, loss = model(idx)
    assert loss is None and logits.shape == (3, 32, 100) and logits.is_contiguous()  # real vocabulary only
    logits, loss = model(idx, targets)
    assert logits is None and loss.shape == ()


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces and the dtypes of the matmuls' inputs."""

    def __init__(self):
        super().__init__()
        self.largest, self.matmul_dtypes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.matmul_dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_full_logits_are_never_materialised(monkeypatch):
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", 16)
    model = random_model(vocab_size=1000, padded_vocab_size=1024)
    idx, targets = tokens(vocab_size=1000)
    with LargestOutput() as mode:
        model(idx, targets)[1].backward()
    # the largest tensors are the 1024 x 32 weight's gradients; the full logits would be 96 x 1000, a chunk 16 x 1000
    assert mode.largest == 1024 * 32 < 96 * 1000


def test_bf16_autocast_runs_bf16_matmuls_and_fp32_loss():
    """Tolerance: bf16 keeps 8 bits of mantissa, so the loss within 1% and each gradient within 5% of its largest
    entry of the fp32 numbers."""
    model = random_model()
    idx, targets = tokens()
    loss, grads = loss_and_grads(model, idx, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16), LargestOutput() as mode:
        bf16_loss, bf16_grads = loss_and_grads(model, idx, targets)
    assert mode.matmul_dtypes == {torch.bfloat16}
    assert bf16_loss.dtype == torch.float32 and abs(bf16_loss.item() / loss.item() - 1) < 0.01
    for name, grad in grads.items():
        assert bf16_grads[name].dtype == torch.float32
        assert (bf16_grads[name] - grad).abs().max().item() <= 0.05 * grad.abs().max().item() + 1e-6, name


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiles_without_graph_breaks(checkpointing):
    torch._dynamo.reset()
    model = random_model()
    model.activation_checkpointing = checkpointing
    idx, targets = tokens()
    assert torch._dynamo.explain(model)(idx, targets).graph_break_count == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch._dynamo.explain(model)(idx, targets).graph_break_count == 0
    x, weight = torch.randn(50, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    explained = torch._dynamo.explain(chunked_cross_entropy)(x, weight[:60], torch.randint(0, 60, (50,)), 16)
    assert explained.graph_break_count == 0


# ----------------------------------------------------------------------------- FLOPs per token

def test_flops_per_token_llmc_convention_by_hand():
    """6*N + 6*L*C*T as llm.c's train_gpt2.cu counts it, for n_layer=2, n_embd=8, vocab 100 padded to 128, T=16.
    N: wte 128*8 = 1024 (padded rows in, lm_head tied: once), wpe 16*8 = 128, ln_f 8+8 = 16, and per block
    ln_1 16 + c_attn 8*24+24 = 216 + attn.c_proj 8*8+8 = 72 + ln_2 16 + c_fc 8*32+32 = 288 + mlp.c_proj 32*8+8 = 264
    = 872, so N = 1024 + 128 + 16 + 2*872 = 2912; 6*N = 17472 and 6*L*C*T = 6*2*8*16 = 1536."""
    model = GPT(GPTConfig(block_size=16, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=8))
    assert model.flops_per_token() == 17472 + 1536 == 19008
    assert model.flops_per_token(8) == 17472 + 768
    with torch.device("meta"):  # GPT-2 124M, vocabulary padded to 50304, T=1024: llm.c's 0.80 GFLOP/token
        gpt2 = GPT(GPTConfig(padded_vocab_size=50304))
    assert gpt2.flops_per_token() == 6 * 124_475_904 + 6 * 12 * 768 * 1024 == 803_478_528


def test_flops_per_token_against_torch_flop_counter():
    """torch counts the matmuls of one forward + backward: 6 per weight of every Linear (the head over the real
    vocabulary only) and 12*L*C*T for attention over the full T x T square. The llm.c count differs by exactly the
    non-matmul parameters (embeddings, padded rows, biases, LayerNorms) and by causal attention's half square."""
    T = 256
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, padded_vocab_size=50304))
        counter = FlopCounterMode(display=False)
        with counter:
            model(torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long))[1].backward()
    matmul_weights = sum(m.weight.numel() for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and name != "lm_head") + 50257 * 768
    other = sum(p.numel() for p in model.parameters()) - matmul_weights
    assert counter.get_total_flops() / (2 * T) == model.flops_per_token(T) - 6 * other + 6 * 2 * 768 * T


# ----------------------------------------------------------------------------- activation checkpointing

def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    model = random_model()
    idx, targets = tokens()
    assert model.activation_checkpointing is False  # off by default
    loss, grads = loss_and_grads(model, idx, targets)
    calls = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation may stop early
    model.activation_checkpointing = True
    ckpt_loss, ckpt_grads = loss_and_grads(model, idx, targets)
    assert len(calls) == 2 * model.config.n_layer  # each block ran again in the backward
    assert abs(ckpt_loss.item() - loss.item()) < 1e-6
    for name, grad in grads.items():
        assert_close(ckpt_grads[name], grad, 1e-6)
    calls.clear()
    with torch.no_grad():
        model(idx, targets)
    assert len(calls) == model.config.n_layer  # nothing to recompute without a backward
    assert "activation_checkpointing" not in model.state_dict() and model.config == GPTConfig(**SMALL)


def test_activation_checkpointing_with_compiled_blocks():
    torch._dynamo.reset()
    model = random_model(n_layer=1)
    idx, targets = tokens()
    loss, grads = loss_and_grads(model, idx, targets)
    for block in model.transformer.h:
        block.compile()  # in place, as train_gpt2.py does before FSDP2's fully_shard
    model.activation_checkpointing = True
    ckpt_loss, ckpt_grads = loss_and_grads(model, idx, targets)
    assert abs(ckpt_loss.item() - loss.item()) < 1e-6
    for name, grad in grads.items():
        assert_close(ckpt_grads[name], grad, 1e-6)
