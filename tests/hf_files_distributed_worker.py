"""One rank of tests/test_hf_files_distributed.py and bench/bench_sharded_load.py, launched by torchrun (gloo, CPU):

    hf_files_distributed_worker.py ROOT memory sharded|rank0 HF_DIR  peak memory of one way of filling an FSDP2 model
    hf_files_distributed_worker.py ROOT checks HF_DIR EDGE OUT       loading, export and errors against the oracles

EDGE holds a tiny model whose shards are uneven, empty or all padding (safetensors/), untied/ (lm_head differs from
wte) and broken/ (an unreadable model.safetensors). Rank 0 prints one line `RESULT <json>` per finding. The test
imports config_of from here for its check on one in-process rank."""
import dataclasses
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
from hf_files import export_hf, from_pretrained, load_hf_sharded, resolve_pretrained  # noqa: E402
from model import GPT  # noqa: E402
from model_distributed_worker import sharded_model  # noqa: E402 (beside this file)


def report(**result):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def gather(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def config_of(directory):
    """The checkpoint's config with the padded vocabulary the trainer uses (50304), or 64 for the edge model."""
    config = resolve_pretrained(directory)[1]
    return dataclasses.replace(config, padded_vocab_size=50304 if config.vocab_size > 64 else 64)


def full_state(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def same_shards(a, b):
    return all(gather(all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters()))))


def memory_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def measure(mode, hf_dir):
    """Peak resident memory of filling an FSDP2 model, above what the process held when loading began: the sliced
    reads of load_hf_sharded, or the full state dict on rank 0 broadcast to all (the trainer's path before)."""
    model = sharded_model(config_of(hf_dir))
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the peak (VmHWM) from the resident size now
    baseline = memory_mb("VmRSS")
    start = time.perf_counter()
    if mode == "sharded":
        load_hf_sharded(model, hf_dir)
    else:
        source = from_pretrained(hf_dir, padded_vocab_size=model.config.padded_vocab_size) \
            if dist.get_rank() == 0 else None
        set_model_state_dict(model, source.state_dict() if source is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    seconds = time.perf_counter() - start
    report(mode=mode, peak_mb=gather(memory_mb("VmHWM") - baseline), baseline_mb=gather(baseline),
           seconds=max(gather(seconds)))


def check_load(hf_dir, edge, out):
    """The sharded load, gathered by torch, against GPT.from_pretrained; our logits for the test to hold against
    transformers'; export to one file and to shards, read back into shards."""
    for directory in (hf_dir, os.path.join(edge, "safetensors")):
        config = config_of(directory)
        model = sharded_model(config)
        load_hf_sharded(model, directory)
        state = full_state(model)
        if dist.get_rank() == 0:
            reference = from_pretrained(directory, padded_vocab_size=config.padded_vocab_size).state_dict()
            report(check="load", vocab=config.vocab_size, equal=state.keys() == reference.keys() and
                   all(torch.equal(state[k], reference[k]) for k in state))

    model = sharded_model(config_of(hf_dir))
    load_hf_sharded(model, hf_dir)
    state = full_state(model)
    if dist.get_rank() == 0:
        plain = GPT(model.config)
        plain.load_state_dict(state)
        tokens = torch.arange(200).view(2, 100) * 241 % model.config.vocab_size
        with torch.no_grad():
            torch.save({"tokens": tokens, "logits": plain.eval()(tokens)[0]}, os.path.join(out, "logits.pt"))
    export_hf(model, os.path.join(out, "single"))
    export_hf(model, os.path.join(out, "shards"), max_shard_size=8 * 2**20)
    dist.barrier()
    again = sharded_model(model.config)
    load_hf_sharded(again, os.path.join(out, "shards"))
    report(check="export-read-back", equal=same_shards(again, model))


def check_errors(edge):
    """A bad file fails on every rank with the same message: no rank is left waiting for another."""
    for case in ("untied", "broken"):
        try:
            load_hf_sharded(sharded_model(config_of(os.path.join(edge, "safetensors"))), os.path.join(edge, case))
            message = None
        except ValueError as e:
            message = str(e)
        report(check="error", case=case, messages=gather(message))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    command, args = sys.argv[2], sys.argv[3:]
    if command == "memory":
        measure(*args)
    else:
        hf_dir, edge, out = args
        check_load(hf_dir, edge, out)
        check_errors(edge)
    # FSDP modules sit in reference cycles that keep the process group alive past destroy_process_group; gloo then
    # aborts a rank tearing it down at exit while its peer is leaving ("terminate called"): free them, leave together
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
