"""model.py's sharded paths on 2 gloo ranks (torchrun) against the oracles: transformers' GPT2LMHeadModel (logits,
loading our export), torch's own full-state-dict gathering, and init_weights after torch.manual_seed for init."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import ROOT
from model import GPT, GPTConfig, from_pretrained, init_sharded

WORKER = os.path.join(ROOT, "tests", "model_distributed_worker.py")


def random_hf_model(seed=0, **config):
    """A transformers GPT-2 with every parameter random, biases and LayerNorms included, so no mapping hides."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def write_fixture(path, **config):
    """transformers' own export of a random GPT-2; returns the model."""
    hf = random_hf_model(**config)
    hf.save_pretrained(path)
    return hf


def write_edge_fixture(edge):
    """A model whose FSDP2 shards on 2 ranks are uneven (9-wide vectors, 27-row c_attn), empty (wpe has 1 row) or
    all padding (rank 1's wte rows 32:64 are past vocab 30), plus an untied lm_head and an unreadable file."""
    write_fixture(edge / "safetensors", n_layer=1, n_head=3, n_embd=9, vocab_size=30, n_positions=1)
    (edge / "untied").mkdir()
    tensors = load_file(edge / "safetensors" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    tensors["lm_head.weight"][3, 0] += 1  # a row rank 0 holds; rank 1 must fail as well
    save_file(tensors, edge / "untied" / "model.safetensors")
    (edge / "broken").mkdir()
    (edge / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    for case in ("untied", "broken"):
        (edge / case / "config.json").write_bytes((edge / "safetensors" / "config.json").read_bytes())


def torchrun(nproc, *args):
    """Start the worker on `nproc` gloo ranks."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), WORKER, ROOT, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def results(launch):
    """The `RESULT` lines rank 0 printed, as dicts."""
    stdout, stderr = launch.communicate(timeout=300)
    assert launch.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in stdout.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """A GPT-2 of ~20M parameters (vocab 50257, 6 layers, n_embd 256, an odd context of 127) and the edge model,
    then every launch at once (each memory figure is one process's own peak, whatever runs beside it)."""
    root = tmp_path_factory.mktemp("hf_sharded")
    hf = write_fixture(root / "hf", n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=127)
    write_edge_fixture(root / "edge")
    (root / "out").mkdir()
    started = dict(checks=torchrun(2, "checks", root / "hf", root / "edge", root / "out"),
                   init=torchrun(1, "init", root / "hf", root / "edge"),
                   sharded=torchrun(2, "memory", "sharded", root / "hf"),
                   rank0=torchrun(2, "memory", "rank0", root / "hf"))
    try:
        return root, hf, {name: results(launch) for name, launch in started.items()}
    finally:
        for launch in started.values():
            launch.kill()


@pytest.mark.slow  # torchrun launches
def test_sharded_load_equals_the_full_load_and_transformers(launches):
    root, hf, found = launches
    loads = [r for r in found["checks"] if r.get("check") == "load"]
    assert [(r["vocab"], r["equal"]) for r in loads] == [(50257, True), (30, True)]
    ours = torch.load(root / "out" / "logits.pt")
    with torch.no_grad():
        expected = hf(ours["tokens"]).logits
    assert (ours["logits"] - expected).abs().max().item() < 1e-5


def init_results(ranks):
    return [dict(check="init", vocab=vocab, ranks=ranks, equal=True) for vocab in (50257, 30)]


@pytest.mark.slow  # torchrun launches
def test_init_on_two_ranks_is_init_weights_after_manual_seed(launches):
    assert [r for r in launches[2]["checks"] if r.get("check") == "init"] == init_results(2)


@pytest.mark.slow  # torchrun launches
def test_init_on_one_rank_is_the_same(launches):
    assert launches[2]["init"] == init_results(1)


def test_init_sharded_on_a_plain_model_leaves_the_global_rng_alone():
    config = GPTConfig(block_size=16, vocab_size=50, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    reference = GPT(config)
    torch.manual_seed(5)
    reference.init_weights()
    reference = reference.state_dict()
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    torch.manual_seed(99)
    before = torch.get_rng_state()
    init_sharded(model, 5)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(model.state_dict()[k], reference[k]) for k in reference)


@pytest.mark.slow  # torchrun launches
def test_export_loads_in_transformers_single_and_sharded(launches):
    root, hf, found = launches
    out = root / "out"
    assert {"check": "export-read-back", "equal": True} in found["checks"]
    assert sorted(os.listdir(out / "single")) == ["config.json", "model.safetensors"]
    shards = sorted(f for f in os.listdir(out / "shards") if f.endswith(".safetensors"))
    assert len(shards) >= 3 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    index = json.loads((out / "shards" / "model.safetensors.index.json").read_text())
    reference = load_file(root / "hf" / "model.safetensors")  # transformers' own file of the same weights
    assert index["weight_map"].keys() == reference.keys() and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    for name in shards:
        for key, tensor in load_file(out / "shards" / name).items():
            assert index["weight_map"][key] == name and torch.equal(tensor, reference[key]), key
    tokens = torch.arange(200).view(2, 100) * 241 % 50257
    with torch.no_grad():
        expected = hf(tokens).logits
        for variant in ("single", "shards"):
            exported, info = GPT2LMHeadModel.from_pretrained(out / variant, output_loading_info=True)
            assert not any(info.values()), info
            assert (exported.eval()(tokens).logits - expected).abs().max().item() < 1e-5
        assert (from_pretrained(str(out / "shards")).eval()(tokens)[0] - expected).abs().max().item() < 1e-5


@pytest.mark.slow  # torchrun launches
def test_errors_reach_every_rank_alike(launches):
    errors = {r["case"]: r["messages"] for r in launches[2]["checks"] if r.get("check") == "error"}
    for case, expected in (("untied", "lm_head.weight differs from wte.weight"),
                           ("broken", "model.safetensors: not a readable weights file")):
        assert len(set(errors[case])) == 1 and expected in errors[case][0] and case in errors[case][0], errors


@pytest.mark.slow  # torchrun launches
def test_sharded_load_peak_memory_is_well_under_rank0s(launches):
    """Per-rank peak resident memory of the load (above the materialised shards), each way in a fresh launch."""
    (sharded,), (rank0,) = launches[2]["sharded"], launches[2]["rank0"]
    ratio = max(sharded["peak_mb"]) / max(rank0["peak_mb"])
    print(f"peak MB per rank: sharded {sharded['peak_mb']}, rank 0 + broadcast {rank0['peak_mb']}; ratio {ratio:.2f}")
    assert ratio < 0.7

