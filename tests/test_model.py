"""model.py against the oracles: transformers' GPT2LMHeadModel (weights in both directions, logits, loss, generation,
init statistics), F.cross_entropy for the chunked loss head (eager and compiled), torch's FLOP counter; the export's
directory swap and write errors; reading a run's newest usable checkpoint."""
import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import ROOT
import model as model_module
from model import (GPT, MARKER, GPTConfig, chunked_cross_entropy, export_hf, from_pretrained, load_hf_sharded,
                   load_model, load_weights, newest_usable_checkpoint)

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


def test_a_pytorch_model_bin_alone_is_refused_with_the_way_out(tmp_path):
    hf = random_hf_model(seed=3)
    path = tmp_path / "bin"
    path.mkdir()
    torch.save(hf.state_dict(), path / "pytorch_model.bin")
    hf.config.to_json_file(path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"bin: no weights .*convert a pytorch_model\.bin to safetensors"):
        from_pretrained(str(path))


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
def test_export_loads_in_transformers_and_is_byte_stable(tmp_path, variant):
    ours = randomize(GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32, **variant))).eval()
    export_hf(ours, str(tmp_path / "a"))
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
    assert oct(os.stat(tmp_path / "a" / "model.safetensors").st_mode & 0o777) == "0o644"

    export_hf(from_pretrained(str(tmp_path / "a")), str(tmp_path / "b"))
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_an_activation_from_the_table_exports_loads_in_transformers_and_back(tmp_path):
    """GPTConfig(activation="relu2") trains a squared-ReLU MLP; its export says so in config.json, so transformers
    computes the same logits, and our loader reads the export back (as a checkpoint's saved config does)."""
    config = GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32, activation="relu2")
    ours = randomize(GPT(config)).eval()
    export_hf(ours, str(tmp_path / "relu2"))
    assert json.loads((tmp_path / "relu2" / "config.json").read_text())["activation_function"] == "relu2"
    assert_matches_hf(ours, GPT2LMHeadModel.from_pretrained(tmp_path / "relu2").eval())
    loaded = from_pretrained(str(tmp_path / "relu2"))
    assert loaded.config == config
    assert_matches_hf(loaded.eval(), GPT2LMHeadModel.from_pretrained(tmp_path / "relu2").eval())
    assert GPTConfig(**dataclasses.asdict(config)) == config  # what a checkpoint's train_state.json holds
    with pytest.raises(ValueError, match=r"^unknown activation 'swiglu'; choose one of gelu_new, .*relu2"):
        GPTConfig(activation="swiglu")


@pytest.mark.slow
def test_export_of_a_compiled_model_has_the_plain_names(tmp_path):
    """torch.compile(model) prefixes its parameters with _orig_mod.; the export is the plain model's."""
    trained = randomize(GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32,
                                      padded_vocab_size=128))).eval()
    export_hf(torch.compile(trained), str(tmp_path / "out"))
    assert_matches_hf(trained, GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval())


def test_export_shards_and_replaces_an_earlier_directory_whole(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32))
    hf = random_hf_model(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16)
    tokens = torch.arange(32).view(2, 16)
    export_hf(model, str(tmp_path / "out"), max_shard_size=20_000)
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "out")
    export_hf(from_pretrained(str(tmp_path / "out")), str(tmp_path / "one"))
    hf.save_pretrained(tmp_path / "out")  # transformers' single file over our shards: ours must go
    export_hf(from_pretrained(str(tmp_path / "out")), str(tmp_path / "out"))
    # the new directory replaces the old one whole: no stale shard, and no file of another writer either
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    with torch.no_grad():
        assert (from_pretrained(str(tmp_path / "out"))(tokens)[0] - hf(tokens).logits).abs().max() < 1e-5
    export_hf(model, str(tmp_path / "exported"))  # the sharded round trip changed no byte
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "exported" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_load_into_a_model_of_another_shape_names_the_file(tmp_path):
    random_hf_model(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16).save_pretrained(tmp_path / "hf")
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match=r"hf/config\.json: the model to load into differs: n_layer 3 \(file: 2\)"):
        load_hf_sharded(model, str(tmp_path / "hf"))


