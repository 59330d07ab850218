"""Hugging Face GPT-2 files in and out: from_pretrained reads a hub id or a directory (per FSDP2 shard
with load_hf_sharded), export_hf writes one as save_pretrained does, swapped in whole."""
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import tempfile
import threading

import huggingface_hub
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from model import GPT, GPTConfig, local_block, materialize, parameters_on_meta


# Hugging Face stores these four as Conv1D, whose weight is (in, out): the transpose of nn.Linear's.
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")

# config.json's keys and the GPTConfig fields they set; n_positions comes after n_ctx, so it wins
HF_CONFIG_KEYS = dict(n_ctx="block_size", n_positions="block_size", vocab_size="vocab_size",
                      n_layer="n_layer", n_head="n_head", n_embd="n_embd",
                      layer_norm_epsilon="layer_norm_eps", activation_function="activation")


def from_pretrained(name_or_path, padded_vocab_size=None):
    """A GPT-2 in fp32 on the CPU from a hub id ("gpt2") or a Hugging Face directory."""
    directory, config = resolve_pretrained(name_or_path)
    with parameters_on_meta():  # no random init: every parameter is read from the file
        model = GPT(dataclasses.replace(config, padded_vocab_size=padded_vocab_size))
    materialize(model, "cpu")
    load_hf_sharded(model, directory)
    return model


def resolve_pretrained(name_or_path):
    """(local directory, GPTConfig) of a Hugging Face directory or hub id; reads no weights."""
    directory = name_or_path
    if not os.path.isdir(directory):
        if os.path.exists(directory) or directory.startswith((".", "/", "~")):
            raise FileNotFoundError(f"{directory}: no such model directory")
        try:  # the config and the safetensors only: never a pickle, nor another framework's weights
            patterns = ["config.json", "*.safetensors", "*.safetensors.index.json"]
            directory = huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns)
        except (OSError, ValueError) as e:  # not found, offline and not cached, an invalid id
            raise FileNotFoundError(f"{name_or_path}: no such local directory, and not available "
                                    f"online ({e!r})") from e
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; a GPT-2 model directory needs config.json (a "
                                f"train_gpt2.py run is read from its out_dir or from one "
                                f"checkpoint, out_dir/ckpt/step_N)")
    try:
        return directory, config_from_hf(json.loads(pathlib.Path(path).read_text()))
    except ValueError as e:  # not JSON, or a config we do not compute: one line naming the file
        raise ValueError(f"{path}: {e}") from e


def config_from_hf(hf):
    """The GPTConfig of a config.json's contents; ValueError for a variant we do not compute."""
    if not isinstance(hf, dict):
        raise ValueError(f"not a config (a JSON {type(hf).__name__}, expected an object)")
    if hf.get("model_type") != "gpt2" and "GPT2LMHeadModel" not in (hf.get("architectures") or []):
        raise ValueError(f"not a GPT-2 config (model_type {hf.get('model_type')!r}); "
                         f"only GPT-2 is supported")
    # the values of these keys that the model implements, the default first
    supported = dict(scale_attn_weights=(True,), scale_attn_by_inverse_layer_idx=(False,),
                     n_inner=(None, 4 * hf.get("n_embd", 768)))
    for key, ok in supported.items():
        if hf.get(key, ok[0]) not in ok:
            raise ValueError(f"unsupported GPT-2 variant: {key} {hf[key]!r}, "
                             f"not {' or '.join(map(repr, ok))}")
    return GPTConfig(**{field: hf[key] for key, field in HF_CONFIG_KEYS.items() if key in hf})


