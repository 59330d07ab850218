"""A run's out_dir: the checks that it is the run's own, its lock, the interrupted writes a crash
left there, its logs (main.log in llm.c's format, metrics.jsonl, wandb) and the final hf/ export."""
import dataclasses
import importlib.util
import json
import os
import shutil
import time

import torch

from atomic_io import LockHeld, atomic_write, lock_file
from checkpoint import (assert_finite, config_changes, newest_usable_checkpoint,
                        read_train_state, set_aside, write_json)
from hf_files import EXPORT_TOLERANCE, check_ids, export_hf, from_pretrained, transformers_logits
from processes import attempt, first_error, is_master, on_rank0
from tokenizer import EOT_ID, VOCAB_SIZE, write_hf_tokenizer

ROOT = os.path.dirname(os.path.abspath(__file__))
# What a run writes into out_dir. A non-empty directory holding none of these is someone else's.
RUN_FILES = ("train_config.json", "ckpt", "main.log", "metrics.jsonl", ".lock")
HF_MARKER = ".train_gpt2.json"  # in every hf/ export: only such an hf/ may be replaced
LOCKS = []  # this process's out_dir locks, released when run() returns


def lock_out_dir(out_dir):
    """An exclusive flock on out_dir/.lock, which the kernel drops when the process dies."""
    try:
        LOCKS.append(lock_file(os.path.join(out_dir, ".lock")))
    except LockHeld as e:
        raise ValueError(f"{out_dir}: another run is training in this out_dir ({e}); "
                         f"wait for it to end, stop it, or choose another out_dir") from None


def cut_torn_line(path):
    """Cut a last line without a newline (the run was killed while writing it), so that the next
    record does not run into it; a message saying so, or None."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb+") as f:
        text = f.read()
        if not text or text.endswith(b"\n"):
            return None
        keep = text.rfind(b"\n") + 1
        f.truncate(keep)
    return f"{path}: cut its partial last line (the run was killed while writing it): " \
           f"{text[keep:][:60]!r}"


def check_out_dir(out_dir):
    """Refuse an out_dir that is not a run's own directory."""
    if not out_dir.strip():
        raise ValueError("config: out_dir is empty; name a directory for the run, e.g. --out_dir=out")
    path = os.path.realpath(out_dir)
    for name, protected in (("the current directory", os.getcwd()), ("the project directory", ROOT)):
        protected = os.path.realpath(protected)
        if protected == path or protected.startswith(path.rstrip(os.sep) + os.sep):
            raise ValueError(f"{out_dir}: out_dir is {name} or one of its parents; "
                             "name a directory of its own")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{out_dir}: out_dir is a file; name a directory")
    entries = os.listdir(path) if os.path.isdir(path) else []
    if entries and not set(RUN_FILES) & set(entries):
        raise ValueError(f"{out_dir}: out_dir holds {len(entries)} entries (e.g. "
                         f"{sorted(entries)[0]!r}) but no train_config.json, ckpt/ or main.log: "
                         "not a training run's directory; name a new one")


def prepare_out_dir(out_dir, eval_only=False):
    """On rank 0: check and lock out_dir, remove interrupted writes; the newest usable checkpoint or
    None. Under eval_only the run's logs stay as they are: results go to out_dir/eval/."""
    check_out_dir(out_dir)
    ckpt_root = os.path.join(out_dir, "ckpt")
    os.makedirs(ckpt_root, exist_ok=True)
    lock_out_dir(out_dir)
    for name in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, name)
        if name.endswith(".tmp"):  # ours: the lock says that no other run is writing it
            print(f"removing incomplete checkpoint {path}")
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:  # a file or a link of that name, which no checkpoint write leaves
                os.remove(path)
    resume_path, skipped = newest_usable_checkpoint(ckpt_root)
    for message in skipped:  # said at once: they explain the refusal below
        print(message)
    messages = []
    damaged = sorted(name for name in os.listdir(ckpt_root) if ".damaged-" in name)
    if resume_path is None and damaged and not eval_only:
        # Starting again from step 0 here would bury the run those checkpoints belonged to.
        raise ValueError(f"{ckpt_root}: no checkpoint is usable (damaged ones were renamed "
                         f"*.damaged-*, e.g. {damaged[-1]}); start a fresh run in another out_dir")
    log_dir = os.path.join(out_dir, "eval") if eval_only else out_dir
    os.makedirs(log_dir, exist_ok=True)
    for name in ("main.log", "metrics.jsonl"):
        log_path = os.path.join(log_dir, name)
        if resume_path or eval_only:  # appended to from here on
            messages.append(cut_torn_line(log_path))
        elif os.path.exists(log_path):  # a fresh run never mixes its curves with an older run's
            k = 1
            while os.path.exists(f"{log_path}.{k}"):
                k += 1
            os.rename(log_path, f"{log_path}.{k}")
            messages.append(f"{log_path} of an earlier run moved to {log_path}.{k}")
    for message in messages:
        if message:
            print(message)
    return resume_path


