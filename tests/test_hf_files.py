"""hf_files.py against the oracles: transformers' GPT2LMHeadModel (weights in both directions, logits), its own
save_pretrained layouts (one file, shards, the hub's older layout); the export's directory swap and write errors; hub
ids offline and against a stand-in hub; one clear error for each kind of bad model directory."""
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel

import hf_files
from conftest import ROOT, TOL, assert_matches_hf, randomize, random_hf_model, save_hf_dir
from hf_files import export_hf, from_pretrained, load_hf_sharded, resolve_pretrained
from processes import error_line
from model import GPT, GPTConfig

# Hugging Face's GPT-2 files: an edit of model.py's architecture is expected to fail these.
pytestmark = pytest.mark.gpt2


# ----------------------------------------------------------------------------- loading Hugging Face weights

@pytest.mark.parametrize("shape", [
    dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64),
    dict(n_layer=3, n_head=4, n_embd=48, vocab_size=777, n_positions=37, layer_norm_epsilon=1e-6,
         activation_function="gelu_pytorch_tanh"),
    dict(n_layer=1, n_head=3, n_embd=24, vocab_size=50257, n_positions=16, n_inner=96),
], ids=["small", "odd-vocab-and-context", "gpt2-vocab"])
def test_from_pretrained_matches_transformers(tmp_path, shape):
    hf = random_hf_model(**shape)
    ours = from_pretrained(str(save_hf_dir(tmp_path, hf)))
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


def test_load_into_a_model_of_another_shape_names_the_file(tmp_path):
    random_hf_model(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16).save_pretrained(tmp_path / "hf")
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match=r"hf/config\.json: the model to load into differs: n_layer 3 \(file: 2\)"):
        load_hf_sharded(model, str(tmp_path / "hf"))


def test_a_runs_ckpt_directory_given_as_a_model_says_what_works(tmp_path):
    """--init_from=out_demo/ckpt (one level off): the error says a run's out_dir or ckpt/step_N is read."""
    (tmp_path / "ckpt" / "step_00000002").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"ckpt/config\.json: missing; a GPT-2 model directory needs config\.json "
                                                r"\(a train_gpt2\.py run is read from its out_dir or from one "
                                                r"checkpoint, out_dir/ckpt/step_N\)"):
        resolve_pretrained(str(tmp_path / "ckpt"))


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
        if failing == "save_file":  # what safetensors raised on a full tmpfs
            raise hf_files.SafetensorError("Error while serializing: I/O error: No space left on device "
                                           "(os error 28)")
        raise OSError(28, "No space left on device")

    if failing == "save_file":
        monkeypatch.setattr(hf_files, "save_file", full_disk)
    elif failing == "write_text":
        monkeypatch.setattr(hf_files.pathlib.Path, "write_text", full_disk)
    else:  # neither the exchange nor the fallback renames can move the new directory in
        monkeypatch.setattr(hf_files.ctypes, "CDLL", lambda *args, **kwargs: object())
        monkeypatch.setattr(hf_files.os, "rename", full_disk)
    with pytest.raises(OSError) as excinfo:
        export_hf(small_model(seed=1), str(tmp_path / "hf"))
    # the run's error line: the directory, the cause and the way out, as for a checkpoint
    message = error_line(excinfo.value)
    assert message == (f"cannot write {tmp_path / 'hf'}: No space left on device; the disk is full: "
                       "free some space or choose another out_dir")
    assert {name: (tmp_path / "hf" / name).read_bytes() for name in os.listdir(tmp_path / "hf")} == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the new directory was removed at once


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-fallback"])
def test_export_swap_leaves_a_complete_directory(tmp_path, monkeypatch, exchange):
    """A reader polling hf/ during repeated exports always finds config.json and the weights (with renameat2; the
    fallback has a window of two renames, which it must still close with a complete directory)."""
    import threading

    if not exchange:
        monkeypatch.setattr(hf_files.ctypes, "CDLL", lambda *args, **kwargs: object())
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
    script = ("import sys, torch; from hf_files import from_pretrained; m = from_pretrained('someorg/tiny-gpt2'); "
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


def test_without_transformers_the_export_check_holds_the_tensors_to_gpt2s_and_says_the_function_was_not_checked(
        monkeypatch):
    """transformers is no requirement of a run: without it the check before step 1 compares the tensors' names and
    shapes with GPT-2's (written out from the config, not from model.py's classes) and says what it did not check."""
    real_find_spec = hf_files.importlib.util.find_spec
    monkeypatch.setattr(hf_files.importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else real_find_spec(name, *args))
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    exportable, line, _ = hf_files.check_function(config)
    assert exportable and line == ("hf/: the tensors are GPT-2's by name and shape; whether transformers computes what "
                                   "the model does was not checked (transformers is not installed)")
    monkeypatch.setattr(hf_files, "GPT", type("Wider", (GPT,), {}))  # an edit that adds a tensor GPT-2 lacks
    original_init = GPT.__init__

    def with_a_gain(self, config):
        original_init(self, config)
        self.gain = torch.nn.Parameter(torch.ones(config.n_embd))

    monkeypatch.setattr(hf_files.GPT, "__init__", with_a_gain)
    exportable, line, _ = hf_files.check_function(config)
    assert not exportable and line.startswith("hf/ will not be written: the model is not GPT-2's architecture (gain,")


# ----------------------------------------------------------------------------- the check of the model's function

def windowed_forward(window):
    """CausalSelfAttention.forward attending to the last `window` positions only: the same tensors as GPT-2's."""
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        i = torch.arange(T)
        near = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=near)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
    return forward


