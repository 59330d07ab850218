"""Per-rank peak memory of filling an FSDP2-sharded GPT-2 from a Hugging Face checkpoint on 2 gloo ranks:
load_hf_sharded (each rank reads only its rows of each tensor) against the trainer's earlier path (rank 0 loads
the full model, set_model_state_dict broadcasts it), each in a fresh torchrun launch, the two taking turns.

    python bench/bench_sharded_load.py                          # ~200 MB fp32 checkpoint, about a minute on CPU
    python bench/bench_sharded_load.py --n-layer 12 --n-embd 768 --repeats 3   # GPT-2 124M, ~500 MB

Peak = VmHWM minus VmRSS when loading began (the materialised shards already counted out), per rank; the ratio
compares the largest rank of each way (rank 0 in the earlier path)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "hf_files_distributed_worker.py")


def launch(mode, hf_dir, nproc):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), WORKER, ROOT, "memory", mode, hf_dir], capture_output=True, text=True,
                            timeout=1200)
    if result.returncode:
        sys.exit(f"the {mode} launch failed:\n{result.stdout[-3000:]}{result.stderr[-5000:]}")
    return next(json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT "))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        hf = GPT2LMHeadModel(GPT2Config(n_layer=args.n_layer, n_head=args.n_embd // 64, n_embd=args.n_embd,
                                        vocab_size=50257, n_positions=1024))
        hf.save_pretrained(tmp)
        size_mb = os.path.getsize(os.path.join(tmp, "model.safetensors")) / 2**20
        del hf
        runs = {"sharded": [], "rank0": []}
        for _ in range(args.repeats):  # alternate, so load from others on a shared machine hits both alike
            for mode in runs:
                runs[mode].append(launch(mode, tmp, args.nproc))
    print(f"checkpoint: {size_mb:.0f} MB model.safetensors, {args.n_layer} layers, n_embd {args.n_embd}, "
          f"{args.nproc} ranks (gloo, CPU), torch {torch.__version__}, {args.repeats} launches each")
    peaks = {}
    for mode, name in (("rank0", "rank 0 loads, broadcast"), ("sharded", "load_hf_sharded")):
        per_rank = [min(run["peak_mb"][r] for run in runs[mode]) for r in range(args.nproc)]
        seconds = statistics.median(run["seconds"] for run in runs[mode])
        peaks[mode] = max(per_rank)
        print(f"{name:>24}: peak MB per rank {', '.join(f'{p:.0f}' for p in per_rank)}; "
              f"load {seconds:.2f} s (median)")
    print(f"ratio of the largest per-rank peaks, load_hf_sharded / rank 0 path: "
          f"{peaks['sharded'] / peaks['rank0']:.2f}")


if __name__ == "__main__":
    main()
