"""The ways a run's config can be written, read into train_gpt2.TrainConfig.

    python train_gpt2.py configs/gpt2_124m.py --lr=1e-3        # Python assignments, then overrides
    python train_gpt2.py megatron_pretrain_gpt2.yaml           # NeMo AutoModel's recipe YAML
    python train_gpt2.py --help                                # every key with its default

Like nanoGPT's configurator.py, this file only translates: train_gpt2.TrainConfig lists every knob,
and train_gpt2.check_config says which values make sense. Each function takes the config class,
so that nothing here imports train_gpt2."""
import ast
import dataclasses
import difflib
import inspect
import json
import os
import traceback
import typing

import huggingface_hub
import yaml  # installed with huggingface_hub


def parse_config(config_class, argv):
    """`config_class` built from config files and --key=value overrides, applied in order."""
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    values = {}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ValueError(f"{arg}: write overrides as --key=value (--help lists the keys)")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # --data_paths=data/x is a string, as nanoGPT's configurator reads it
            values[key] = checked_value(fields, key, value, f"command line {arg}", text)
        elif not os.path.isfile(arg):
            raise FileNotFoundError(f"{arg}: config file not found")
        elif arg.endswith((".yaml", ".yml")):
            for key, value in automodel_yaml(arg, fields).items():
                values[key] = checked_value(fields, key, value, arg)
        else:
            for key, value in exec_config(arg).items():
                values[key] = checked_value(fields, key, value, arg)
    return config_class(**values)


def checked_value(fields, key, value, where, text=None):
    """`value` as the field `key` takes it; a ValueError saying `where` a wrong key or type was."""
    if key not in fields:
        if key in NANOGPT_KEYS:
            # A nanoGPT habit gets a pointer to our meaning, never a silent alias.
            raise ValueError(f"{where}: '{key}' is nanoGPT's name; here {NANOGPT_KEYS[key]}")
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        if key.startswith("wandb_"):
            hint = "; wandb's keys are " + ", ".join(f for f in fields if f.startswith("wandb_"))
        raise ValueError(f"{where}: unknown config key '{key}'{hint}")
    try:
        return field_value(fields[key], value, text)
    except TypeError as e:
        raise ValueError(f"{where}: {key} {e}") from None


def field_value(field, value, text=None):
    """`value` as the dataclass `field` takes it (an int is a fine float), or a TypeError naming
    the types it takes. Where the field takes a string, `text` (the value as written) wins, so
    that --split=969,30,1 is the string and not a tuple."""
    allowed = typing.get_args(field.type) or (field.type,)
    if float in allowed and type(value) is int:
        value = float(value)
    for kind in allowed:
        # bool is an int to isinstance; a flag must not pass as a count, nor a count as a flag.
        if type(value) is kind or (kind not in (int, bool) and isinstance(value, kind)):
            return value
    if text is not None and str in allowed:
        return text
    names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in allowed)
    raise wrong(names, value)


# nanoGPT's train.py keys that are not ours, and where each one's meaning lives here.
NANOGPT_KEYS = {
    "learning_rate": "it is --lr (the peak learning rate)",
    "max_iters": "it is --max_steps (optimizer steps of global_batch_size sequences)",
    "lr_decay_iters": "the cosine decay always ends at --max_steps",
    "warmup_iters": "it is --lr_warmup_steps",
    "decay_lr": "the lr always follows the schedule; --min_lr=<lr> holds it constant after warmup",
    "eval_interval": "it is --val_every_steps",
    "eval_iters": "validation is counted in tokens: "
                  "--val_tokens = eval_iters x batch_size x block_size",
    "log_interval": "every step is logged; --log_every_steps sets how often it is read",
    "batch_size": "it is --local_batch_size (sequences per forward on one rank)",
    "gradient_accumulation_steps": "it follows from the batch sizes: global_batch_size / "
                                   "(local_batch_size x world size); set --global_batch_size = "
                                   "gradient_accumulation_steps x batch_size",
    "dropout": "the model has no dropout (GPT-2 pretraining uses none); remove the key",
    "dataset": "it is --data_paths (a prefix, glob or blend list of token datasets)",
    "always_save_checkpoint": "a checkpoint is written every --ckpt_every_steps and at the end",
    "backend": "the backend follows the device: nccl on GPUs, gloo on CPU",
}
# nanoGPT's init_from values that name no model here.
NANOGPT_INIT_FROM = {
    "resume": "rerunning the same command (the same out_dir) resumes from its newest checkpoint; "
              "drop init_from",
    "scratch": "a fresh GPT-2 init is the default, init_from=None; drop init_from",
}