def small_model(seed=0):
    torch.manual_seed(seed)  # the init draws too
    return randomize(GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16)), seed).eval()


def test_export_extra_files_leftovers_and_refusals(tmp_path):
    """extra_files writes into the new directory before the swap; a killed export's .hf.PID.tmp / .hf.PID.old are
    removed by the next; a directory that is not a model is never replaced; a failing extra_files leaves the old."""
    (tmp_path / ".hf.99999.tmp").mkdir()
    (tmp_path / ".hf.99999.tmp" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".hf.99998.old").mkdir()
    (tmp_path / ".hf-notes.txt").write_text("not ours")
    seen = []

    def add_tokenizer(directory):
        seen.append(sorted(os.listdir(directory)))
        (pathlib.Path(directory) / "tok.json").write_text("{}")

    export_hf(small_model(), str(tmp_path / "hf"), extra_files=add_tokenizer)
    assert seen == [["config.json", "model.safetensors"]]
    assert sorted(os.listdir(tmp_path)) == [".hf-notes.txt", "hf"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "tok.json"]
    before = (tmp_path / "hf" / "model.safetensors").read_bytes()

    def failing(directory):
        raise OSError(f"cannot write {directory}/tok.json: No space left on device")

    with pytest.raises(OSError, match="tok.json: No space left"):
        export_hf(small_model(seed=1), str(tmp_path / "hf"), extra_files=failing)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == [".hf-notes.txt", "hf"]
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_text("x")
    with pytest.raises(ValueError, match="photos: exists and is not a model directory; not replaced"):
        export_hf(small_model(), str(tmp_path / "photos"))
    assert os.listdir(tmp_path / "photos") == ["cat.jpg"]


