"""
Hugging Face GPT-2 files <-> our GPT (model.py), whole or one FSDP2 shard at a time.

    model = from_pretrained("gpt2")                  # a hub id, or a directory with config.json + weights
    save_pretrained(model, "out/hf")                 # what transformers' save_pretrained writes for GPT2LMHeadModel

The files differ from our parameters in three ways: keys may lack the "transformer." prefix (the hub's original
files), the four Conv1D weights are stored transposed, and wte has no padded rows. For a model sharded with FSDP2,
load_hf_sharded reads on each rank only the rows its shards hold (safetensors slices) and export_hf gathers one
tensor at a time to rank 0, so no rank ever holds the whole model.
"""
import dataclasses
import json
import os
import re
from functools import partial

import huggingface_hub
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from atomic_io import atomic_save, atomic_write
from distributed import broadcast_object
from model import GPT, GPTConfig, local_block

# Hugging Face stores these four as Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# activation_function values that mean the tanh approximation of GELU we implement
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# the GPTConfig fields a Hugging Face checkpoint fixes (padded_vocab_size is ours to choose)
ARCHITECTURE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "layer_norm_eps", "bias")


def from_pretrained(name_or_path, padded_vocab_size=None):
    """A GPT-2 in fp32 on the CPU from a hub id ("gpt2", "gpt2-xl", "openai-community/gpt2", any GPT-2 repo) or a
    local directory with config.json and model.safetensors (or its sharded index) or pytorch_model.bin."""
    directory, config = resolve_pretrained(name_or_path)
    with torch.device("meta"):  # no random init: every parameter is read from the file
        model = GPT(dataclasses.replace(config, padded_vocab_size=padded_vocab_size))
    model.to_empty(device="cpu")
    model.lm_head.weight = model.transformer.wte.weight  # to_empty() made two Parameters of the tied one
    load_hf_sharded(model, directory)
    return model


def save_pretrained(model, save_directory, state_dict=None, max_shard_size=5 * 10**9):
    """Write config.json and model.safetensors in the layout transformers writes for GPT2LMHeadModel: padded rows
    trimmed, Conv1D weights transposed back, lm_head left out (tied); above max_shard_size bytes, numbered files and
    model.safetensors.index.json, as transformers shards. `state_dict` (our key names, e.g. a full state dict
    gathered from FSDP) replaces model.state_dict(). A model without biases is written with zero biases, which
    compute the same function. Each file appears complete or not at all."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    _write_hf(save_directory, model.config, state_dict, max_shard_size, f"save_pretrained({save_directory})")


def resolve_pretrained(name_or_path):
    """(local directory, GPTConfig) of a Hugging Face GPT-2: a directory as is, a hub id downloaded (or found in the
    cache). Reads config.json only, so every rank can call it before building the model on the meta device."""
    directory = _model_directory(name_or_path)
    return directory, _read_config(os.path.join(directory, "config.json"))


@torch.no_grad()
def load_hf_sharded(model, name_or_path):
    """Fill `model`, a GPT whose config matches the checkpoint's (padding aside), from a Hugging Face GPT-2 directory
    or hub id, every key and shape checked first. A plain model is filled whole. For a model sharded with FSDP2
    (every rank calls this) each rank reads from the safetensors files only the rows its shards hold, so no rank
    ever holds the full model: returns "sharded". A pytorch_model.bin is a pickle, which cannot be read in slices:
    rank 0 reads it whole and sends one tensor at a time to every rank: returns "full"."""
    directory, config = resolve_pretrained(name_or_path)
    _check_fits(model.config, config, os.path.join(directory, "config.json"))
    params = dict(model.named_parameters())  # the tied lm_head.weight is listed once, as transformer.wte.weight
    sharded = any(isinstance(p, DTensor) for p in params.values())
    device = next(iter(params.values())).device
    where, paths = _weight_files(directory)
    pickled = paths[0].endswith(".bin")
    shapes, sources = _open_weights(paths, from_rank0=sharded and pickled)
    keys = _match_layout(where, config, shapes)

    def read(key, index):  # the block `index` (a tuple of slices) of file tensor `key`
        if not (sharded and pickled):
            return _read_slice(sources[key], key, index)
        full = (sources[key].float() if dist.get_rank() == 0 else torch.empty(shapes[key])).to(device)
        dist.broadcast(full, src=0)
        return full[index]

    for name, p in params.items():
        local, index = local_block(p)
        name = "transformer.wte.weight" if name == "lm_head.weight" else name  # an untied copy of the same weight
        _fill_param(local, read, keys[name], name, index, config.vocab_size)
    if "lm_head.weight" in keys:  # tied in the file as well? each rank compares its rows, then all ranks agree
        rows, columns = local_block(model.transformer.wte.weight)[1]
        rows = (_real_rows(rows, config.vocab_size), columns)
        same = torch.equal(read("lm_head.weight", rows), read(keys["transformer.wte.weight"], rows))
        differs = torch.tensor([0 if same else 1], device=device)
        if sharded:
            dist.all_reduce(differs)
        if differs.item():
            untied = "lm_head.weight differs from wte.weight (untied output embeddings are not supported)"
            raise ValueError(_mismatch(where, config, [untied]))
    return "full" if pickled else "sharded"


def export_hf(model, directory, max_shard_size=5 * 10**9):
    """Collective (every rank calls it): write `model`, plain or sharded with FSDP2, as save_pretrained does, from
    rank 0. Each parameter is gathered alone and moved to the CPU at once, so no GPU ever holds the full model, and
    rank 0 holds at most one file's tensors (max_shard_size bytes). Each file appears complete or not at all; writing
    into a fresh directory and renaming it once every rank has returned is the caller's job."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    _write_hf(directory, model.config, dict(model.named_parameters()), max_shard_size, f"export_hf({directory})",
              writer)


