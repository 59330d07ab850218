"""Sample text from a GPT-2: OpenAI's checkpoint, any HF GPT-2 directory, or a run of train_gpt2.py.

    python sample.py --model gpt2 --prompt "Hello, I'm a language model," --temperature 0.8"""
import argparse
import sys

import torch

from checkpoint import load_model
from tokenizer import EOT_ID, VOCAB_SIZE, gpt2_encoding


@torch.no_grad()
def sample_texts(model, prompt, *, num_samples=1, max_new_tokens=100, temperature=1.0, top_k=None,
                 seed=1337, device="cpu"):
    """Continuations of `prompt`, prompt in front, reproducible by `seed`."""
    if model.config.vocab_size != VOCAB_SIZE:
        raise ValueError(f"a vocabulary of {model.config.vocab_size}, not GPT-2's {VOCAB_SIZE}")
    enc = gpt2_encoding()
    start = enc.encode_ordinary(prompt) or [EOT_ID]  # an empty prompt starts a new document
    idx = torch.tensor([start] * num_samples, dtype=torch.long, device=device)
    cuda_devices = []
    if idx.device.type == "cuda":
        cuda_devices.append(idx.device)
    with torch.random.fork_rng(devices=cuda_devices):  # a training run's random stream is kept
        torch.manual_seed(seed)
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
    return [prompt + enc.decode(row[len(start):].tolist()) for row in out]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="gpt2, an HF directory, a run or checkpoint")
    parser.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    parser.add_argument("--num-samples", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=200, help="0: no top-k")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.top_k < 0:
        parser.error("--num-samples and --max-new-tokens must be at least 1, --top-k at least 0")
    if not 0 <= args.temperature < float("inf"):  # nan fails both comparisons
        parser.error(f"--temperature must be >= 0 and finite, got {args.temperature}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():  # before the slow load
        parser.error(f"--device {args.device}: torch sees no CUDA GPU here; use --device cpu")
    try:
        model = load_model(args.model).to(args.device)
        texts = sample_texts(model, args.prompt, num_samples=args.num_samples,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k or None, seed=args.seed, device=args.device)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: torch on an unknown --device
        sys.exit(f"sample.py: error: {e}")
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1}/{len(texts)} ---\n{text}")
    return texts


if __name__ == "__main__":
    main()