@pytest.mark.parametrize("failing", ["save_file", "write_text", "rename"])
def test_export_write_error_is_one_line_naming_the_file(tmp_path, monkeypatch, failing):
    export_hf(small_model(), str(tmp_path / "hf"))
    before = {name: (tmp_path / "hf" / name).read_bytes() for name in os.listdir(tmp_path / "hf")}

    def full_disk(*args, **kwargs):
        if failing == "save_file":  # what safetensors raises on a full disk
            raise model_module.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                               "message: \"No space left on device\" })")
        raise OSError(28, "No space left on device")

    if failing == "save_file":
        monkeypatch.setattr(model_module, "save_file", full_disk)
    elif failing == "write_text":
        monkeypatch.setattr(model_module.pathlib.Path, "write_text", full_disk)
    else:  # neither the exchange nor the fallback renames can move the new directory in
        monkeypatch.setattr(model_module.ctypes, "CDLL", lambda *args, **kwargs: object())
        monkeypatch.setattr(model_module.os, "rename", full_disk)
    with pytest.raises(OSError) as excinfo:
        export_hf(small_model(seed=1), str(tmp_path / "hf"))
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("cannot write ") and "No space left" in message
    assert str(tmp_path) in message
    assert {name: (tmp_path / "hf" / name).read_bytes() for name in os.listdir(tmp_path / "hf")} == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the new directory was removed at once


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-fallback"])
def test_export_swap_leaves_a_complete_directory(tmp_path, monkeypatch, exchange):
    """A reader polling hf/ during repeated exports always finds config.json and the weights (with renameat2; the
    fallback has a window of two renames, which it must still close with a complete directory)."""
    import threading

    if not exchange:
        monkeypatch.setattr(model_module.ctypes, "CDLL", lambda *args, **kwargs: object())
    export_hf(small_model(), str(tmp_path / "hf"))
    missing, done = [], threading.Event()

    def reader():
        while not done.is_set():
            try:
                fd = os.open(tmp_path / "hf", os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:  # the fallback's window between its two renames
                # A lookup that races a rename may fail once although the name always exists:
                # only a name still missing on a second look counts.
                if not os.path.exists(tmp_path / "hf"):
                    missing.append(set())
                continue
            try:
                names = set(os.listdir(fd))
                # A directory swapped out and deleted while it was listed is not what hf/ names: skip it.
                if {"config.json", "model.safetensors"} - names and os.fstat(fd).st_nlink > 0:
                    missing.append(names)
            finally:
                os.close(fd)

    thread = threading.Thread(target=reader)
    thread.start()
    for seed in range(8):
        export_hf(small_model(seed), str(tmp_path / "hf"))
    done.set()
    thread.join()
    if exchange:
        assert not missing
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    assert_matches_hf(small_model(7), GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval())


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


@pytest.mark.slow
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


def test_hub_downloads_safetensors_and_never_the_pickle(tmp_path, monkeypatch, tiny_hf_dir):
    """Against a stand-in for the online hub that serves what allow_patterns asks for: a repo with both formats
    costs one safetensors download (no pickle); an old repo with only pytorch_model.bin is refused."""
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
    with pytest.raises(FileNotFoundError, match=r"old-gpt2: no weights .*convert a pytorch_model\.bin"):
        from_pretrained("someorg/old-gpt2")
    assert downloaded == ["config.json"]
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
    (dict(edit_config=lambda c: c.update(activation_function="mish")),
     ValueError, r"config\.json: unknown activation 'mish'; choose one of gelu_new, "),
    (dict(edit_config=lambda c: c.update(n_inner=100)),
     ValueError, r"config\.json: unsupported GPT-2 variant: n_inner 100, not None or 128"),
    (dict(edit_config=lambda c: c.update(scale_attn_by_inverse_layer_idx=True)),
     ValueError, r"config\.json: unsupported GPT-2 variant: scale_attn_by_inverse_layer_idx True, not False"),
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
], ids=["no-weights", "no-config", "llama", "mish", "n_inner", "attn-scaling", "heads", "vocab", "wpe", "untransposed",
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
    with pytest.raises(ValueError, match=r"broken/config\.json: Expecting property name"):
        from_pretrained(str(path))
    with pytest.raises(FileNotFoundError, match=r"config\.json: no such model directory"):
        from_pretrained(str(path / "config.json"))
    (path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"broken/config\.json: not a config \(a JSON list"):
        from_pretrained(str(path))
    (path / "config.json").write_bytes((tiny_hf_dir[0] / "config.json").read_bytes())
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"broken/model\.safetensors\.index\.json: not a readable weights file "
                                         r"\(KeyError: 'weight_map'\)"):
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
    assert model.lm_head.weight is model.transformer.wte.weight  # one tied tensor takes both gradients
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
    explained = torch._dynamo.explain(model_module._real_vocab_chunk_loss)(logits, torch.randint(0, 60, (50,)), 60)
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


def z_loss_chunk(logits, targets):
    """chunk_loss with a z-loss term (PaLM's), as a researcher would write it: 1e-4 * logsumexp^2 per scored row."""
    logits = logits.float()
    z = torch.logsumexp(logits, dim=-1)
    scored = targets != -100
    return F.cross_entropy(logits, targets, reduction="sum") + 1e-4 * (z.square() * scored).sum()


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


def test_a_runs_ckpt_directory_given_as_a_model_says_what_works(tmp_path):
    """--init_from=out_demo/ckpt (one level off): the error says a run's out_dir or ckpt/step_N is read."""
    (tmp_path / "ckpt" / "step_00000002").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"ckpt/config\.json: missing; a GPT-2 model directory needs config\.json "
                                                r"\(a train_gpt2\.py run is read from its out_dir or from one "
                                                r"checkpoint, out_dir/ckpt/step_N\)"):
        model_module.resolve_pretrained(str(tmp_path / "ckpt"))


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


# ----------------------------------------------------------------------------- a run's checkpoints, read-only

