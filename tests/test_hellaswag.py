"""HellaSwag scoring equals a plain per-ending computation with transformers' GPT2LMHeadModel on the same weights and
one ending per forward of our own model, 2 ranks (torchrun, gloo, also FSDP2-sharded) give the counts of 1, bad files
are named with their line, and a download without network says what to do in one line."""
import gc
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
import hellaswag
from hf_files import from_pretrained
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


def tiny_gpt():
    """The same small random GPT in every process, built from model.py's own classes (an edited model's too), with
    save_tiny_gpt2's wide init."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=128, padded_vocab_size=None, n_embd=32, n_layer=2, n_head=2))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_gpt2(str(tmp_path_factory.mktemp("tiny_gpt2")), n_positions=128)


def reference_scores(logits_of, example, block_size):
    """The straightforward way: one ending per forward, the last block_size tokens of context + ending, the loss of
    every position, then the ending's. logits_of: tokens (1, T) -> logits (T, vocab)."""
    enc = gpt2_encoding()
    context = enc.encode(example["ctx"])
    sums, means = [], []
    for ending in example["endings"]:
        ending_tokens = enc.encode(" " + ending)
        tokens = (context + ending_tokens)[-block_size:]
        n_scored = min(len(ending_tokens), len(tokens) - 1)
        with torch.no_grad():
            logits = logits_of(torch.tensor([tokens]))
        losses = F.cross_entropy(logits[:-1], torch.tensor(tokens[1:]), reduction="none")[-n_scored:]
        sums.append(losses.sum().item())
        means.append(losses.mean().item())
    return sums, means


def expected_result(ref_sums, ref_means, examples):
    labels = torch.tensor([ex["label"] for ex in examples])
    correct_norm = (torch.tensor(ref_means).argmin(1) == labels).sum().item()
    correct = (torch.tensor(ref_sums).argmin(1) == labels).sum().item()
    return dict(acc_norm=correct_norm / len(examples), acc=correct / len(examples), correct_norm=correct_norm,
                correct=correct, total=len(examples))


@pytest.mark.gpt2
@pytest.mark.slow
@pytest.mark.parametrize("n_positions", [128, 24])  # 24: every row is longer, the context is cut from the left
def test_scores_match_transformers(tmp_path, n_positions):
    from transformers import GPT2LMHeadModel

    path = save_tiny_gpt2(str(tmp_path / "hf"), n_positions)
    ours, ref = from_pretrained(path), GPT2LMHeadModel.from_pretrained(path).eval()
    examples = hellaswag.load_examples(FIXTURE)

    sums, means = hellaswag.ending_losses(ours, hellaswag.render_all(examples), device="cpu")
    ref_sums, ref_means = zip(*(reference_scores(lambda t: ref(t, use_cache=False).logits[0], ex, n_positions)
                                for ex in examples))
    torch.testing.assert_close(sums, torch.tensor(ref_sums), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(means, torch.tensor(ref_means), atol=1e-5, rtol=1e-5)

    expected = expected_result(ref_sums, ref_means, examples)
    for batch_tokens in (1, 300):  # one example per forward, then up to three
        assert hellaswag.evaluate(ours, examples, device="cpu", batch_tokens=batch_tokens) == expected
    limited = hellaswag.evaluate(ours, examples, device="cpu", limit=5)
    assert limited == expected_result(ref_sums[:5], ref_means[:5], examples[:5])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["random GPT, padded vocabulary",
                                    pytest.param("HF fixture", marks=pytest.mark.gpt2)])