def test_the_check_runs_the_whole_context_and_finds_a_window_past_64_positions(monkeypatch):
    """Sliding-window attention with a window of 100: a check of the first 64 positions finds GPT-2; the check over
    the model's whole context (128 positions) finds the difference, and its fingerprint moves too."""
    import model as model_module
    config = GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=2, n_embd=32)
    exportable, line, plain = hf_files.check_function(config)
    assert exportable and "on 128 positions" in line
    monkeypatch.setattr(model_module.CausalSelfAttention, "forward", windowed_forward(100))
    assert hf_files.check_function(dataclasses.replace(config, block_size=64))[0]
    exportable, line, windowed = hf_files.check_function(config)
    assert not exportable and "transformers' GPT-2 computes other logits" in line, line
    assert hf_files.fingerprint_difference(plain, windowed) > hf_files.FINGERPRINT_TOLERANCE
    assert plain[:2 * 100] == windowed[:2 * 100]  # the first 100 positions are GPT-2's: each has two numbers


class Untied(GPT):
    """model.py with the tie deleted: a head of its own."""

    def __init__(self, config):
        super().__init__(config)
        self.lm_head.weight = torch.nn.Parameter(torch.empty_like(self.lm_head.weight))
        self.init_weights()


def test_an_untied_head_exports_untied_and_reads_back(tmp_path, monkeypatch):
    """An untied head is written as lm_head.weight with tie_word_embeddings false; transformers computes the model's
    logits from it, model.py's untied classes read it back, and tied ones refuse it in one line."""
    config = GPTConfig(block_size=32, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    ours = Untied(config).eval()
    assert ours.lm_head.weight is not ours.transformer.wte.weight
    assert torch.equal(ours.lm_head.weight[100:], torch.zeros(28, 16))  # padded rows, as wte's
    export_hf(ours, tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False
    assert load_file(tmp_path / "hf" / "model.safetensors")["lm_head.weight"].shape == (100, 16)
    ids = hf_files.check_ids(config)
    with torch.no_grad():
        assert (ours(ids)[0] - hf_files.transformers_logits(str(tmp_path / "hf"), ids)).abs().max() < TOL
    monkeypatch.setattr(hf_files, "GPT", Untied)
    back = from_pretrained(str(tmp_path / "hf"), padded_vocab_size=128)
    assert torch.equal(back.lm_head.weight, ours.lm_head.weight)
    monkeypatch.setattr(hf_files, "GPT", GPT)
    with pytest.raises(ValueError, match=r"model\.safetensors: lm_head\.weight differs from wte\.weight, and model\.py "
                                         r"ties its head to wte \(delete the tie in GPT\.__init__"):
        from_pretrained(str(tmp_path / "hf"))
    with monkeypatch.context() as patched:
        patched.setattr(hf_files, "GPT", Untied)
        assert hf_files.check_function(config)[0]  # the check before step 1 agrees


def test_the_check_takes_every_core_under_torchrun_and_gives_them_back(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 and the other ranks wait for rank 0's check: it runs on every core the process
    may use, and the run's own thread count is put back after."""
    seen, real_forward = [], GPT.forward

    def forward(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf_files.check_function(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16), export=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen == [len(os.sched_getaffinity(0))]


def test_the_check_leaves_no_import_thread_running(monkeypatch):
    """transformers is imported in a thread beside the check's forward; the check waits for it whatever it finds, since
    a run that exits at once (a refused resume) while a thread imports may abort (SIGABRT, seen in CI)."""
    import threading

    def importing():
        return [t for t in threading.enumerate() if t.name == "import transformers" and t.is_alive()]

    config = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    started = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    assert hf_files.check_function(config)[0] and not importing()
    assert started[0] == "import transformers"

    class Gained(GPT):  # a tensor GPT-2 has no place for: nothing to compare, nothing imported
        def __init__(self, config):
            super().__init__(config)
            self.gain = torch.nn.Parameter(torch.ones(config.n_embd))

    monkeypatch.setattr(hf_files, "GPT", Gained)
    started.clear()
    assert not hf_files.check_function(config)[0] and started == [] and not importing()
