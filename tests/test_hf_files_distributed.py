"""hf_files.py's sharded paths on 2 gloo ranks (torchrun) against the oracles: transformers' GPT2LMHeadModel (logits,
loading our export), torch's own full-state-dict gathering; errors that reach every rank alike; the peak memory of the
per-shard load against rank 0's full load. And the same paths on one rank in this process (DTensor parameters)."""
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from transformers import GPT2LMHeadModel

from conftest import launch_worker, random_hf_model, worker_results
from hf_files import export_hf, from_pretrained, load_hf_sharded
from hf_files_distributed_worker import config_of
from model_distributed_worker import sharded_model

WORKER = "hf_files_distributed_worker.py"
# Hugging Face's GPT-2 files: an edit of model.py's architecture is expected to fail these.
pytestmark = pytest.mark.gpt2

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


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """A GPT-2 of ~20M parameters (vocab 50257, 6 layers, n_embd 256, an odd context of 127) and the edge model,
    then every launch at once (each memory figure is one process's own peak, whatever runs beside it)."""
    root = tmp_path_factory.mktemp("hf_sharded")
    hf = write_fixture(root / "hf", n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=127)
    write_edge_fixture(root / "edge")
    (root / "out").mkdir()
    started = dict(checks=launch_worker(WORKER, 2, "checks", root / "hf", root / "edge", root / "out"),
                   sharded=launch_worker(WORKER, 2, "memory", "sharded", root / "hf"),
                   rank0=launch_worker(WORKER, 2, "memory", "rank0", root / "hf"))
    try:
        return root, hf, {name: worker_results(launch) for name, launch in started.items()}
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


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (world size 1), destroyed afterwards: FSDP2 then makes every
    parameter a DTensor, and hf_files takes its sharded paths (local blocks, collectives) in this process."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # what still refers to the group (FSDP state) goes first, as train_gpt2.run does
        dist.destroy_process_group()


def test_the_sharded_paths_on_one_rank_load_and_export_what_the_plain_ones_do(tmp_path, one_rank_group):
    """The edge model (9-wide, one position, 30 rows of vocabulary padded to 64) through load_hf_sharded and export_hf
    with DTensor parameters: the plain model's numbers, the same exported bytes, and the untied lm_head refused."""
    edge = tmp_path / "edge"
    write_edge_fixture(edge)
    config = config_of(str(edge / "safetensors"))
    model = sharded_model(config)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    load_hf_sharded(model, str(edge / "safetensors"))
    plain = from_pretrained(str(edge / "safetensors"), padded_vocab_size=config.padded_vocab_size)
    plain_params = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), plain_params[name]), name
    export_hf(model, str(tmp_path / "sharded"))
    export_hf(plain, str(tmp_path / "plain"))
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "sharded" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    with pytest.raises(ValueError, match=r"untied/model\.safetensors: lm_head\.weight differs from wte\.weight"):
        load_hf_sharded(sharded_model(config), str(edge / "untied"))