def exec_config(path):
    """The top-level assignments of a Python config file; its errors as one line naming file:line."""
    namespace = {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        exec(compile(text, path, "exec"), namespace)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except SystemExit as e:
        # A config that exits would end the run, perhaps with status 0 as if it had trained.
        raise ValueError(f"{path}: the config file called sys.exit({e.code!r}); "
                         "a config only assigns values") from None
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        lines = [frame.lineno for frame in frames if frame.filename == path]
        raise ValueError(f"{path}:{lines[-1] if lines else '?'}: {type(e).__name__}: {e}") from None
    return {key: value for key, value in namespace.items()
            if not key.startswith("_") and not inspect.ismodule(value)}


def config_help(config_class):
    """Every key with its type, default and comment, grouped as in the dataclasses' source: the
    fields of each dataclass that `config_class` derives from (model.GPTConfig's), then its own.
    A field declared again further down (another default) is listed once, in its first place."""
    lines = ["usage: [torchrun ...] train_gpt2.py [CONFIG.py | RECIPE.yaml] ... [--key=value ...]",
             "Config files (Python assignments, or NeMo AutoModel's YAML recipe) and overrides "
             "apply in order.",
             "Keys, as --key: type = default  # what it does:"]
    classes = [cls for cls in reversed(config_class.__mro__) if dataclasses.is_dataclass(cls)]
    fields = {field.name for field in dataclasses.fields(config_class)}
    groups = {cls: field_groups(cls, fields) for cls in classes}
    latest = {name: line for cls in classes for group in groups[cls] for name, line in group[1]}
    listed = set()
    for cls in classes:
        if cls is not config_class:
            lines.append(f"# {cls.__name__} ({cls.__module__}.py): each of its fields is a key")
        for comments, group in groups[cls]:
            group = [(name, latest[name]) for name, _ in group if name not in listed]
            if not group:
                continue  # a group that only gives other defaults, listed in its first place
            if comments and lines[-1].startswith("  --"):
                lines.append("")
            lines += [f"# {comment}" for comment in comments]
            lines += [f"  --{line}" for _, line in group]
            listed.update(name for name, _ in group)
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def field_groups(cls, fields):
    """The fields in the source of dataclass `cls`, as (comment lines, [(name, "code  # comment")])
    groups: a comment line of its own opens a group."""
    groups = []
    for line in inspect.getsource(cls).splitlines()[2:]:
        code, _, comment = (part.strip() for part in line.partition("#"))
        name = code.split(":")[0]
        if code and name not in fields:
            break  # past the fields: the class's methods
        if not code and comment:
            if not groups or groups[-1][1]:
                groups.append(([], []))
            groups[-1][0].append(comment)
        elif code:
            if not groups:
                groups.append(([], []))
            groups[-1][1].append((name, f"{code}  # {comment}" if comment else code))
    return groups


# NeMo AutoModel's recipe (examples/llm_pretrain/megatron_pretrain_gpt2.yaml) and our keys
AUTOMODEL_KEYS = {
    "step_scheduler.global_batch_size": "global_batch_size",
    "step_scheduler.local_batch_size": "local_batch_size",
    "step_scheduler.ckpt_every_steps": "ckpt_every_steps",
    "step_scheduler.val_every_steps": "val_every_steps",
    "step_scheduler.max_steps": "max_steps",
    "rng.seed": "seed", "seed": "seed",
    "dataset.paths": "data_paths", "dataset.index_mapping_dir": "index_mapping_dir",
    "dataset.seq_length": "seq_length", "dataset.split": "split",
    "optimizer.lr": "lr", "optimizer.weight_decay": "weight_decay", "optimizer.eps": "adam_eps",
    "lr_scheduler.lr_warmup_steps": "lr_warmup_steps", "lr_scheduler.min_lr": "min_lr",
    "checkpoint.checkpoint_dir": "out_dir", "checkpoint.is_async": "async_checkpoint",
    "wandb.project": "wandb_project", "wandb.name": "wandb_run_name",
    # AutoConfig.from_pretrained(name, **these) sizes the model.
    "model.config.n_layer": "n_layer", "model.config.n_head": "n_head",
    "model.config.n_embd": "n_embd", "model.config.vocab_size": "vocab_size",
    "model.config.activation_function": "activation",
    # dion.Muon's keys, read as "muon.<key>" (translate); its betas and epsilon are defaults that
    # every group here overrides (scalar_*), lm_head_lr has no head of its own (it is wte here)
    "muon.weight_decay": "weight_decay", "muon.mu": "muon_momentum",
    "muon.adjust_lr": "muon_adjust_lr", "muon.scalar_lr": "muon_scalar_lr",
    "muon.embed_lr": "muon_embed_lr", "muon.scalar_eps": "adam_eps",
}
# Keys that change nothing here whatever their value: where files go, logging, the tokenizer of
# the same token files, the checkpoint format. A name ending in "." covers a whole section.
AUTOMODEL_SAME = (
    "dataset.tokenizer.", "validation_dataset.tokenizer.", "dataloader.collate_fn",
    "validation_dataloader.collate_fn", "dataset.splits_to_build",
    "validation_dataset.splits_to_build", "step_scheduler.num_epochs", "rng.ranked",
    "dist_env.backend", "checkpoint.enabled", "checkpoint.model_save_format",
    "checkpoint.save_consolidated", "model.is_meta_device", "distributed.dp_size",
    "distributed.dp_replicate_size", "wandb.entity", "wandb.save_dir", "wandb.dir",
    "validation_dataset.paths", "validation_dataset.index_mapping_dir", "validation_dataset.split",
    "validation_dataset.seq_length", "model.config.use_cache", "model.config.bos_token_id",
    "model.config.eos_token_id", "optimizer.foreach", "optimizer.fused", "optimizer.capturable",
    "optimizer.set_grad_none", "muon.betas", "muon.epsilon", "muon.lm_head_lr", "muon.flatten",
    "muon.use_triton")
FP32 = ["torch.float32", "float32"]
# Keys that behave as ours at these values only. A class name also matches the end of a dotted
# _target_. Transformer Engine's FusedAdam with these options is our AdamW: decoupled weight decay,
# bias correction, fp32 master weights and moments (store_param_remainders keeps the master's low
# 16 bits beside the bf16 parameter, which gives the same fp32 numbers).
AUTOMODEL_VALUES = {
    "recipe": ["TrainFinetuneRecipeForNextTokenPrediction"],
    "recipe._target_": ["TrainFinetuneRecipeForNextTokenPrediction"],
    "model._target_": ["NeMoAutoModelForCausalLM.from_config"],
    "model.config._target_": ["AutoConfig.from_pretrained"],
    "model.torch_dtype": ["auto", "float32", "torch.float32", "bfloat16", "torch.bfloat16"],
    "loss_fn._target_": ["MaskedCrossEntropy"], "rng._target_": ["StatefulRNG"],
    "dataset._target_": ["MegatronPretraining"],
    "validation_dataset._target_": ["MegatronPretraining"],
    "dataloader._target_": ["StatefulDataLoader"],
    "validation_dataloader._target_": ["StatefulDataLoader"],
    # "cyclic" would shuffle differently from Megatron's order.
    "dataloader.dataloader_type": ["single"], "validation_dataloader.dataloader_type": ["single"],
    "distributed._target_": ["FSDP2Manager"], "distributed.strategy": ["fsdp2"],
    "distributed.tp_size": [1, None], "distributed.cp_size": [1, None],
    "distributed.pp_size": [1, None], "distributed.sequence_parallel": [False, None],
    "lr_scheduler.lr_decay_style": ["cosine"], "optimizer._target_": ["AdamW", "FusedAdam"],
    "optimizer.amsgrad": [False], "optimizer.maximize": [False], "optimizer.adam_w_mode": [True],
    "optimizer.bias_correction": [True], "optimizer.master_weights": [True],
    "optimizer.store_param_remainders": [True, False], "optimizer.master_weight_dtype": FP32,
    "optimizer.exp_avg_dtype": FP32, "optimizer.exp_avg_sq_dtype": FP32,
    "muon._target_": ["Muon"], "muon.scalar_opt": ["adamw"], "muon.nesterov": [False],
    # GPT2Config values the model here has (no dropout: nanoGPT and llm.c pretrain without it).
    "model.config.n_inner": [None], "model.config.layer_norm_epsilon": [1e-5],
    "model.config.initializer_range": [0.02], "model.config.tie_word_embeddings": [True],
    "model.config.scale_attn_weights": [True], "model.config.resid_pdrop": [0, 0.0],
    "model.config.embd_pdrop": [0, 0.0], "model.config.attn_pdrop": [0, 0.0],
}
# The optimizers' own defaults where the recipe leaves a value out: lr, betas, eps, weight_decay.
AUTOMODEL_OPTIMIZER_DEFAULTS = {"AdamW": (1e-3, (0.9, 0.999), 1e-8, 1e-2),
                                "FusedAdam": (1e-3, (0.9, 0.999), 1e-8, 0.0),
                                "Muon": (5e-4, (0.9, 0.999), 1e-8, 0.0)}  # MuonConfig's scalar_*
# GPT-2's sizes by hub name: n_layer, n_head, n_embd.
GPT2_SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024),
              "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}


