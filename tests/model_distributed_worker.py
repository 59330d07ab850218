"""One rank of tests/test_model_distributed.py, launched by torchrun (gloo, CPU):

    model_distributed_worker.py ROOT init      init_sharded against manual_seed + init_weights

on two shapes: a GPT-2 vocabulary (50257 padded to 50304, 6 layers, n_embd 256, an odd context of 127), and a tiny
model whose FSDP2 shards on 2 ranks are uneven (9-wide vectors, 27-row c_attn), empty (wpe has 1 row) or all padding
(rank 1's wte rows 32:64 are past vocab 30). Rank 0 prints one line `RESULT <json>` per finding;
hf_files_distributed_worker.py builds its models with sharded_model from here."""
import datetime
import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig, init_sharded  # noqa: E402

SEED = 1234
CONFIGS = (GPTConfig(block_size=127, vocab_size=50257, padded_vocab_size=50304, n_layer=6, n_head=4, n_embd=256),
           GPTConfig(block_size=1, vocab_size=30, padded_vocab_size=64, n_layer=1, n_head=3, n_embd=9))


def report(**result):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def sharded_model(config):
    """As the trainer builds it: on the meta device, each block then the root sharded with FSDP2, materialised."""
    with torch.device("meta"):
        model = GPT(config)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model


def check_init():
    """init_sharded gives the numbers of torch.manual_seed then init_weights on a full model, on any number
    of ranks."""
    for config in CONFIGS:
        model = sharded_model(config)
        init_sharded(model, SEED)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            reference = GPT(config)
            torch.manual_seed(SEED)  # what the trainer did: the seed, then init_weights on the full model
            reference.init_weights()
            reference = reference.state_dict()
            report(check="init", vocab=config.vocab_size, ranks=dist.get_world_size(),
                   equal=state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    assert sys.argv[2] == "init", sys.argv
    check_init()
    # FSDP modules sit in reference cycles that keep the process group alive past destroy_process_group; gloo then
    # aborts a rank tearing it down at exit while its peer is leaving ("terminate called"): free them, leave together
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
