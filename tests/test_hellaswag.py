"""HellaSwag scoring equals a plain per-ending computation with transformers' GPT2LMHeadModel on the same weights,
2 ranks (torchrun, gloo, also FSDP2-sharded) give the counts of 1, and bad files are named with their line."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
import hellaswag
from tokenizer import gpt2_encoding

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hellaswag_small.jsonl")


def save_tiny_gpt2(path, n_positions):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # a wide init spreads the random model's losses, so argmins are decided by real margins, not by rounding
    config = GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=0.3)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_gpt2(str(tmp_path_factory.mktemp("tiny_gpt2")), n_positions=128)


def reference_scores(hf_model, example, block_size):
    """The straightforward way: one ending at a time, the last block_size tokens of context + ending."""
    enc = gpt2_encoding()
    context = enc.encode(example["ctx"])
    sums, means = [], []
    for ending in example["endings"]:
        ending_tokens = enc.encode(" " + ending)
        tokens = (context + ending_tokens)[-block_size:]
        n_scored = min(len(ending_tokens), len(tokens) - 1)
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens]), use_cache=False).logits[0]
        losses = F.cross_entropy(logits[:-1], torch.tensor(tokens[1:]), reduction="none")[-n_scored:]
        sums.append(losses.sum().item())
        means.append(losses.mean().item())
    return sums, means


@pytest.mark.parametrize("n_positions", [128, 24])  # 24: every row is longer, the context is cut from the left
def test_scores_match_transformers(tmp_path, n_positions):
    from transformers import GPT2LMHeadModel
    from model import GPT

    path = save_tiny_gpt2(str(tmp_path / "hf"), n_positions)
    ours, ref = GPT.from_pretrained(path), GPT2LMHeadModel.from_pretrained(path).eval()
    examples = hellaswag.load_examples(FIXTURE)
    enc = gpt2_encoding()

    sums, means = hellaswag.ending_losses(ours, [hellaswag.render_example(ex, enc) for ex in examples], device="cpu")
    ref_sums, ref_means = zip(*(reference_scores(ref, ex, n_positions) for ex in examples))
    torch.testing.assert_close(sums, torch.tensor(ref_sums), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(means, torch.tensor(ref_means), atol=1e-5, rtol=1e-5)

    labels = torch.tensor([ex["label"] for ex in examples])
    correct_norm = (torch.tensor(ref_means).argmin(1) == labels).sum().item()
    correct = (torch.tensor(ref_sums).argmin(1) == labels).sum().item()
    expected = dict(acc_norm=correct_norm / len(examples), acc=correct / len(examples), correct_norm=correct_norm,
                    correct=correct, total=len(examples))
    for batch_size in (1, 3):
        assert hellaswag.evaluate(ours, examples, device="cpu", batch_size=batch_size) == expected

    limited = hellaswag.evaluate(ours, examples, device="cpu", limit=5)
    assert limited["total"] == 5
    assert limited["correct_norm"] == (torch.tensor(ref_means[:5]).argmin(1) == labels[:5]).sum().item()


def test_autocast_bf16_close_to_fp32(hf_dir):
    from model import GPT

    model = GPT.from_pretrained(hf_dir)
    rendered = [hellaswag.render_example(ex, gpt2_encoding()) for ex in hellaswag.load_examples(FIXTURE)]
    _, means = hellaswag.ending_losses(model, rendered, device="cpu")
    _, means_bf16 = hellaswag.ending_losses(model, rendered, device="cpu", autocast_dtype=torch.bfloat16)
    assert means_bf16.dtype == torch.float32
    torch.testing.assert_close(means_bf16, means, atol=0.1, rtol=0.02)
    assert not torch.equal(means_bf16, means)  # autocast really ran in bf16


def test_training_mode_restored_and_small_vocab_refused(hf_dir):
    from model import GPT, GPTConfig

    model = GPT.from_pretrained(hf_dir).train()
    hellaswag.evaluate(model, hellaswag.load_examples(FIXTURE), device="cpu", limit=2)
    assert model.training
    with pytest.raises(ValueError, match="GPT-2 vocabulary"):
        hellaswag.evaluate(GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=1, n_head=2, n_embd=16)),
                           hellaswag.load_examples(FIXTURE), device="cpu")


def test_two_ranks_give_the_counts_of_one(hf_dir, tmp_path):
    from model import GPT

    # 9 examples, 2 per forward: rank 0 scores 5 (3 forwards), rank 1 scores 4 (2 forwards + 1 to keep FSDP in step)
    expected = hellaswag.evaluate(GPT.from_pretrained(hf_dir), hellaswag.load_examples(FIXTURE), device="cpu", limit=9)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), hf_dir, str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            results = json.load(f)
        assert results == {"plain": expected, "fsdp": expected}


def distributed_worker(hf_dir, out_dir):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from model import GPT

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    examples = hellaswag.load_examples(FIXTURE)
    model = GPT.from_pretrained(hf_dir)
    results = {"plain": hellaswag.evaluate(model, examples, device="cpu", rank=rank, world_size=world_size, limit=9,
                                           batch_size=2)}
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    results["fsdp"] = hellaswag.evaluate(model, examples, device="cpu", rank=rank, world_size=world_size, limit=9,
                                         batch_size=2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_malformed_files_are_named_with_line(tmp_path):
    good = open(FIXTURE).read().splitlines()
    example = json.loads(good[0])
    cases = {
        "not valid JSON": [good[0], good[1], '{"ctx": "A man", "label": 0, "endings": ['],
        "'endings' must be a list of 4 strings": [good[0], good[1], json.dumps({**example, "endings": ["a", "b"]})],
        "'label' must be an integer 0-3": [good[0], good[1], json.dumps({**example, "label": 4})],
        "'ctx' must be a string": [good[0], good[1], json.dumps({k: v for k, v in example.items() if k != "ctx"})],
        "expected a JSON object": [good[0], good[1], "[1, 2, 3]"],
    }
    for i, (message, lines) in enumerate(cases.items()):
        path = write_lines(tmp_path / f"bad{i}.jsonl", lines)
        with pytest.raises(ValueError, match=rf"bad{i}\.jsonl, line 3: {message}"):
            hellaswag.load_examples(path)
    blank_lines_ok = write_lines(tmp_path / "blank.jsonl", [good[0], "", good[1], ""])
    assert len(hellaswag.load_examples(blank_lines_ok)) == 2
    with pytest.raises(ValueError, match=r"empty\.jsonl: no HellaSwag examples"):
        hellaswag.load_examples(write_lines(tmp_path / "empty.jsonl", ["", ""]))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        hellaswag.load_examples(str(tmp_path / "missing.jsonl"))


def test_download_once_then_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HELLASWAG_CACHE", str(cache))
    bad = write_lines(tmp_path / "corrupt.jsonl", ['{"ctx": "x"'])
    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "file://" + bad)
    with pytest.raises(ValueError, match="line 1: not valid JSON"):
        hellaswag.load_examples()
    assert not cache.exists() or os.listdir(cache) == []  # a bad download leaves nothing that looks cached

    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "file://" + FIXTURE)
    assert hellaswag.load_examples() == hellaswag.load_examples(FIXTURE)
    assert os.listdir(cache) == ["hellaswag_val.jsonl"]
    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "file://" + str(tmp_path / "gone.jsonl"))
    assert len(hellaswag.load_examples()) == len(hellaswag.load_examples(FIXTURE))  # served from the cache


def test_cli(hf_dir, capsys):
    from model import GPT

    expected = hellaswag.evaluate(GPT.from_pretrained(hf_dir), hellaswag.load_examples(FIXTURE), device="cpu", limit=7)
    result = hellaswag.main(["--model", hf_dir, "--data", FIXTURE, "--limit", "7", "--device", "cpu"])
    assert result == expected
    assert f"acc_norm {expected['acc_norm']:.4f} ({expected['correct_norm']}/7)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"hellaswag\.py: error: .*nothing\.jsonl: HellaSwag file not found"):
        hellaswag.main(["--model", hf_dir, "--data", "nothing.jsonl"])


if __name__ == "__main__":
    distributed_worker(*sys.argv[1:])