def yaml_value(value):
    """A YAML leaf as AutoModel's loader reads it: strings such as "6e-4" or "none" are values."""
    if not isinstance(value, str):
        return value
    words = {"none": None, "None": None, "true": True, "True": True, "false": False, "False": False}
    if value in words:
        return words[value]
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def read_recipe(path):
    """(the recipe's leaves as written, the same as AutoModel reads them), keyed "section.key"."""
    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    try:
        with open(path, encoding="utf-8") as f:
            written = dict(flat(yaml.safe_load(f)))
    except (yaml.YAMLError, AttributeError) as e:
        reason = str(e).splitlines()[0]
        raise ValueError(f"{path}: not a YAML mapping of the recipe's sections: {reason}") from None
    return written, {key: yaml_value(value) for key, value in written.items()}


def pretrained_sizes(name):
    """n_layer, n_head, n_embd, vocab_size of a local Hugging Face config directory or a hub name
    (GPT-2's own sizes are known without the hub); None where neither has a config.json."""
    name = str(name)
    if not os.path.isdir(name) and os.path.basename(name) in GPT2_SIZES:
        return (*GPT2_SIZES[os.path.basename(name)], 50257)
    path = os.path.join(name, "config.json")
    if not os.path.isdir(name):
        try:
            path = huggingface_hub.hf_hub_download(name, "config.json")
        except (OSError, ValueError):  # not on the hub, or offline without a cached copy
            return None
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        sizes = tuple(config[key] for key in ("n_layer", "n_head", "n_embd", "vocab_size"))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a GPT-2 config.json ({type(e).__name__}: {e})") from None
    if config.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type {config.get('model_type')!r}; only GPT-2 is trained here")
    return sizes