def write_checkpoint(run, step, model):
    """A checkpoint laid out as train_gpt2.py writes it: DCP model files, rng.pt, train_state.json, then the marker
    with every file's size."""
    path = run / "ckpt" / f"step_{step:08d}"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path))
    torch.save({"torch": torch.get_rng_state()}, path / "rng.pt")
    (path / "train_state.json").write_text(json.dumps(dict(step=step, consumed_samples=8 * step,
                                                           model_config=dataclasses.asdict(model.config))))
    sizes = {name: os.path.getsize(path / name) for name in sorted(os.listdir(path))}
    (path / MARKER).write_text(json.dumps(dict(step=step, sizes=sizes)))
    return path


def gpt2_vocab_model(seed):
    return randomize(GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)), seed)


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_load_model_skips_a_damaged_newest_checkpoint_and_renames_nothing(tmp_path, capsys, damage):
    run = tmp_path / "run"
    good = gpt2_vocab_model(1)
    write_checkpoint(run, 10, good)
    bad = gpt2_vocab_model(2)
    if damage == "nan":
        with torch.no_grad():
            bad.transformer.h[0].mlp.c_fc.weight[3, 4] = float("nan")
    newest = write_checkpoint(run, 20, bad)
    if damage == "truncated":
        shard = next(newest.glob("*.distcp"))
        os.truncate(shard, os.path.getsize(shard) // 2)
    before = sorted(os.listdir(run / "ckpt"))
    assert same_weights(load_model(str(run)), good)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"skipping damaged checkpoint {newest}: ")
    assert said[0].endswith("left in place") and ("truncated" if damage == "truncated" else "NaN or inf") in said[0]
    assert sorted(os.listdir(run / "ckpt")) == before
    # named directly, the checkpoint is loaded as named, and refused in one line when it cannot be
    if damage == "nan":
        with pytest.raises(ValueError, match=r"step_00000020: the weights hold NaN or inf \(transformer\.h\.0\.mlp"):
            load_model(str(newest))
        # the resume path (not read-only) renames it aside, like any damaged checkpoint
        found, messages = newest_usable_checkpoint(str(run / "ckpt"), load=lambda path: load_weights(path, bad))
        assert found == str(run / "ckpt" / "step_00000010") and "kept as" in messages[0]
        assert [name for name in os.listdir(run / "ckpt") if name.startswith("step_00000020.damaged-")]


def test_a_checkpoint_deleted_while_it_is_read_sends_the_reader_to_the_newer_one(tmp_path, capsys):
    """A live run with ckpt_keep=1 writes step 20 and deletes step 10 while a reader loads step 10: the reader
    looks again and loads step 20, and calls nothing damaged."""
    run = tmp_path / "run"
    write_checkpoint(run, 10, gpt2_vocab_model(1))
    newer = gpt2_vocab_model(2)
    tried = []

    def load(path):
        tried.append(os.path.basename(path))
        if len(tried) == 1:  # the run moves on in the middle of this read
            write_checkpoint(run, 20, newer)
            shutil.rmtree(path)
            raise RuntimeError(f"{path}/.metadata: No such file or directory (metadata is None)")
        return load_weights(path, model)

    model = gpt2_vocab_model(3)
    found, messages = newest_usable_checkpoint(str(run / "ckpt"), read_only=True, load=load)
    assert found.endswith("step_00000020") and messages == [] and tried == ["step_00000010", "step_00000020"]
    assert same_weights(model, newer)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_sample_cli_with_a_damaged_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run, 10, gpt2_vocab_model(1))
    newest = write_checkpoint(run, 20, gpt2_vocab_model(2))
    (newest / "rng.pt").write_bytes(b"")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--model", str(run), "--prompt", "Hi",
                             "--num-samples", "1", "--max-new-tokens", "3", "--device", "cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--- sample 1/1 ---" in result.stdout and "Traceback" not in result.stderr
    said = result.stderr.strip().splitlines()
    assert len(said) == 1
    assert said[0].startswith(f"skipping damaged checkpoint {newest}: {newest / 'rng.pt'}: truncated")
    assert said[0].endswith("left in place")
    assert os.path.isdir(newest)