def test_batched_equals_one_ending_per_forward(hf_dir, source):
    """Several examples per forward, padded to the longest row, give the losses and counts of one row per forward."""
    from model import GPT, GPTConfig

    if source == "HF fixture":
        model = from_pretrained(hf_dir)
    else:
        torch.manual_seed(1)
        model = GPT(GPTConfig(block_size=48, vocab_size=50257, padded_vocab_size=50304, n_layer=2, n_head=2,
                              n_embd=32))
        with torch.no_grad():  # wider weights than GPT-2's init: endings differ by real margins, not by rounding
            for p in model.parameters():
                p.mul_(3)
    model.eval()
    examples = hellaswag.load_examples(FIXTURE)
    rendered = hellaswag.render_all(examples)
    ref_sums, ref_means = zip(*(reference_scores(lambda t: model(t)[0][0], ex,
                                                  model.config.block_size) for ex in examples))
    sums, means = hellaswag.ending_losses(model, rendered, device="cpu")  # all 11 examples, 44 rows, one forward
    assert sums.dtype == means.dtype == torch.float32
    # per-ending mean losses (about 11) within 1e-5; sums of up to 30 of them within fp32's rounding at their size
    torch.testing.assert_close(means, torch.tensor(ref_means), atol=1e-5, rtol=0)
    torch.testing.assert_close(sums, torch.tensor(ref_sums), atol=1e-4, rtol=0)
    expected = expected_result(ref_sums, ref_means, examples)
    for batch_tokens in (1, 200, 400, 8192):  # one example per forward, up to 2, 3, then all 11
        assert hellaswag.evaluate(model, rendered, device="cpu", batch_tokens=batch_tokens) == expected


@pytest.mark.slow
def test_rendered_once_then_reused(hf_dir, monkeypatch):
    """render_all's tokens stand in for the examples: evaluate never tokenizes them again."""

    model = tiny_gpt()
    examples = hellaswag.load_examples(FIXTURE)
    expected = hellaswag.evaluate(model, examples, device="cpu", limit=6)
    rendered = hellaswag.render_all(examples)
    assert [r.label for r in rendered] == [ex["label"] for ex in examples]

    def no_tokenizer():
        raise AssertionError("tokenized again")

    monkeypatch.setattr(hellaswag, "gpt2_encoding", no_tokenizer)
    assert hellaswag.evaluate(model, rendered, device="cpu", limit=6) == expected
    assert hellaswag.evaluate(model, rendered, device="cpu", limit=6, batch_tokens=400) == expected


def test_autocast_bf16_close_to_fp32(hf_dir):

    model = tiny_gpt()
    rendered = hellaswag.render_all(hellaswag.load_examples(FIXTURE))
    _, means = hellaswag.ending_losses(model, rendered, device="cpu")
    _, means_bf16 = hellaswag.ending_losses(model, rendered, device="cpu", autocast_dtype=torch.bfloat16)
    assert means_bf16.dtype == torch.float32
    torch.testing.assert_close(means_bf16, means, atol=0.1, rtol=0.02)
    assert not torch.equal(means_bf16, means)  # autocast really ran in bf16


def test_training_mode_restored_and_small_vocab_refused(hf_dir):
    from model import GPT, GPTConfig

    model = tiny_gpt().train()
    hellaswag.evaluate(model, hellaswag.load_examples(FIXTURE), device="cpu", limit=2)
    assert model.training
    with pytest.raises(ValueError, match="512"):
        hellaswag.evaluate(GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=1, n_head=2, n_embd=16)),
                           hellaswag.load_examples(FIXTURE), device="cpu")


def test_a_stop_request_ends_the_evaluation_between_batches(hf_dir):
    """The training loop passes `stopped` (a collective over its ranks): once it answers True no batch more runs."""
    model, calls = tiny_gpt(), []
    asked = lambda: calls.append(1) or len(calls) > 2  # noqa: E731 (stop before the third batch)
    assert hellaswag.evaluate(model, hellaswag.load_examples(FIXTURE), device="cpu", batch_tokens=1,
                              stopped=asked) is None
    assert len(calls) == 3 and model.training


