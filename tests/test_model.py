"""model.py against the oracles: transformers' GPT2LMHeadModel (logits, loss, generation, init statistics, parameter
counts), F.cross_entropy for the chunked loss head (eager and compiled), torch's FLOP counter."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel

import model as model_module
from conftest import TOL, assert_matches_hf, batch, randomize, random_hf_model, save_hf_dir
from hf_files import from_pretrained
from model import GPT, GPTConfig, chunked_cross_entropy


# ----------------------------------------------------------------------------- padded vocabulary

@pytest.mark.gpt2
def test_padded_vocab_gives_identical_logits_on_real_ids(tmp_path):
    hf = random_hf_model(n_layer=1, n_head=2, n_embd=16, vocab_size=50257, n_positions=16)
    path = save_hf_dir(tmp_path, hf)
    padded = from_pretrained(str(path), padded_vocab_size=50304).eval()
    assert padded.transformer.wte.weight.shape == (50304, 16)
    assert padded.lm_head.weight is padded.transformer.wte.weight
    assert_matches_hf(padded, hf)
    idx, labels = batch(50257, 16)
    plain = from_pretrained(str(path))
    assert torch.equal(plain(idx)[0], padded(idx)[0]) and torch.equal(plain(idx, labels)[1], padded(idx, labels)[1])


def test_padded_rows_never_change_init_or_training():
    """Same RNG state, same model: padding only adds zero rows, which no logit, loss or gradient ever reaches."""
    cfg = dict(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    plain, padded = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, padded_vocab_size=50304))
    for model in (plain, padded):
        torch.manual_seed(0)
        model.init_weights()
    assert torch.equal(padded.transformer.wte.weight[50257:], torch.zeros(47, 16))
    idx, labels = batch(50257, 16)
    assert torch.equal(plain(idx)[0], padded(idx)[0])
    plain_loss, padded_loss = plain(idx, labels)[1], padded(idx, labels)[1]
    assert torch.equal(plain_loss, padded_loss)
    padded_loss.backward()
    assert torch.equal(padded.transformer.wte.weight.grad[50257:], torch.zeros(47, 16))


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="padded_vocab_size=100 is smaller than vocab_size=50257"):
        GPTConfig(padded_vocab_size=100)
    with pytest.raises(ValueError, match="n_embd=100 is not divisible by n_head=12"):
        GPTConfig(n_embd=100)


# ----------------------------------------------------------------------------- exporting

# ----------------------------------------------------------------------------- the hub, offline


# ----------------------------------------------------------------------------- bad input

# ----------------------------------------------------------------------------- init

@pytest.mark.gpt2
def test_init_statistics_match_transformers_gpt2_init():
    """Per-tensor mean and std of a fresh model against a fresh GPT2LMHeadModel (transformers implements GPT-2's
    init: normal 0.02, residual projections 0.02/sqrt(2 * n_layer), zero biases, unit LayerNorms)."""
    torch.manual_seed(0)
    ours = GPT(GPTConfig(block_size=128, vocab_size=1000, n_layer=4, n_head=4, n_embd=128))
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1000, n_positions=128))
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        reference = hf_params[name]
        if reference.std() == 0:
            assert torch.equal(p, reference), name
        else:
            assert abs(p.std().item() / reference.std().item() - 1) < 0.05, name
            assert abs(p.mean().item()) < 0.1 * reference.std().item(), name
    assert abs(ours.transformer.h[3].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(8)) < 3e-4


def test_init_is_deterministic_and_works_after_meta_device():
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, padded_vocab_size=80)
    torch.manual_seed(7)
    first = GPT(cfg)
    with model_module.parameters_on_meta():
        materialised = GPT(cfg)
    model_module.materialize(materialised, "cpu")
    torch.manual_seed(7)
    first.init_weights()
    torch.manual_seed(7)
    materialised.init_weights()
    # the tie (or a head of its own) is what __init__ made
    assert (materialised.lm_head.weight is materialised.transformer.wte.weight) == \
        (first.lm_head.weight is first.transformer.wte.weight)
    for (name, a), (_, b) in zip(first.state_dict().items(), materialised.state_dict().items()):
        assert torch.equal(a, b), name
    torch.manual_seed(8)
    materialised.init_weights()
    assert not torch.equal(first.transformer.wte.weight, materialised.transformer.wte.weight)


# ----------------------------------------------------------------------------- forward, generate, accounting

class Gated(GPT):
    """An edit that adds parameters of its own: a gate at 0.5 and a random scale, on modules GPT-2's init does not
    know; and, with `untied`, a head of its own."""

    def __init__(self, config, untied=False):
        super().__init__(config)
        self.gate = torch.nn.Parameter(torch.full((1,), 0.5))
        self.scale = torch.nn.Parameter(torch.randn(config.n_embd))
        # a module of torch's that fills its gain in reset_parameters(), after registering it empty
        self.norm = torch.nn.RMSNorm(config.n_embd)
        if untied:
            self.lm_head.weight = torch.nn.Parameter(torch.empty_like(self.lm_head.weight))
            self.init_weights()


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_a_parameter_an_edit_adds_keeps_its_init_value_through_the_meta_build(untied):
    """GPT-2's init fills the modules it knows (Linear, Embedding, LayerNorm); a parameter an edit adds elsewhere keeps
    the value its __init__ gave it, also when the model is built on the meta device and materialized, as the trainer
    builds it; and the tie, or its absence, is what __init__ made."""
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, padded_vocab_size=80)
    torch.manual_seed(3)
    eager = Gated(cfg, untied)
    torch.manual_seed(3)
    with model_module.parameters_on_meta():
        built = Gated(cfg, untied)
    model_module.materialize(built, "cpu")
    model_module.init_sharded(built, 11)
    torch.manual_seed(11)
    eager.init_weights()
    # on the meta device __init__'s own draws come first from the seed: GPT-2's modules draw nothing there
    torch.manual_seed(3)
    assert torch.equal(built.gate, torch.full((1,), 0.5)) and torch.equal(built.scale, torch.randn(16))
    assert torch.equal(built.norm.weight, torch.ones(16))
    for (name, a), (_, b) in zip(eager.state_dict().items(), built.state_dict().items()):
        assert name == "scale" or torch.equal(a, b), name
    plain = GPT(cfg)
    tied = plain.lm_head.weight is plain.transformer.wte.weight and not untied  # model.py decides, then the edit
    assert (built.lm_head.weight is built.transformer.wte.weight) is tied
    assert (eager.lm_head.weight is eager.transformer.wte.weight) is tied
    planned = {name for name, _, _ in built.init_plan()}
    assert {"gate", "scale", "norm.weight"}.isdisjoint(planned) and ("lm_head.weight" in planned) is not tied
    assert torch.equal(built.lm_head.weight[64:], torch.zeros(16, 16))  # padded rows, tied or not
    # a head of its own is counted, as transformers counts tie_word_embeddings=False
    head = (plain.lm_head.weight is plain.transformer.wte.weight and untied) * 64 * 16
    assert built.num_params(non_embedding=False) - plain.num_params(non_embedding=False) == 1 + 16 + 16 + head


@pytest.mark.gpt2
def test_loss_is_fp32_under_bf16(tiny_hf_dir):
    model = from_pretrained(str(tiny_hf_dir[0])).eval()
    idx, labels = batch(100, 64)
    with torch.no_grad():
        _, fp32_loss = model(idx, labels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(idx)[0], model(idx, labels)[1]
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert abs(loss.item() - fp32_loss.item()) < 0.02 * fp32_loss.item()
    with torch.no_grad():
        model = model.to(torch.bfloat16)  # bf16 weights, no autocast
        logits, loss = model(idx)[0], model(idx, labels)[1]
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32


@pytest.mark.gpt2
def test_forward_rejects_sequences_longer_than_block_size(tiny_hf_dir):
    model = from_pretrained(str(tiny_hf_dir[0]))
    with pytest.raises(ValueError, match="length 65 is longer than the model's block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.gpt2
@pytest.mark.slow
def test_greedy_generation_matches_transformers(tiny_hf_dir):
    path, hf = tiny_hf_dir
    model = from_pretrained(str(path)).eval()
    prompt = torch.tensor([[5, 17, 42, 8], [1, 2, 3, 4]])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    assert torch.equal(model.generate(prompt, 12, temperature=0), expected)
    assert torch.equal(model.generate(prompt, 12, top_k=1), expected)


@pytest.mark.slow
def test_generation_crops_the_context_and_samples_from_the_top_k():
    torch.manual_seed(0)
    model = randomize(GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=16))).eval()
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = model.generate(prompt, 10, temperature=0)
    assert out.shape == (1, 16) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():  # the last token was chosen from the last block_size tokens only
        assert out[0, -1] == model(out[:, -9:-1])[0][0, -1].argmax()
    torch.manual_seed(1)
    sampled = model.generate(prompt, 20, temperature=1.5, top_k=3)
    torch.manual_seed(1)
    assert torch.equal(sampled, model.generate(prompt, 20, temperature=1.5, top_k=3))
    with torch.no_grad():
        for t in range(6, 26):
            top3 = model(sampled[:, max(0, t - 8):t])[0][0, -1].topk(3).indices
            assert sampled[0, t] in top3
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(prompt, 1, temperature=-1)


@pytest.mark.gpt2
def test_num_params_counts_like_transformers():
    cfg = dict(block_size=64, vocab_size=100, n_layer=2, n_head=2, n_embd=32)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64))
    for model in (GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, padded_vocab_size=128))):
        assert model.num_params(non_embedding=False) == hf.num_parameters()
        assert model.num_params() == hf.num_parameters() - 64 * 32


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
@pytest.mark.parametrize("padded", [True, False], ids=["padded-weight", "sliced-weight"])
def test_chunked_loss_and_gradients_equal_cross_entropy(chunk_size, padded):
    """96 rows, a padded 128-row weight of which 100 rows are the vocabulary (passed whole with vocab_size, or
    sliced), ignored targets, chunk sizes that do and do not divide the rows."""
    torch.manual_seed(0)
    x = torch.randn(96, 24, requires_grad=True)
    weight = torch.randn(128, 24, requires_grad=True)
    targets = torch.randint(0, 100, (96,))
    targets[::5] = -100

    def loss_of(x):
        if padded:
            return chunked_cross_entropy(x, weight, targets, chunk_size=chunk_size, vocab_size=100)
        return chunked_cross_entropy(x, weight[:100], targets, chunk_size=chunk_size)

    loss = loss_of(x)
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
    (loss_of(x) / 4).backward()
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

@pytest.mark.gpt2  # the training loss is GPT-2's plain cross-entropy: an edit of the loss is expected to fail this
@pytest.mark.parametrize("chunk_rows", [1024, 40], ids=["one-chunk", "40-rows"])
def test_model_loss_and_all_gradients_equal_plain_cross_entropy(monkeypatch, chunk_rows):
    monkeypatch.setitem(model_module.LOSS_CHUNK_LOGITS, "cpu", chunk_rows * 128)  # 96 rows: 3 chunks, the last one 16 rows
    model = random_model()
    idx, targets = tokens()
    loss, grads = loss_and_grads(model, idx, targets)
    expected_loss, expected_grads = loss_and_grads(model, idx, targets, plain=True)
    assert abs(loss.item() - expected_loss.item()) < TOL
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_close(grads[name], expected_grads[name], TOL)
    assert torch.equal(grads["transformer.wte.weight"][100:], torch.zeros(28, 32))


def test_logits_only_without_targets():
    model = random_model()
    idx, targets = tokens()
    logits, loss = model(idx)
    assert loss is None and logits.shape == (3, 32, 100) and logits.is_contiguous()  # real vocabulary only
    logits, loss = model(idx, targets)
    assert logits is None and loss.shape == ()
    # logits_at: the logits at chosen (row, position) pairs only, as HellaSwag asks for its endings'
    rows, positions = torch.tensor([0, 0, 2, 1]), torch.tensor([5, 31, 0, 7])
    with LargestOutput() as mode:
        some, _ = model(idx, logits_at=(rows, positions))
    torch.testing.assert_close(some, model(idx)[0][rows, positions])
    assert some.shape == (4, 100) and [(4, 32), (32, 128)] in mode.matmul_shapes  # the head's GEMM has 4 rows


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces, the dtypes of the matmuls' inputs and their shapes."""

    def __init__(self):
        super().__init__()
        self.largest, self.matmul_dtypes, self.matmul_shapes = 0, set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                    torch.ops.aten.mm.out, torch.ops.aten.addmm.out):
            self.matmul_dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.matmul_shapes.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_full_logits_are_never_materialised(monkeypatch):
    monkeypatch.setitem(model_module.LOSS_CHUNK_LOGITS, "cpu", 16 * 1024)
    model = random_model(vocab_size=1000, padded_vocab_size=1024)
    idx, targets = tokens(vocab_size=1000)
    with LargestOutput() as mode:
        model(idx, targets)[1].backward()
    # the largest tensors are the 1024 x 32 weight's gradients; the full logits would be 96 x 1000, a chunk 16 x 1024
    assert mode.largest == 1024 * 32 < 96 * 1000


