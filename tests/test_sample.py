"""Sampling: greedy decoding equals transformers' generate on the same weights; seeds reproduce, the caller's RNG is
left alone; the CLI reads HF directories and training checkpoints and names what is wrong."""
import os

import pytest
import torch

from conftest import ROOT
import sample
from tokenizer import gpt2_encoding


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny_gpt2"))
    # a wide init gives peaked next-token distributions, so greedy choices are not decided by rounding
    config = GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.3)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.gpt2
@pytest.mark.slow
def test_greedy_matches_transformers_generate(hf_dir):
    from transformers import GPT2LMHeadModel

    prompt = "First Citizen:\nBefore we proceed any further, hear me speak."
    ours = sample.load_model(hf_dir)
    [text] = sample.sample_texts(ours, prompt, num_samples=1, max_new_tokens=40, top_k=1)

    reference = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    tokens = gpt2_encoding().encode(prompt)
    out = reference.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                             max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=50256)
    assert text == prompt + gpt2_encoding().decode(out[0, len(tokens):].tolist())


@pytest.mark.slow
def test_seed_reproduces_and_leaves_the_callers_rng_alone(hf_dir):
    model = sample.load_model(hf_dir)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sample.sample_texts(model, "Hello", num_samples=3, max_new_tokens=12, temperature=1.5, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert sample.sample_texts(model, "Hello", num_samples=3, max_new_tokens=12, temperature=1.5, seed=7) == first
    other = sample.sample_texts(model, "Hello", num_samples=3, max_new_tokens=12, temperature=1.5, seed=8)
    assert len(first) == 3 and all(text.startswith("Hello") for text in first)
    assert other != first and len(set(first)) > 1

    # an empty prompt starts a document with <|endoftext|>, which is not part of the returned text
    [unprompted] = sample.sample_texts(model, "", max_new_tokens=8)
    assert unprompted and not unprompted.startswith("<|endoftext|>")


@pytest.mark.slow
def test_cli(hf_dir, capsys, tmp_path):
    texts = sample.main(["--model", hf_dir, "--prompt", "ROMEO:", "--num-samples", "2", "--max-new-tokens", "10",
                         "--top-k", "5", "--temperature", "0.8", "--seed", "3", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(texts) == 2 and "--- sample 2/2 ---" in out and texts[1] in out
    assert texts == sample.sample_texts(sample.load_model(hf_dir), "ROMEO:", num_samples=2, max_new_tokens=10,
                                        top_k=5, temperature=0.8, seed=3)

    with pytest.raises(SystemExit, match=r"sample\.py: error: .*no_such_run: no such model directory"):
        sample.main(["--model", str(tmp_path / "no_such_run")])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(SystemExit, match=r"empty_dir.*config\.json"):
        sample.main(["--model", str(tmp_path / "empty_dir")])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"notes\.txt: no such model directory"):
        sample.main(["--model", str(tmp_path / "notes.txt")])
    for bad in ("-1", "nan", "inf", "-inf"):  # refused before the model is read, not a RuntimeError from sampling
        with pytest.raises(SystemExit):
            sample.main(["--model", hf_dir, f"--temperature={bad}"])
        err = capsys.readouterr().err
        assert err.endswith(f": error: --temperature must be >= 0 and finite, got {float(bad)}\n"), err
        assert "--temperature must be >= 0" in err


def test_small_vocabulary_is_refused():
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=16, vocab_size=512, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="50257"):
        sample.sample_texts(model, "Hi", max_new_tokens=2)


@pytest.mark.gpt2
@pytest.mark.slow
def test_training_run_out_dir_and_checkpoint(tmp_path):
    """A train_gpt2 out_dir (newest checkpoint) and one of its checkpoints sample what transformers samples from the
    run's final Hugging Face export."""
    import numpy as np
    from transformers import GPT2LMHeadModel
    import train_gpt2
    from indexed_dataset import IndexedDatasetBuilder
    from tokenizer import EOT_ID

    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        blocks = [b for b in f.read(20_000).split("\n\n") if b.strip()]
    prefix = str(tmp_path / "shakespeare")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for block in blocks:
        builder.add_document(np.array(gpt2_encoding().encode_ordinary(block) + [EOT_ID], dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    out_dir = tmp_path / "out"
    train_gpt2.main([os.path.join(ROOT, "configs", "demo_cpu.py"), f"--data_paths={prefix}", f"--out_dir={out_dir}",
                     "--seq_length=32", "--n_layer=1", "--n_head=2", "--n_embd=32", "--global_batch_size=4",
                     "--local_batch_size=4", "--max_steps=2", "--lr_warmup_steps=1", "--val_tokens=0",
                     "--sample_tokens=0",
                     "--dtype=float32"])

    prompt = "KING RICHARD:"
    tokens = gpt2_encoding().encode(prompt)
    reference = GPT2LMHeadModel.from_pretrained(str(out_dir / "hf")).eval()
    out = reference.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=50256)
    expected = [prompt + gpt2_encoding().decode(out[0, len(tokens):].tolist())]
    checkpoint = out_dir / "ckpt" / "step_00000002"
    for model, greedy in ((str(out_dir), ["--top-k", "1"]), (str(checkpoint), ["--temperature", "0"])):
        assert sample.main(["--model", model, "--prompt", prompt, "--num-samples", "1", "--max-new-tokens", "12",
                            "--device", "cpu", *greedy]) == expected