class RunLog:
    """On rank 0: a console line, a main.log line (llm.c's format) and a metrics.jsonl record (and
    wandb's), in out_dir (or its eval/ subdirectory under eval_only)."""

    def __init__(self, out_dir):
        self.out_dir, self.master, self.wandb = out_dir, is_master(), None

    def start(self, cfg, resumed):
        """On rank 0, once the config is accepted: train_config.json (eval_config.json under
        eval_only) and, with wandb_log, the wandb run of this directory."""
        name = "eval_config.json" if cfg.eval_only else "train_config.json"
        write_json(os.path.join(self.out_dir, name), dataclasses.asdict(cfg))
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        if not cfg.wandb_log:
            return
        import wandb
        id_path = os.path.join(self.out_dir, "wandb_run_id")
        if resumed and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = os.urandom(4).hex()
            with atomic_write(id_path, "w", encoding="utf-8") as f:
                f.write(run_id)
        name = cfg.wandb_run_name or os.path.basename(os.path.abspath(cfg.out_dir))
        self.wandb = wandb.init(project=cfg.wandb_project, id=run_id, resume="allow",
                                dir=self.out_dir, name=name, config=dataclasses.asdict(cfg))
        # Plotted against the training step, not wandb's own counter.
        self.wandb.define_metric("*", step_metric="step")

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()

    def __call__(self, text, main_log=None, **metrics):
        if not self.master:
            return
        print(text, flush=True)
        if main_log:
            self.append("main.log", main_log)
        if metrics:
            self.append("metrics.jsonl", json.dumps(dict(metrics, time=time.time())))
            if self.wandb is not None:
                self.wandb.log(metrics)

    def append(self, name, line):
        path = os.path.join(self.out_dir, name)
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError as e:  # a write's error names no file: name it (a full disk, a quota)
            raise OSError(e.errno, e.strerror, path) from None


def already_complete(cfg, resume_path):
    """Whether out_dir holds the run's last checkpoint and its hf/ export: nothing left to do."""
    try:
        with open(os.path.join(cfg.out_dir, "hf", HF_MARKER), encoding="utf-8") as f:
            exported = json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return False
    train_state = read_train_state(resume_path)
    last_step = cfg.max_steps or train_state["config"]["max_steps"]
    return train_state["step"] == last_step == exported


def nothing_left(cfg, resume_path, log):
    """Whether the run in out_dir is already complete (its last checkpoint and hf/), said if so."""
    if not resume_path or cfg.eval_only:
        return False
    if not on_rank0(lambda: already_complete(cfg, resume_path)):
        return False
    saved = on_rank0(lambda: read_train_state(resume_path)["config"])
    # Where the run and its index cache live is no change to the run.
    differ = config_changes({k: v for k, v in saved.items()
                             if k not in ("out_dir", "index_mapping_dir")}, cfg)
    text = f"{cfg.out_dir}: this run is already complete ({resume_path}, exported to hf/); " \
           "nothing to do"
    if differ:
        text += (f"; the config differs from the run's ({'; '.join(differ)}) and a finished run "
                 "takes no change: use a new out_dir, or raise max_steps to train on")
    log(text)
    return True


def publish_hf(model, cfg):
    """The final weights (and GPT-2's tokenizer) as out_dir/hf; an hf/ that this script did not
    write is moved aside first."""
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 keeps the root's last forward unsharded (bf16): back to fp32 shards
    assert_finite(model, "Hugging Face export", cfg.out_dir)
    t0, hf_dir = time.perf_counter(), os.path.join(cfg.out_dir, "hf")
    ours = os.path.exists(os.path.join(hf_dir, HF_MARKER))
    if is_master() and os.path.isdir(hf_dir) and not ours:
        print(f"{hf_dir} was not written by train_gpt2.py; moved to {set_aside(hf_dir, 'moved')}")

    def extra_files(directory):
        if model.config.vocab_size == VOCAB_SIZE:
            # GPT-2's tokenizer, for its context, and generation that stops at its EOT.
            write_hf_tokenizer(directory, model_max_length=model.config.block_size)
            write_json(os.path.join(directory, "generation_config.json"),
                       dict(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID))
        write_json(os.path.join(directory, HF_MARKER),
                   dict(written_by="train_gpt2.py", step=cfg.max_steps))

    def check(directory):  # the final weights as written, read back by model.py and transformers
        if importlib.util.find_spec("transformers") is None:
            return  # export_hf checked the tensors' names and shapes
        # The check before step 1 again, on the final weights over the model's whole context.
        ours = from_pretrained(directory).eval()
        ids = check_ids(ours.config)
        with torch.no_grad():
            difference = (ours(ids)[0] - transformers_logits(directory, ids)).abs().max().item()
        if difference > EXPORT_TOLERANCE:
            raise ValueError(f"{hf_dir}: not written: transformers' GPT-2 computes other logits "
                             f"from the final weights (largest difference {difference:.3g})")

    # Every rank gathers one tensor at a time to rank 0, which writes and checks.
    _, error = attempt(lambda: export_hf(model, hf_dir, extra_files=extra_files, check=check))
    first_error(error)  # on every rank, so that none waits for rank 0
    if is_master():
        print(f"exported Hugging Face weights to {hf_dir} ({time.perf_counter() - t0:.1f} s)")


def unlock_out_dirs():
    """Drop this process's out_dir locks: closing the only descriptor drops the flock."""
    while LOCKS:
        os.close(LOCKS.pop())