def test_head_matmuls_run_over_the_padded_weight_and_logits_never_show_padding():
    """Every GEMM of the head (loss and logits) has the 128 padded rows, not the 100 of the vocabulary; padded rows
    made to win every argmax still never become a logit, a loss term or a sampled token."""
    model = random_model()
    idx, targets = tokens()
    with LargestOutput() as mode:
        model(idx, targets)[1].backward()
        logits = model(idx)[0]
    head = [shapes for shapes in mode.matmul_shapes if any(100 in s or 128 in s for s in shapes)]
    assert head and all(128 in s for shapes in head for s in shapes if 100 in s or 128 in s), head
    assert logits.shape == (3, 32, 100)
    with torch.no_grad():
        model.transformer.wte.weight[100:] = 50 * model.transformer.ln_f.weight  # a huge logit on every padded row
    assert model(idx)[0].shape == (3, 32, 100)
    assert model.generate(idx[:, :4], 8, temperature=0).max() < 100
    torch.manual_seed(0)
    assert model.eval().generate(idx[:, :4], 8, temperature=2.0).max() < 100
    padded_loss, grads = loss_and_grads(model, idx, targets)
    plain_loss, plain_grads = loss_and_grads(model, idx, targets, plain=True)
    assert abs(padded_loss.item() - plain_loss.item()) < TOL
    assert torch.equal(grads["transformer.wte.weight"][100:], torch.zeros(28, 32))


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


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiles_without_graph_breaks(checkpointing):
    torch._dynamo.reset()
    model = random_model()
    model.activation_checkpointing = checkpointing
    model.compile_loss = checkpointing  # inside a whole-model compile the compiled head is traced through
    idx, targets = tokens()
    assert torch._dynamo.explain(model)(idx, targets).graph_break_count == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch._dynamo.explain(model)(idx, targets).graph_break_count == 0
    x, weight = torch.randn(50, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    # the per-chunk loss that compile_loss compiles, called as the head calls it (logits that need a gradient)
    logits = (x @ weight.t()).detach().requires_grad_(True)
    explained = torch._dynamo.explain(model_module._real_vocab_chunk_loss)(logits, torch.randint(0, 60, (50,)), 60,
                                                                           True)  # training
    assert explained.graph_break_count == 0 and explained.graph_count == 1


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.mark.slow
def test_compiled_head_equals_eager_with_no_graph_break(monkeypatch):
    """compile_loss=True: loss and every gradient equal the eager head's (fp32 to 1e-5) and F.cross_entropy's; the
    chunk body compiles to one graph per chunk shape (here 40 rows and the last 16), nothing falls back to eager."""
    torch._dynamo.reset()
    monkeypatch.setitem(model_module.LOSS_CHUNK_LOGITS, "cpu", 40 * 128)
    backend = CountingBackend()
    compiled = torch.compile(model_module._real_vocab_chunk_loss, backend=backend)
    monkeypatch.setattr(model_module, "_compiled_chunk_loss", lambda: compiled)
    model = random_model()
    idx, targets = tokens()
    eager_loss, eager_grads = loss_and_grads(model, idx, targets)
    plain_loss, plain_grads = loss_and_grads(model, idx, targets, plain=True)
    model.compile_loss = True
    loss, grads = loss_and_grads(model, idx, targets)
    assert backend.graphs == 2  # the 40-row chunks and the last 16 rows; a graph break would make more
    assert abs(loss.item() - eager_loss.item()) < TOL and abs(loss.item() - plain_loss.item()) < TOL
    for name in grads:
        assert_close(grads[name], eager_grads[name], TOL)
        assert_close(grads[name], plain_grads[name], TOL)
    assert torch.equal(grads["transformer.wte.weight"][100:], torch.zeros(28, 32))


@pytest.mark.slow
def test_compiled_head_with_inductor_equals_eager_fp32_and_bf16():
    """The real compiler (Inductor's C++ backend on CPU): fp32 to 1e-5; under bf16 autocast within bf16's rounding."""
    torch._dynamo.reset()
    model = random_model()
    idx, targets = tokens()
    results = {}
    for compiled in (False, True):
        model.compile_loss = compiled
        results[compiled] = loss_and_grads(model, idx, targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[compiled, "bf16"] = loss_and_grads(model, idx, targets)
    assert abs(results[True][0].item() - results[False][0].item()) < TOL
    for name, grad in results[False][1].items():
        assert_close(results[True][1][name], grad, TOL)
        bf16, eager_bf16 = results[True, "bf16"][1][name], results[False, "bf16"][1][name]
        assert (bf16 - eager_bf16).abs().max().item() <= 0.02 * eager_bf16.abs().max().item() + 1e-6, name
    assert abs(results[True, "bf16"][0].item() / results[False, "bf16"][0].item() - 1) < 0.01


def z_loss_chunk(logits, targets, training=True):
    """chunk_loss with a z-loss term (PaLM's), as a researcher would write it: 1e-4 * logsumexp^2 per scored row."""
    logits = logits.float()
    z = torch.logsumexp(logits, dim=-1)
    scored = targets != -100
    return F.cross_entropy(logits, targets, reduction="sum") + 1e-4 * (z.square() * scored).sum()


@pytest.mark.gpt2  # the loss outside chunk_loss is GPT-2's: an edit that adds a term elsewhere is expected to fail this
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager", "compiled"])
def test_an_edited_chunk_loss_trains_through_the_chunked_head(monkeypatch, compiled):
    """An edit to chunk_loss alone (here a z-loss) gives, through the chunked head, the loss and gradients that plain
    autograd gives over the full logits: no hand-written gradient to keep in step."""
    torch._dynamo.reset()
    monkeypatch.setattr(model_module, "chunk_loss", z_loss_chunk)
    monkeypatch.setitem(model_module.LOSS_CHUNK_LOGITS, "cpu", 40 * 128)  # 96 rows: 3 chunks, the last one 16 rows
    model = random_model()
    model.compile_loss = compiled
    idx, targets = tokens()
    loss, grads = loss_and_grads(model, idx, targets)
    model.zero_grad(set_to_none=True)
    logits, _ = model(idx)
    expected = z_loss_chunk(logits.flatten(0, 1), targets.flatten()) / (targets != -100).sum()
    expected.backward()
    plain = F.cross_entropy(logits.detach().float().flatten(0, 1), targets.flatten())
    assert loss.item() > plain.item() + 1e-4  # the z-loss term is in
    assert abs(loss.item() - expected.item()) < TOL
    for name, p in model.named_parameters():
        assert_close(grads[name], p.grad, TOL)


@pytest.mark.slow
def test_whole_model_compile_gives_the_eager_loss_and_gradients():
    """torch.compile(model) traces the blocks and runs the loss head as it runs outside compile."""
    torch._dynamo.reset()
    model = random_model()
    idx, targets = tokens()
    eager_loss, eager_grads = loss_and_grads(model, idx, targets)
    loss, grads = loss_and_grads(torch.compile(model, backend=CountingBackend()), idx, targets)
    assert abs(loss.item() - eager_loss.item()) < TOL
    for name, grad in eager_grads.items():
        assert_close(grads["_orig_mod." + name], grad, TOL)


# ----------------------------------------------------------------------------- FLOPs per token

@pytest.mark.gpt2
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


@pytest.mark.gpt2
def test_flops_per_token_against_torch_flop_counter():
    """torch counts the matmuls of one forward + backward: 6 per weight of every Linear (the head over all 50304
    padded rows) and 12*L*C*T for attention over the full T x T square. The llm.c count differs by exactly the
    non-matmul parameters (wpe, biases, LayerNorms) and by causal attention's half square."""
    T = 256
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, padded_vocab_size=50304))
        counter = FlopCounterMode(display=False)
        with counter:
            model(torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long))[1].backward()
    matmul_weights = sum(m.weight.numel() for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and name != "lm_head") + 50304 * 768  # the padded head
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


@pytest.mark.slow
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
