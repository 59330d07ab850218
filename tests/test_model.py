"""model.py against the oracle: transformers' GPT2LMHeadModel (weights in both directions, logits, loss, generation,
init statistics) and torch's FLOP counter."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import ROOT
from model import from_pretrained, save_pretrained
from model import GPT, GPTConfig

TOL = 1e-5


def random_hf_model(seed=0, **overrides):
    """A transformers GPT-2 with every parameter random, biases and LayerNorms included, so no mapping hides."""
    kwargs = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    kwargs.update(overrides)
    kwargs.setdefault("bos_token_id", 50256 if kwargs["vocab_size"] > 50256 else None)
    kwargs.setdefault("eos_token_id", kwargs["bos_token_id"])
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def randomize(model, seed=0):
    """Perturb every parameter of our GPT (its init has zero biases and unit LayerNorms)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(vocab_size, block_size, seed=1):
    """Three full-context rows, so every position embedding is used."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (3, block_size), generator=generator)
    labels = idx.clone()
    labels[0, 5:9] = -100  # ignored positions must be left out of the mean the same way
    return idx, labels


def assert_matches_hf(ours, hf):
    """Same logits, and the same mean loss: transformers shifts labels inside, we take next-token targets."""
    cfg = ours.config
    idx, labels = batch(cfg.vocab_size, cfg.block_size)
    with torch.no_grad():
        hf_out = hf(idx, labels=labels)
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        logits, loss = ours(idx)[0], ours(idx, targets)[1]  # with targets the model returns the loss alone
    assert logits.shape == hf_out.logits.shape == (*idx.shape, cfg.vocab_size)
    assert (logits - hf_out.logits).abs().max().item() < TOL
    assert abs(loss.item() - hf_out.loss.item()) < TOL


def hf_dir(tmp_path, hf):
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """transformers' own export of a small random GPT-2, and the model itself."""
    hf = random_hf_model()
    path = tmp_path_factory.mktemp("tiny") / "hf"
    hf.save_pretrained(path)
    return path, hf


# ----------------------------------------------------------------------------- loading Hugging Face weights

@pytest.mark.parametrize("shape", [
    dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64),
    dict(n_layer=3, n_head=4, n_embd=48, vocab_size=777, n_positions=37, layer_norm_epsilon=1e-6,
         activation_function="gelu_pytorch_tanh"),
    dict(n_layer=1, n_head=3, n_embd=24, vocab_size=50257, n_positions=16, n_inner=96),
], ids=["small", "odd-vocab-and-context", "gpt2-vocab"])
def test_from_pretrained_matches_transformers(tmp_path, shape):
    hf = random_hf_model(**shape)
    ours = from_pretrained(str(hf_dir(tmp_path, hf)))
    assert ours.config.block_size == shape["n_positions"] and ours.config.vocab_size == shape["vocab_size"]
    assert ours.config.layer_norm_eps == shape.get("layer_norm_epsilon", 1e-5)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" and p.requires_grad for p in ours.parameters())
    assert_matches_hf(ours.eval(), hf)


def test_hub_style_file_without_prefix_and_with_mask_buffers(tmp_path):
    """The layout of openai-community/gpt2's model.safetensors: no "transformer." prefix, causal-mask buffers,
    lm_head stored next to wte, and a config.json with only the fields the original release wrote."""
    hf = random_hf_model(n_positions=20)
    tensors = {k.removeprefix("transformer."): v.contiguous().clone() for k, v in hf.state_dict().items()}
    for i in range(hf.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(20, 20)).view(1, 1, 20, 20)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    assert "lm_head.weight" in tensors and "wte.weight" in tensors and "h.0.attn.c_attn.weight" in tensors
    path = tmp_path / "hub"
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_ctx": 20, "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 20, "vocab_size": 100,
        "layer_norm_epsilon": 1e-5}))
    assert_matches_hf(from_pretrained(str(path)).eval(), hf)


def test_pytorch_model_bin(tmp_path):
    hf = random_hf_model(seed=3)
    path = tmp_path / "bin"
    path.mkdir()
    torch.save(hf.state_dict(), path / "pytorch_model.bin")  # with lm_head.weight, as old checkpoints have it
    hf.config.to_json_file(path / "config.json")
    assert_matches_hf(from_pretrained(str(path)).eval(), hf)