def tensor_sources(directory, config):
    """Our parameter name -> (the file's key, the file) of a Hugging Face directory's safetensors,
    sharded or not, checked against `config`'s shapes."""
    where = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(where):
        where += ".index.json"  # a sharded model: the index names its files
    if not os.path.isfile(where):
        raise FileNotFoundError(f"{directory}: no weights (model.safetensors or model.safetensors"
                                ".index.json; convert a pytorch_model.bin to safetensors first)")
    shapes, sources, path = {}, {}, where
    try:  # whatever the parser says, the file is the problem: name it
        paths = [where]
        if where.endswith(".json"):
            weight_map = json.loads(pathlib.Path(where).read_text())["weight_map"]
            paths = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        for path in paths:
            with safe_open(path, "pt") as f:  # reads the header only
                for key in f.keys():
                    shapes[key], sources[key] = tuple(f.get_slice(key).get_shape()), path
    except Exception as e:
        raise ValueError(f"{path}: not a readable weights file ({type(e).__name__}: {e})") from e
    # Hub files name keys with or without "transformer.", hold lm_head.weight or not, and older
    # ones hold the attention's causal-mask buffers, which are not weights.
    ours = {}
    for key in shapes:
        if not key.endswith((".attn.bias", ".attn.masked_bias")):
            ours[key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key] = key
    expected = gpt2_shapes(config)
    problems = [f"missing tensor {name}" for name in expected if name not in ours]
    expected["lm_head.weight"] = expected["transformer.wte.weight"]  # the tied weight, if stored
    for name, key in ours.items():
        if name not in expected:
            problems.append(f"unexpected tensor {key}")
        elif shapes[key] != expected[name]:
            problems.append(f"{key} has shape {shapes[key]}, expected {expected[name]}")
    if problems:  # the first five: a file of another size has a problem in every tensor
        raise ValueError(f"{where}: does not match its config.json ({'; '.join(problems[:5])})")
    return {name: (key, sources[key]) for name, key in ours.items()}


@torch.no_grad()
def load_hf_sharded(model, name_or_path):
    """Fill `model`, plain or FSDP2 (every rank calls), each rank reading only its own rows."""
    directory, config = resolve_pretrained(name_or_path)
    theirs = dataclasses.asdict(config)  # padded_vocab_size is ours to choose
    differ = [f"{field} {ours} (file: {theirs[field]})" for field, ours in
              dataclasses.asdict(model.config).items()
              if field != "padded_vocab_size" and ours != theirs[field]]
    if differ:
        raise ValueError(f"{directory}/config.json: the model to load into differs: "
                         f"{', '.join(differ)}")
    sources = tensor_sources(directory, config)

    def read(name, index):  # the block `index` (slices) of the file's tensor for our `name`
        key, path = sources[name]
        with safe_open(path, "pt") as f:  # opened per tensor: its mapped pages go once read
            return f.get_slice(key)[index]

    params = dict(model.named_parameters())  # a tied head once, as transformer.wte.weight
    tied = is_tied(model)
    untied = torch.zeros(1, device=next(iter(params.values())).device)  # the file's head differs
    for name, p in params.items():
        local, index = local_block(p)
        if name.endswith(CONV1D_WEIGHTS):  # our rows of a Conv1D weight are the file's columns
            local.copy_(read(name, index[::-1]).t())
        elif name in ("transformer.wte.weight", "lm_head.weight"):
            stop = min(index[0].stop, config.vocab_size)
            in_file = (slice(min(index[0].start, stop), stop), *index[1:])
            # A head of its own reads the file's head, or its wte where the file is tied.
            key = name if name in sources else "transformer.wte.weight"
            rows = read(key, in_file)
            if tied and "lm_head.weight" in sources:
                untied += not torch.equal(rows, read("lm_head.weight", in_file))
            local[:rows.size(0)].copy_(rows)
            local[rows.size(0):].zero_()  # the padded rows, past vocab_size
        else:
            local.copy_(read(name, index))
    if any(isinstance(p, DTensor) for p in params.values()):  # so that every rank fails alike
        dist.all_reduce(untied)
    if untied.item():
        raise ValueError(f"{sources['lm_head.weight'][1]}: lm_head.weight differs from wte.weight, "
                         f"and model.py ties its head to wte (delete the tie in GPT.__init__ to "
                         f"load a head of its own)")


def gpt2_shapes(config, tied=True):
    """Tensor name -> shape in a Hugging Face GPT-2 file of `config`'s sizes (Conv1D layout, real
    vocabulary rows), with lm_head.weight where the head is not tied. Written out from GPT-2's
    architecture, not read off model.py's classes, so that an edited model is held to what
    transformers' GPT-2 computes."""
    C = config.n_embd
    shapes = {"transformer.wte.weight": (config.vocab_size, C),
              "transformer.wpe.weight": (config.block_size, C)}
    block = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C),
             "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
             "ln_2.weight": (C,), "ln_2.bias": (C,), "mlp.c_fc.weight": (C, 4 * C),
             "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}
    for i in range(config.n_layer):
        shapes.update({f"transformer.h.{i}.{name}": shape for name, shape in block.items()})
    shapes["transformer.ln_f.weight"] = shapes["transformer.ln_f.bias"] = (C,)
    if not tied:
        shapes["lm_head.weight"] = (config.vocab_size, C)
    return shapes