@pytest.mark.slow
def test_two_ranks_give_the_counts_of_one(hf_dir, tmp_path):

    # 9 examples, one per forward: rank 0 scores 5 (5 forwards), rank 1 scores 4 (4 forwards + 1 to keep FSDP in step)
    expected = hellaswag.evaluate(tiny_gpt(), hellaswag.load_examples(FIXTURE), device="cpu", limit=9)
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

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    examples = hellaswag.load_examples(FIXTURE)
    model = tiny_gpt()
    results = {"plain": hellaswag.evaluate(model, examples, device="cpu", rank=rank, world_size=world_size, limit=9,
                                           batch_tokens=1)}
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    results["fsdp"] = hellaswag.evaluate(model, examples, device="cpu", rank=rank, world_size=world_size, limit=9,
                                         batch_tokens=1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # Free what refers to the process group (FSDP state) first: gloo otherwise aborts now and then
    # at exit ("terminate called without an active exception"), as train_gpt2.run() knows.
    del model
    gc.collect()
    dist.barrier()  # leave together
    dist.destroy_process_group()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_malformed_files_are_named_with_line(tmp_path):
    good = open(FIXTURE).read().splitlines()
    example = json.loads(good[0])
    bad_lines = ['{"ctx": "A man", "label": 0, "endings": [', json.dumps({**example, "endings": ["a", "b"]}),
                 json.dumps({**example, "label": 4}), json.dumps({k: v for k, v in example.items() if k != "ctx"}),
                 "[1, 2, 3]"]
    for i, bad_line in enumerate(bad_lines):
        path = write_lines(tmp_path / f"bad{i}.jsonl", [good[0], good[1], bad_line])
        with pytest.raises(ValueError, match=rf"bad{i}\.jsonl, line 3: "):
            hellaswag.load_examples(path)
    blank_lines_ok = write_lines(tmp_path / "blank.jsonl", [good[0], "", good[1], ""])
    assert len(hellaswag.load_examples(blank_lines_ok)) == 2
    with pytest.raises(ValueError, match=r"empty\.jsonl: "):
        hellaswag.load_examples(write_lines(tmp_path / "empty.jsonl", ["", ""]))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        hellaswag.load_examples(str(tmp_path / "missing.jsonl"))


def test_invalid_utf8_is_one_line_naming_the_file_and_line(tmp_path, hf_dir):
    """A jsonl with a byte that is not UTF-8 fails as a bad line does, not as a bare UnicodeDecodeError."""
    good = open(FIXTURE, "rb").read().splitlines()
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join([good[0], good[1].replace(b'"ctx": "', b'"ctx": "caf\xe9 ', 1), good[2]]) + b"\n")
    with pytest.raises(ValueError, match=r"latin1\.jsonl, line 2: not UTF-8 ") as error:
        hellaswag.load_examples(str(path))
    assert "\n" not in str(error.value) and error.value.__suppress_context__
    with pytest.raises(SystemExit, match=r"^hellaswag\.py: error: .*latin1\.jsonl, line 2: "):
        hellaswag.main(["--model", hf_dir, "--data", str(path)])


def test_download_once_then_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HELLASWAG_CACHE", str(cache))
    bad = write_lines(tmp_path / "corrupt.jsonl", ['{"ctx": "x"'])
    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "file://" + bad)
    with pytest.raises(ValueError, match="corrupt.jsonl, line 1: not valid JSON "):
        hellaswag.load_examples()
    assert not cache.exists() or os.listdir(cache) == []  # a bad download leaves nothing that looks cached

    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "file://" + FIXTURE)
    assert hellaswag.load_examples() == hellaswag.load_examples(FIXTURE)
    assert os.listdir(cache) == ["hellaswag_val.jsonl"]
    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "file://" + str(tmp_path / "gone.jsonl"))
    assert len(hellaswag.load_examples()) == len(hellaswag.load_examples(FIXTURE))  # served from the cache


def test_offline_download_says_what_to_do(tmp_path, monkeypatch, hf_dir):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HELLASWAG_CACHE", str(cache))

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    cached = str(cache / "hellaswag_val.jsonl")
    with pytest.raises(FileNotFoundError) as error:
        hellaswag.load_examples()
    message = str(error.value)
    for part in (hellaswag.HELLASWAG_URL, cached, "name resolution", "--data PATH", f"copy it to {cached}"):
        assert part in message
    assert "\n" not in message and error.value.__suppress_context__  # one line, no chained traceback
    assert os.listdir(cache) == []  # no temp file left behind
    with pytest.raises(SystemExit, match=r"^hellaswag\.py: error: .*is not cached and downloading https://"):
        hellaswag.main(["--model", hf_dir])


@pytest.mark.gpt2
def test_cli(hf_dir, capsys):

    expected = hellaswag.evaluate(from_pretrained(hf_dir), hellaswag.load_examples(FIXTURE), device="cpu", limit=7)
    result = hellaswag.main(["--model", hf_dir, "--data", FIXTURE, "--limit", "7", "--device", "cpu"])
    assert result == expected
    assert f"acc_norm {expected['acc_norm']:.4f} ({expected['correct_norm']}/7)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"hellaswag\.py: error: .*nothing\.jsonl"):
        hellaswag.main(["--model", hf_dir, "--data", "nothing.jsonl"])


if __name__ == "__main__":
    distributed_worker(*sys.argv[1:])