def test_sharded_safetensors(tmp_path):
    hf = random_hf_model(seed=4)
    path = tmp_path / "sharded"
    hf.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists() and not (path / "model.safetensors").exists()
    assert_matches_hf(from_pretrained(str(path)).eval(), hf)


def test_from_pretrained_state_dict_is_unpadded_fp32_with_our_names(tiny_hf_dir):
    path, hf = tiny_hf_dir
    model = from_pretrained(str(path))
    config, state_dict = model.config, model.state_dict()
    del state_dict["lm_head.weight"]
    assert config == GPTConfig(block_size=64, vocab_size=100, n_layer=2, n_head=2, n_embd=32)
    reference = GPT(config).state_dict()
    del reference["lm_head.weight"]
    assert state_dict.keys() == reference.keys()
    assert all(state_dict[k].shape == reference[k].shape and state_dict[k].dtype == torch.float32 for k in reference)
    # nn.Linear layout: the Conv1D weight of transformers, transposed
    assert torch.equal(state_dict["transformer.h.1.mlp.c_fc.weight"], hf.transformer.h[1].mlp.c_fc.weight.t())


# ----------------------------------------------------------------------------- padded vocabulary

def test_padded_vocab_gives_identical_logits_on_real_ids(tmp_path):
    hf = random_hf_model(n_layer=1, n_head=2, n_embd=16, vocab_size=50257, n_positions=16)
    path = hf_dir(tmp_path, hf)
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

@pytest.mark.parametrize("variant", [dict(), dict(padded_vocab_size=128, layer_norm_eps=1e-3), dict(bias=False)],
                         ids=["plain", "padded", "no-bias"])
def test_save_pretrained_loads_in_transformers_and_is_byte_stable(tmp_path, variant):
    ours = randomize(GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32, **variant))).eval()
    save_pretrained(ours, str(tmp_path / "a"))
    assert sorted(os.listdir(tmp_path / "a")) == ["config.json", "model.safetensors"]
    hf, info = GPT2LMHeadModel.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (hf.config.layer_norm_epsilon, hf.config.n_positions) == (ours.config.layer_norm_eps, 32)
    assert_matches_hf(ours, hf.eval())
    # transformers' own layout: prefixed names, Conv1D (in, out) weights, no lm_head, real vocabulary rows only
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    assert tensors.keys() == hf.transformer.state_dict(prefix="transformer.").keys()
    assert tensors["transformer.wte.weight"].shape == (100, 32)
    assert tensors["transformer.h.0.mlp.c_fc.weight"].shape == (32, 128)

    save_pretrained(from_pretrained(str(tmp_path / "a")), str(tmp_path / "b"))
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_save_pretrained_takes_a_gathered_state_dict(tmp_path):
    """The trainer passes the full state dict it gathered from FSDP; the model's own weights are not used."""
    cfg = GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32, padded_vocab_size=128)
    trained = randomize(GPT(cfg)).eval()
    save_pretrained(GPT(cfg), str(tmp_path / "out"), state_dict=trained.state_dict())
    assert_matches_hf(trained, GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval())
    with pytest.raises(ValueError, match=r"bad\): .*unexpected tensor _orig_mod\.transformer\.wpe\.weight"):
        save_pretrained(GPT(cfg), str(tmp_path / "bad"),
                                 state_dict={"_orig_mod." + k: v for k, v in trained.state_dict().items()})
    wider = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=64)).state_dict()
    with pytest.raises(ValueError, match=r"transformer\.wpe\.weight has shape \(32, 64\) .*expected \(32, 32\)"):
        save_pretrained(GPT(cfg), str(tmp_path / "bad"), state_dict=wider)
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- the hub, offline