def is_tied(model):
    """Whether the model's head is its token embedding (GPT-2's tie), as model.py decides."""
    model = getattr(model, "_orig_mod", model)  # the module inside torch.compile(model)
    return model.lm_head.weight is model.transformer.wte.weight


def export_problems(model):
    """Why `model` cannot be written as GPT-2, one phrase per tensor: one that GPT-2 lacks or has
    in another shape, or one of GPT-2's that the model lacks (a missing bias is a zero bias)."""
    model = getattr(model, "_orig_mod", model)  # the module inside torch.compile(model)
    expected, ours = gpt2_shapes(model.config, is_tied(model)), {}
    for name, tensor in model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # a causal mask is GPT-2's own
        if name == "lm_head.weight" and is_tied(model):
            continue  # the same tensor as wte
        shape = tuple(tensor.shape)
        if name in ("transformer.wte.weight", "lm_head.weight"):
            shape = (model.config.vocab_size, *shape[1:])  # the padded rows are not written
        if name.endswith(CONV1D_WEIGHTS):
            shape = shape[::-1]
        ours[name] = shape
    problems = [f"{name}, which GPT-2 has no place for" for name in ours if name not in expected]
    for name, shape in expected.items():
        if name in ours and ours[name] != shape:
            problems.append(f"{name} of shape {list(ours[name])}, GPT-2's is {list(shape)}")
        elif name not in ours and not name.endswith(".bias"):
            problems.append(f"no {name}, which GPT-2 computes with")
    return problems


# ------------------------------------------------------------------- the check of the model's function

EXPORT_TOLERANCE = 1e-4  # fp32 logits: an unedited model differs by about 1e-6


def check_model(config):
    """The model that the check of what model.py computes runs: `config`'s architecture as it is
    (every layer, the whole vocabulary), built from model.py's classes as they are now, on the CPU
    in fp32. Its weights are drawn from a seed: each matrix with a spread of 1/sqrt(fan_in), so
    that every layer moves the logits (GPT-2's init of 0.02 leaves attention almost uniform, and an
    edit of it almost unseen); GPT-2's gains and biases, and an edit's own parameters, moved from
    their starting values, so that none sits where an edit's effect would vanish (a zero gate)."""
    with torch.random.fork_rng(devices=[]):  # the run's own random numbers stay untouched
        torch.manual_seed(0)
        with parameters_on_meta():
            model = GPT(config)
        materialize(model, "cpu")
        with torch.no_grad():
            drawn = set()
            for _, param, fill in model.init_plan():
                if param.dim() >= 2:
                    param.normal_(std=param.size(-1) ** -0.5)
                    drawn.add(param)
                else:
                    fill(param)
            for param in model.parameters():
                if param not in drawn:
                    std = 0.1 if param.dim() < 2 else param.size(-1) ** -0.5
                    param.add_(torch.randn_like(param) * std)
    return model.eval()


def check_ids(config):
    """One sequence of seeded random token ids over the model's whole context."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(config.vocab_size, (1, config.block_size), generator=generator)


@torch.no_grad()
def fingerprint(logits):
    """Two numbers per position of `logits` (1, T, vocab): the log-sum-exp, and the logits'
    projection on a fixed random direction. Every logit at every position moves them, so a resume
    compares what the model computes, not a corner of it, in a few kilobytes of JSON."""
    direction = torch.randn(logits.size(-1), generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    summary = torch.stack([logits.logsumexp(-1), logits @ direction], dim=-1)
    return [round(value, 6) for value in summary.flatten().tolist()]


def fingerprint_difference(saved, now):
    """The largest difference between two fingerprints; inf where their lengths differ."""
    if len(saved) != len(now):
        return math.inf
    return max((abs(a - b) for a, b in zip(saved, now)), default=0.0)


FINGERPRINT_TOLERANCE = 1e-3  # far above fp32 rounding between machines, far below an edit (tenths)


def import_transformers():
    """transformers and the modules that reading a GPT-2 export with it imports."""
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel  # noqa: F401


def transformers_logits(directory, ids):
    """The fp32 logits that transformers' reading of the export in `directory` computes on `ids`."""
    import transformers  # not a requirement of the project: the caller checks that it is there
    transformers.logging.set_verbosity_error()  # its "newly initialized" warnings: we measure
    transformers.logging.disable_progress_bar()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return theirs(ids).logits