@torch.no_grad()
def _write_hf(directory, cfg, state_dict, max_shard_size, who, writer=True):
    """Check `state_dict` (our names and layout) against `cfg`, then write the Hugging Face directory. DTensors are
    gathered one at a time, a collective every rank joins; only the `writer` writes."""
    expected = _hf_shapes(cfg)
    problems = []
    for name, tensor in state_dict.items():
        if name == "lm_head.weight":
            continue
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
        elif _file_shape(name, tensor.shape, cfg.vocab_size) != expected[name]:
            problems.append(f"{name} has shape {_file_shape(name, tensor.shape, cfg.vocab_size)} in the file layout, "
                            f"expected {expected[name]}")
    zero_biases = [] if cfg.bias else [name for name in expected if name.endswith(".bias")]
    problems += [f"missing tensor {name}" for name in expected if name not in state_dict and name not in zero_biases]
    if problems:
        raise ValueError(f"{who}: the state dict does not fit this model's config: {_first_five(problems)}")
    dtype = state_dict["transformer.wte.weight"].dtype

    def file_tensor(name):
        if name in zero_biases:  # a model without biases computes what one with zero biases does
            return torch.zeros(expected[name], dtype=dtype)
        tensor = state_dict[name]
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if name == "transformer.wte.weight":
            tensor = tensor[:cfg.vocab_size]
        return (tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor).cpu().contiguous() if writer else None

    # transformers' own sharding: tensors in state-dict order, a new file when the next would pass max_shard_size
    split = huggingface_hub.split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=state_dict[name].dtype if name in state_dict else dtype, device="meta")
         for name, shape in expected.items()}, max_shard_size=max_shard_size)
    if writer:
        os.makedirs(directory, exist_ok=True)
    for filename, names in split.filename_to_tensors.items():
        tensors = {name: file_tensor(name) for name in names}  # gathered by every rank, kept by the writer
        if writer:
            atomic_save(os.path.join(directory, filename), partial(save_file, tensors, metadata={"format": "pt"}))
    if not writer:
        return
    written = set(split.filename_to_tensors)
    if split.is_sharded:
        written.add("model.safetensors.index.json")
        _write_json(os.path.join(directory, "model.safetensors.index.json"),
                    {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
    _write_json(os.path.join(directory, "config.json"), _hf_config(cfg, dtype))
    for stale in set(os.listdir(directory)) - written:  # weights of an earlier save that readers would mix in
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(directory, stale))


def _hf_config(cfg, dtype):
    """transformers' config.json for GPT2LMHeadModel with our architecture."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": 0.0,  # we train without dropout
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # GPT-2's <|endoftext|>; transformers would default to it even where the vocabulary has no such id
        "bos_token_id": 50256 if cfg.vocab_size > 50256 else None,
        "eos_token_id": 50256 if cfg.vocab_size > 50256 else None,
    }


def _write_json(path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _hf_shapes(config):
    """Tensor name -> shape in the Hugging Face file (Conv1D layout) for a GPT-2 with biases and no padding."""
    with torch.device("meta"):
        model = GPT(dataclasses.replace(config, padded_vocab_size=None, bias=True))
    return {name: _file_shape(name, p.shape, config.vocab_size)
            for name, p in model.state_dict().items() if name != "lm_head.weight"}


def _file_shape(name, shape, vocab_size):
    """The shape our parameter `name` has in the file: wte without padded rows, Conv1D weights transposed."""
    if name == "transformer.wte.weight":
        shape = (min(shape[0], vocab_size), *shape[1:])
    return tuple(reversed(shape) if name.endswith(CONV1D_WEIGHTS) else shape)


def _model_directory(name_or_path):
    """A local directory as is; anything else is a hub repo id, fetched (or found in the cache) by huggingface_hub."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path}: a file; expected a model directory or a Hugging Face hub id")
    try:
        directory = huggingface_hub.snapshot_download(
            name_or_path, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"])
        if not any(f.endswith(".safetensors") for f in os.listdir(directory)):  # older repos: only the pickle
            directory = huggingface_hub.snapshot_download(name_or_path, allow_patterns=["pytorch_model.bin"])
    except (OSError, ValueError) as e:  # not found, offline without a cached copy, invalid repo id
        raise FileNotFoundError(f"{name_or_path}: no such local directory, and not available from the Hugging Face "
                                f"hub ({type(e).__name__}: {e})") from e
    return directory


def _read_config(path):
    """GPTConfig from a Hugging Face GPT-2 config.json, refusing anything that would compute a different function."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; a GPT-2 model directory needs config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: not a config (a JSON {type(hf).__name__}, expected an object)")
    if hf.get("model_type") != "gpt2" and "GPT2LMHeadModel" not in (hf.get("architectures") or []):
        raise ValueError(f"{path}: not a GPT-2 config (model_type {hf.get('model_type')!r}); only the GPT-2 "
                         f"architecture is supported")
    n_embd = hf.get("n_embd", 768)
    problems = []
    if hf.get("activation_function", "gelu_new") not in TANH_GELUS:
        problems.append(f"activation_function {hf['activation_function']!r} (supported: {', '.join(TANH_GELUS)})")
    if hf.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner {hf['n_inner']} (supported: null or 4 * n_embd = {4 * n_embd})")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("a non-standard attention scaling (scale_attn_weights / scale_attn_by_inverse_layer_idx)")
    if hf.get("add_cross_attention", False):
        problems.append("cross-attention")
    if problems:
        raise ValueError(f"{path}: unsupported GPT-2 variant: {'; '.join(problems)}")
    try:
        return GPTConfig(block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
                         vocab_size=hf.get("vocab_size", 50257), n_layer=hf.get("n_layer", 12),
                         n_head=hf.get("n_head", 12), n_embd=n_embd, layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _check_fits(model_config, config, path):
    """The model to fill has the architecture of config.json at `path` (its padded vocabulary rows aside)."""
    differ = [f"{k} {getattr(model_config, k)} (file: {getattr(config, k)})" for k in ARCHITECTURE
              if getattr(model_config, k) != getattr(config, k)]
    if differ:
        raise ValueError(f"{path}: the model to load into differs: {', '.join(differ)}")


def _weight_files(directory):
    """(file name(s) for messages, paths): model.safetensors, the files of its sharded index, or pytorch_model.bin."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    pickled = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(single):
        return single, [single]
    if os.path.isfile(pickled) and not os.path.isfile(index):
        return pickled, [pickled]
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{directory}: no weights (model.safetensors, model.safetensors.index.json or "
                                f"pytorch_model.bin)")
    try:
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (expected JSON with a weight_map; {e!r})") from e
    return f"{index} ({len(files)} shards)", [os.path.join(directory, name) for name in files]


def _open_weights(paths, from_rank0=False):
    """({key: shape}, {key: source}) of the weight files: a source is the safetensors file, read lazily in slices, or
    the tensor of an unpickled pytorch_model.bin. from_rank0: only rank 0 unpickles; the others get its shapes (or
    its error, so that every rank fails alike)."""
    if from_rank0:
        shapes, sources, error = {}, {}, None
        if dist.get_rank() == 0:
            try:
                shapes, sources = _open_weights(paths)
            except ValueError as e:
                error = str(e)
        shapes, error = broadcast_object((shapes, error))
        if error:
            raise ValueError(error)
        return shapes, sources
    shapes, sources = {}, {}
    for path in paths:
        try:
            if path.endswith(".bin"):
                sources.update(torch.load(path, map_location="cpu", weights_only=True))
                shapes.update((key, tuple(t.shape)) for key, t in sources.items())
            else:
                with safe_open(path, "pt") as f:  # the header only
                    for key in f.keys():
                        shapes[key], sources[key] = tuple(f.get_slice(key).get_shape()), path
        except Exception as e:  # whatever the parser says, the file is the problem: name it
            raise ValueError(f"{path}: not a readable weights file ({type(e).__name__}: {e})") from e
    return shapes, sources


def _match_layout(where, config, shapes):
    """{our name: file key} for the file's {key: shape}, or one error listing every key and shape that does not fit.
    Both layouts of real files pass: with or without the "transformer." prefix, with or without the attn.bias /
    attn.masked_bias causal-mask buffers, lm_head.weight present or not."""
    expected = _hf_shapes(config)
    keys, problems = {}, []
    for key, shape in shapes.items():
        name = key if key.startswith("transformer.") or key == "lm_head.weight" else "transformer." + key
        if name.endswith((".attn.bias", ".attn.masked_bias")) and name not in expected:
            continue  # causal-mask buffers of older transformers versions, not weights
        keys[name] = key
        want = expected["transformer.wte.weight"] if name == "lm_head.weight" else expected.get(name)
        if want is None:
            problems.append(f"unexpected tensor {key}")
        elif shape != want:
            problems.append(f"{key} has shape {shape}, expected {want}")
    problems += [f"missing tensor {name}" for name in expected if name not in keys]
    if problems:
        raise ValueError(_mismatch(where, config, problems))
    return keys


def _mismatch(where, config, problems):
    return (f"{where}: does not match its config.json ({config.n_layer} layers, n_embd {config.n_embd}, vocab "
            f"{config.vocab_size}, context {config.block_size}): {_first_five(problems)}")


def _fill_param(local, read, key, name, index, vocab_size):
    """Fill `local`, block `index` of our parameter `name`, from file tensor `key`: our rows of a Conv1D weight are
    the file's columns, and wte's rows past vocab_size are padding: zeros."""
    if name.endswith(CONV1D_WEIGHTS):
        local.copy_(read(key, index[::-1]).t())
    elif name == "transformer.wte.weight":
        real = read(key, (_real_rows(index[0], vocab_size), *index[1:]))
        local[:real.size(0)].copy_(real)
        local[real.size(0):].zero_()
    else:
        local.copy_(read(key, index))


def _real_rows(rows, vocab_size):
    return slice(min(rows.start, vocab_size), min(rows.stop, vocab_size))


def _read_slice(source, key, index):
    """tensor[index] of a loaded tensor, or of tensor `key` of safetensors file `source`, reading only that block.
    The file is opened per tensor so that its mapped pages go when the block is read."""
    if isinstance(source, torch.Tensor):
        return source[index]
    with safe_open(source, "pt") as f:
        return f.get_slice(key)[index]


def load_pretrained_state_dict(name_or_path):
    """(GPTConfig, state dict with our key names, fp32, unpadded) of a hub id or local Hugging Face GPT-2 directory,
    every key and shape checked."""
    model = from_pretrained(name_or_path)
    state_dict = model.state_dict()
    del state_dict["lm_head.weight"]
    return model.config, state_dict


def _first_five(problems):
    return "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