def fake_hub_repo(cache, repo_id, files):
    """A Hugging Face cache entry as huggingface_hub lays it out, which it serves with HF_HUB_OFFLINE=1."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        (snapshot / name).write_bytes(source.read_bytes())


def test_hub_id_from_offline_cache(tmp_path, tiny_hf_dir):
    path, hf = tiny_hf_dir
    fake_hub_repo(tmp_path / "cache", "someorg/tiny-gpt2",
                  {name: path / name for name in ("config.json", "model.safetensors")})
    script = ("import sys, torch; from model import from_pretrained; m = from_pretrained('someorg/tiny-gpt2'); "
              "torch.save(m(torch.arange(24).view(2, 12))[0], sys.argv[1])")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "logits.pt")], cwd=ROOT, env=env, check=True,
                   timeout=120)
    with torch.no_grad():
        expected = hf(torch.arange(24).view(2, 12)).logits
    assert (torch.load(tmp_path / "logits.pt") - expected).abs().max().item() < TOL


def test_hub_downloads_safetensors_or_else_pytorch_model_bin(tmp_path, monkeypatch, tiny_hf_dir):
    """Against a stand-in for the online hub that serves what allow_patterns asks for: a repo with both formats
    costs one safetensors download (no pickle), an old repo with only pytorch_model.bin still loads."""
    import fnmatch

    import huggingface_hub

    hf = random_hf_model(seed=5)
    old_repo = tmp_path / "old-repo"
    old_repo.mkdir()
    torch.save(hf.state_dict(), old_repo / "pytorch_model.bin")
    hf.config.to_json_file(old_repo / "config.json")
    both_repo = tmp_path / "both-repo"
    both_repo.mkdir()
    for name in ("config.json", "model.safetensors"):
        (both_repo / name).write_bytes((tiny_hf_dir[0] / name).read_bytes())
    (both_repo / "pytorch_model.bin").write_bytes((old_repo / "pytorch_model.bin").read_bytes())
    (both_repo / "flax_model.msgpack").write_bytes(b"never downloaded")
    remote = {"someorg/old-gpt2": old_repo, "someorg/both-gpt2": both_repo}
    downloaded = []

    def snapshot_download(repo_id, allow_patterns):
        snapshot = tmp_path / "cache" / repo_id
        snapshot.mkdir(parents=True, exist_ok=True)
        for source in remote[repo_id].iterdir():
            if any(fnmatch.fnmatch(source.name, pattern) for pattern in allow_patterns):
                (snapshot / source.name).write_bytes(source.read_bytes())
                downloaded.append(source.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert_matches_hf(from_pretrained("someorg/old-gpt2").eval(), hf)
    assert sorted(downloaded) == ["config.json", "pytorch_model.bin"]
    downloaded.clear()
    assert_matches_hf(from_pretrained("someorg/both-gpt2").eval(), tiny_hf_dir[1])
    assert sorted(downloaded) == ["config.json", "model.safetensors"]


def test_unknown_hub_id_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="someorg/missing-gpt2: no such local directory, and not available"):
        from_pretrained("someorg/missing-gpt2")


# ----------------------------------------------------------------------------- bad input

def broken_copy(tmp_path, source, edit_config=None, edit_tensors=None, drop=()):
    path = tmp_path / "broken"
    path.mkdir()
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    if "config.json" not in drop:
        (path / "config.json").write_text(json.dumps(config))
    if "model.safetensors" not in drop:
        save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("case, error, message", [
    (dict(drop=("model.safetensors",)), FileNotFoundError, r"broken: no weights \(model\.safetensors"),
    (dict(drop=("config.json",)), FileNotFoundError, r"config\.json: missing"),
    (dict(edit_config=lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])),
     ValueError, r"config\.json: not a GPT-2 config \(model_type 'llama'\)"),
    (dict(edit_config=lambda c: c.update(activation_function="relu")),
     ValueError, r"config\.json: unsupported GPT-2 variant: activation_function 'relu'"),
    (dict(edit_config=lambda c: c.update(n_inner=100)),
     ValueError, r"config\.json: unsupported GPT-2 variant: n_inner 100"),
    (dict(edit_config=lambda c: c.update(scale_attn_by_inverse_layer_idx=True)),
     ValueError, r"config\.json: unsupported GPT-2 variant: a non-standard attention scaling"),
    (dict(edit_config=lambda c: c.update(n_head=3)),
     ValueError, r"config\.json: n_embd=32 is not divisible by n_head=3"),
    (dict(edit_config=lambda c: c.update(vocab_size=101)),
     ValueError, r"model\.safetensors: does not match its config\.json .*transformer\.wte\.weight has shape "
                 r"\(100, 32\), expected \(101, 32\)"),
    (dict(edit_tensors=lambda t: t.update({"transformer.wpe.weight": t["transformer.wpe.weight"][:10].clone()})),
     ValueError, r"model\.safetensors: .*transformer\.wpe\.weight has shape \(10, 32\), expected \(64, 32\)"),
    (dict(edit_tensors=lambda t: t.update({"transformer.h.0.attn.c_attn.weight":
                                           t["transformer.h.0.attn.c_attn.weight"].t().contiguous()})),
     ValueError, r"model\.safetensors: .*c_attn\.weight has shape \(96, 32\), expected \(32, 96\)"),
    (dict(edit_tensors=lambda t: t.pop("transformer.ln_f.bias")),
     ValueError, r"model\.safetensors: .*missing tensor transformer\.ln_f\.bias"),
    (dict(edit_tensors=lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(32)})),
     ValueError, r"model\.safetensors: .*unexpected tensor transformer\.h\.2\.ln_1\.weight"),
    (dict(edit_tensors=lambda t: t.update({"lm_head.weight": torch.zeros(100, 32)})),
     ValueError, r"model\.safetensors: .*lm_head\.weight differs from wte\.weight"),
], ids=["no-weights", "no-config", "llama", "relu", "n_inner", "attn-scaling", "heads", "vocab", "wpe", "untransposed",
        "missing", "unexpected", "untied"])
def test_bad_model_directory_gives_one_clear_error(tmp_path, tiny_hf_dir, case, error, message):
    path = broken_copy(tmp_path, tiny_hf_dir[0], **case)
    with pytest.raises(error, match=message) as excinfo:
        from_pretrained(str(path))
    assert str(path) in str(excinfo.value)


def test_unreadable_files_are_named(tmp_path, tiny_hf_dir):
    path = broken_copy(tmp_path, tiny_hf_dir[0])
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match=r"broken/model\.safetensors: not a readable weights file"):
        from_pretrained(str(path))
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken/config\.json: not valid JSON"):
        from_pretrained(str(path))
    with pytest.raises(ValueError, match=r"config\.json: a file; expected a model directory"):
        from_pretrained(str(path / "config.json"))
    (path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"broken/config\.json: not a config \(a JSON list"):
        from_pretrained(str(path))
    (path / "config.json").write_bytes((tiny_hf_dir[0] / "config.json").read_bytes())
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"broken/model\.safetensors\.index\.json: not a safetensors index"):
        from_pretrained(str(path))


# ----------------------------------------------------------------------------- init

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
    with torch.device("meta"):
        materialised = GPT(cfg)
    materialised.to_empty(device="cpu")
    torch.manual_seed(7)
    first.init_weights()
    torch.manual_seed(7)
    materialised.init_weights()
    assert materialised.lm_head.weight is materialised.transformer.wte.weight
    for (name, a), (_, b) in zip(first.state_dict().items(), materialised.state_dict().items()):
        assert torch.equal(a, b), name
    torch.manual_seed(8)
    materialised.init_weights()
    assert not torch.equal(first.transformer.wte.weight, materialised.transformer.wte.weight)


# ----------------------------------------------------------------------------- forward, generate, accounting

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


def test_forward_rejects_sequences_longer_than_block_size(tiny_hf_dir):
    model = from_pretrained(str(tiny_hf_dir[0]))
    with pytest.raises(ValueError, match="length 65 is longer than the model's block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_greedy_generation_matches_transformers(tiny_hf_dir):
    path, hf = tiny_hf_dir
    model = from_pretrained(str(path)).eval()
    prompt = torch.tensor([[5, 17, 42, 8], [1, 2, 3, 4]])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    assert torch.equal(model.generate(prompt, 12, temperature=0), expected)
    assert torch.equal(model.generate(prompt, 12, top_k=1), expected)


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


def test_num_params_counts_like_transformers():
    cfg = dict(block_size=64, vocab_size=100, n_layer=2, n_head=2, n_embd=32)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64))
    for model in (GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, padded_vocab_size=128))):
        assert model.num_params(non_embedding=False) == hf.num_parameters()
        assert model.num_params() == hf.num_parameters() - 64 * 32