def check_function(config, export=True):
    """What train_gpt2.py checks before step 1: (whether hf/ will be written, the line that says
    so, the fingerprint that every checkpoint records). check_model(config) runs over its whole
    context; with `export`, its export is read back by transformers, where that is installed, and
    the logits of every position compared."""
    # torchrun gives each process one thread (OMP_NUM_THREADS=1); the other ranks wait for this
    # check, so it takes every core this process may run on.
    with every_core():
        model, ids = check_model(config), check_ids(config)
        problems = export_problems(model)
        importing = None
        if export and not problems and importlib.util.find_spec("transformers") is not None:
            # transformers' import takes seconds of Python: it overlaps the forward. It is always
            # waited for: a process that exits while a thread imports may abort.
            importing = threading.Thread(target=import_transformers, name="import transformers",
                                         daemon=True)
            importing.start()
        try:
            return compare_with_transformers(model, ids, export, problems, importing)
        finally:
            if importing is not None:
                importing.join()


def compare_with_transformers(model, ids, export, problems, importing):
    """check_function's answer for the check model on `ids`, once transformers is being imported
    (`importing`, a thread) where it will be needed."""
    with torch.no_grad():
        logits = model(ids)[0].float()
    found = fingerprint(logits)
    if not export:
        return False, "hf/ will not be written (hf_export='off')", found
    if problems:
        return False, (f"hf/ will not be written: the model is not GPT-2's architecture "
                       f"({'; '.join(problems[:3])})"), found
    if importing is None:
        return True, ("hf/: the tensors are GPT-2's by name and shape; whether transformers "
                      "computes what the model does was not checked (transformers is not "
                      "installed)"), found
    # In memory where /dev/shm has room: the export is read back at once and deleted.
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if shm and shutil.disk_usage(shm).free < 3 * size:
        shm = None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        export_hf(model, os.path.join(tmp, "hf"), durable=False)
        importing.join()  # its lazy modules are not to be raced
        theirs = transformers_logits(os.path.join(tmp, "hf"), ids)
    difference = (logits - theirs).abs().max().item()
    where = f"on {ids.size(1)} positions of seeded weights"
    if difference > EXPORT_TOLERANCE:
        return False, (f"hf/ will not be written: transformers' GPT-2 computes other logits from "
                       f"the same weights (largest difference {difference:.3g} {where}; "
                       f"model.py computes something GPT-2 does not)"), found
    return True, (f"hf/: transformers' GPT-2 computes the model's logits (largest difference "
                  f"{difference:.1e} {where})"), found


@contextlib.contextmanager
def every_core():
    """torch's threads raised to the cores this process may run on, and put back after."""
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(threads, cores))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hf_config(cfg, dtype, tied=True):
    """transformers' config.json for a GPT2LMHeadModel of our config's shapes and activation."""
    # GPT-2's <|endoftext|> said outright: transformers assumes it even where no such id exists
    endoftext = 50256 if cfg.vocab_size > 50256 else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "tie_word_embeddings": tied,
            "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": cfg.activation, "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": endoftext,
            "eos_token_id": endoftext, "torch_dtype": str(dtype).removeprefix("torch.")}