def automodel_yaml(path, fields):
    """Our config keys from AutoModel's recipe YAML; one error names every key that would change
    the run."""
    written, items = read_recipe(path)
    ours, same, differ = recipe_defaults(items)
    for key, value in items.items():
        try:
            translated = translate(key, value, written[key], items, fields)
        except TypeError as e:
            raise ValueError(f"{path}: {key} {e}") from None
        if translated is None:
            differ.append(f"{key}={value!r}")
        elif translated is SAME:
            same.append(f"{key}={value!r}")
        elif isinstance(translated, str):
            differ.append(f"{key}={value!r} ({translated})")
        else:
            ours.update(translated)
    for key in ("paths", "split", "seq_length"):
        theirs = items.get(f"validation_dataset.{key}", items.get(f"dataset.{key}"))
        if theirs != items.get(f"dataset.{key}"):
            differ.append(f"validation_dataset.{key}={theirs!r} "
                          "(validation is a split of dataset.paths here)")
    if differ:
        raise ValueError(f"{path}: not supported by train_gpt2.py: {', '.join(differ)}")
    if "vocab_size" in ours:
        # The rows of wte and lm_head, a multiple of 64 as GPT-2's 50304, run faster on GPUs.
        ours["padded_vocab_size"] = -(-ours["vocab_size"] // 64) * 64
    if "wandb.project" in items or "wandb.name" in items:
        ours["wandb_log"] = True
    if ours.get("max_steps") == -1:
        ours["max_steps"] = None
    if int(os.environ.get("RANK", 0)) == 0:  # read before the process group exists
        said = " ".join(f"--{key}={value!r}" for key, value in ours.items())
        dropout = any(f"model.config.{key}_pdrop" not in items for key in ("resid", "embd", "attn"))
        name = items.get("model.config.pretrained_model_name_or_path")
        note = ""
        if name and dropout:
            note = f"; not applied: {name}'s dropout 0.1 (the model here has none)"
        print(f"{path}: AutoModel recipe read as {said}; behaves the same here: "
              f"{', '.join(same)}{note}")
    return ours


SAME = object()  # what translate() says of a key that changes nothing here


def wrong(expected, written):
    return TypeError(f"must be {expected}, got {written!r} ({type(written).__name__})")


def recipe_defaults(items):
    """(our values the recipe implies before its own keys, keys that behave the same, keys that
    differ): its optimizer's defaults, then the sizes of model.config's named model."""
    ours, same, differ = {}, [], []
    optimizer = str(items.get("optimizer._target_", "")).rsplit(".", 1)[-1]
    if optimizer in AUTOMODEL_OPTIMIZER_DEFAULTS:
        lr, betas, eps, weight_decay = AUTOMODEL_OPTIMIZER_DEFAULTS[optimizer]
        ours.update(lr=lr, beta1=betas[0], beta2=betas[1], adam_eps=eps, weight_decay=weight_decay,
                    optimizer="adamw")
    if optimizer == "Muon":
        # dion's scalar_lr defaults to its lr; ours to 5 x lr
        scalar_lr = items.get("optimizer.lr", lr)
        ours.update(optimizer="muon", muon_lr=lr, muon_momentum=0.95, muon_embed_lr=None,
                    muon_adjust_lr="spectral_norm", muon_scalar_lr=scalar_lr)
    bf16 = str(items.get("model.torch_dtype")) in ("bfloat16", "torch.bfloat16")
    if bf16 and not (optimizer == "FusedAdam" and items.get("optimizer.master_weights") is True):
        differ.append("model.torch_dtype=bfloat16 without FusedAdam's master_weights "
                      "(bf16 updates; fp32 here)")
    key = "model.config.pretrained_model_name_or_path"
    if key in items:
        sizes = pretrained_sizes(items[key])
        if sizes is None:
            differ.append(f"{key}={items[key]!r} (neither a local Hugging Face config directory "
                          f"nor a GPT-2 size known here: {', '.join(GPT2_SIZES)})")
        else:
            ours.update(zip(("n_layer", "n_head", "n_embd", "vocab_size"), sizes))
            same.append(f"{key}={items[key]!r}")
    return ours, same, differ


def translate(key, value, written, items, fields):
    """What the recipe's `key` means here: {our key: value}, SAME (no change to the run), None or
    a reason (a change this code does not make). A TypeError says what type `key` takes."""
    seq_length = items.get("dataset.seq_length", fields["seq_length"].default)
    muon = str(items.get("optimizer._target_")).rsplit(".", 1)[-1] == "Muon"
    if key.startswith("optimizer.") and muon:
        key = "muon." + key.split(".", 1)[1]  # dion.Muon's keys mean other things than AdamW's
    if key in AUTOMODEL_KEYS:
        return {AUTOMODEL_KEYS[key]: field_value(fields[AUTOMODEL_KEYS[key]], value, written)}
    if key == "muon.lr":  # Muon's rate, and the schedule's: min_lr is on its scale
        lr = field_value(fields["lr"], value, written)
        return {"lr": lr, "muon_lr": lr}
    if key in ("optimizer.betas", "muon.scalar_betas"):
        if type(value) not in (list, tuple) or len(value) != 2 or \
                any(type(beta) not in (int, float) for beta in value):
            raise wrong("a list of two numbers [beta1, beta2]", written)
        return {"beta1": float(value[0]), "beta2": float(value[1])}
    if key == "dist_env.timeout_minutes":
        if type(value) not in (int, float):
            raise wrong("a number of minutes", written)
        return {"dist_timeout_s": max(1, round(value * 60))}
    if key == "validation_dataset.num_val_samples":
        if type(value) is not int:
            raise wrong("an int (validation sequences)", written)
        return {"val_tokens": value * seq_length}
    if key == "model.config.pretrained_model_name_or_path":
        return {}  # recipe_defaults() read it
    if key in ("model.config.n_positions", "model.config.n_ctx"):
        if type(value) is not int:
            raise wrong("an int", written)
        if value == seq_length:  # a new model here has seq_length positions
            return SAME
        return f"the model's context here is dataset.seq_length, {seq_length}"
    for accepted in AUTOMODEL_VALUES.get(key, ()):
        dotted = isinstance(value, str) and value.endswith(f".{accepted}")
        if type(value) is type(accepted) and (value == accepted or dotted):
            return SAME
    for same in AUTOMODEL_SAME:
        if key == same or (same.endswith(".") and key.startswith(same)):
            return SAME
    return None