@torch.no_grad()
def export_hf(model, directory, max_shard_size=5 * 10**9, extra_files=None, check=None,
              durable=True):
    """Write `model` (plain, compiled or FSDP2; every rank calls) as save_pretrained does, swapped
    in whole: a reader finds the old directory or the new one, never a half-written one. check()
    may refuse the written directory before the swap; durable=False skips the fsyncs."""
    model = getattr(model, "_orig_mod", model)  # the module inside torch.compile(model)
    problems = export_problems(model)
    if problems:
        raise ValueError(f"{directory}: the model is not GPT-2's architecture "
                         f"({'; '.join(problems[:3])}); not written")
    cfg, params = model.config, dict(model.named_parameters())
    expected = gpt2_shapes(cfg, is_tied(model))
    dtype = params["transformer.wte.weight"].dtype
    writer = not dist.is_initialized() or dist.get_rank() == 0
    parent, base = os.path.split(os.path.abspath(directory))
    new = os.path.join(parent, f".{base}.{os.getpid()}.tmp")
    is_export = os.path.isfile(os.path.join(directory, "config.json"))
    if writer and os.path.exists(directory) and not is_export:  # else nothing, or an export
        if not os.path.isdir(directory) or os.listdir(directory):  # an empty directory may go
            raise ValueError(f"{directory}: exists and is not a model directory; not replaced")
    if writer and os.path.isdir(parent):
        for name in os.listdir(parent):  # what a killed export left behind
            if re.fullmatch(rf"\.{re.escape(base)}\.\d+\.(tmp|old)", name):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def file_tensor(name):  # every rank gathers, one tensor at a time; the writer keeps it
        if name not in params:  # a model without biases computes what one with zero biases does
            return torch.zeros(expected[name], dtype=dtype)
        tensor = params[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if not writer:
            return None
        if name in ("transformer.wte.weight", "lm_head.weight"):
            tensor = tensor[:cfg.vocab_size]
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        return tensor.cpu().contiguous()

    # transformers' own sharding: in order, a new file when the next tensor would not fit
    split = huggingface_hub.split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in expected.items()},
        max_shard_size=max_shard_size)
    files = {"config.json": hf_config(cfg, dtype, is_tied(model))}
    if split.is_sharded:
        files["model.safetensors.index.json"] = {"metadata": split.metadata,
                                                 "weight_map": split.tensor_to_filename}
    try:
        if writer:
            os.makedirs(new, exist_ok=True)
        for filename, names in split.filename_to_tensors.items():
            tensors = {name: file_tensor(name) for name in names}
            if writer:
                save_file(tensors, os.path.join(new, filename), metadata={"format": "pt"})
        if not writer:
            return
        for name, obj in files.items():
            pathlib.Path(new, name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        if extra_files is not None:
            extra_files(new)  # e.g. the tokenizer's files, inside the same swap
        _settle(new, durable)
        if check is not None:
            check(new)
        swap_in(new, directory)
    except BaseException as e:
        shutil.rmtree(new, ignore_errors=True)  # frees the space at once
        # A full disk or a read-only directory is one line naming the directory, not a traceback;
        # its errno stays, so that the run's error line adds the way out. safetensors' Rust error
        # gives the OS's code in its text only ("... (os error 28)").
        code, reason = getattr(e, "errno", None), getattr(e, "strerror", None)
        if isinstance(e, SafetensorError):
            found = re.search(r"(?:os error|code:) (\d+)", str(e))
            code = int(found[1]) if found else None
            reason = os.strerror(code) if found else str(e).strip()
        if reason:
            raise OSError(code, f"cannot write {directory}: {reason}") from None
        raise  # extra_files' own one-line errors among them


def swap_in(new, directory):
    """Put directory `new` in the place of `directory`: a reader finds one or the other whole."""
    parent, base = os.path.split(os.path.abspath(directory))
    # renameat2(RENAME_EXCHANGE) swaps the two at once (Linux); elsewhere the old one moves aside
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    exchanged = False
    if os.path.exists(directory) and renameat2 is not None:
        AT_FDCWD, RENAME_EXCHANGE = -100, 2
        paths = os.fsencode(new), os.fsencode(directory)
        exchanged = renameat2(AT_FDCWD, paths[0], AT_FDCWD, paths[1], RENAME_EXCHANGE) == 0
    old = new  # after an exchange the old directory is where the new one was
    if not exchanged:
        old = os.path.join(parent, f".{base}.{os.getpid()}.old")
        if os.path.exists(directory):
            os.rename(directory, old)
        os.rename(new, directory)
    _fsync(parent)
    shutil.rmtree(old, ignore_errors=True)


def _settle(directory, durable):
    """Make the files in `directory` readable by all (safetensors creates 0600 files) and, where
    `durable`, fsync each of them and then the directory."""
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o644)
    if durable:
        for name in [*os.listdir(directory), "."]:
            _fsync(os.path.join(directory, name))


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a file or a directory
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

