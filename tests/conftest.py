"""Helpers and fixtures several test files use: tiny datasets, the tiny training config, torchrun, log readers."""
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

# Tests never touch the network: the hub client must answer from local files or fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from indexed_dataset import IndexedDatasetBuilder  # noqa: E402 (after the path is set)


BYTE_EOT = 511


def random_documents(rng, count, max_length=60, vocab=1000):
    """(tokens, lengths) pairs: mostly one sequence, some empty documents, zero-length and two-sequence ones."""
    documents = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.05:
            documents.append((np.zeros(0, np.int64), []))
        elif kind < 0.08:
            documents.append((np.zeros(0, np.int64), [0]))
        elif kind < 0.2:
            a, b = rng.integers(1, max_length, 2)
            documents.append((rng.integers(0, vocab, a + b), [int(a), int(b)]))
        else:
            n = int(rng.integers(1, max_length))
            documents.append((rng.integers(0, vocab, n), [n]))
    return documents


def write_ours(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for tokens, lengths in documents:
        builder.add_document(tokens, lengths)
    builder.finalize(prefix + ".idx")
    return prefix


def corrupt(prefix, suffix, offset=None, data=b"", size=None, append=b""):
    """Overwrite `data` at `offset`, cut the file to `size`, or `append` to it."""
    path = prefix + suffix
    content = bytearray(open(path, "rb").read())
    if offset is not None:
        content[offset:offset + len(data)] = data
    if size is not None:
        content = content[:size]
    open(path, "wb").write(bytes(content) + append)


def deny_writes(monkeypatch, directory):
    """Make os.access say `directory` and what is under it cannot be written. Tests run as root, for whom os.access
    ignores the mode bits (a chmod 0o555 alone would not show), so it answers here as it would for a user."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: (not str(path).startswith(str(directory))
                                                          and real_access(path, mode)))


def write_byte_dataset(prefix):
    """Each blank-line separated block of Shakespeare as UTF-8 bytes + an end-of-document token."""
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        blocks = [b for b in re.split(r"\n\s*\n", f.read()) if b.strip()]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for block in blocks:
        builder.add_document(np.append(np.frombuffer(block.encode(), dtype=np.uint8), BYTE_EOT).astype(np.uint16))
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("bytes") / "shakespeare_bytes")
    write_byte_dataset(prefix)
    return prefix


def tiny(data, out_dir, **overrides):
    """--key=value arguments for a 2-layer model on the byte dataset: 60 steps of 8 x 32 tokens."""
    config = dict(data_paths=data, index_mapping_dir=os.path.join(os.path.dirname(data), "index_cache"),
                  split="90,10,0", seq_length=32, n_layer=2, n_head=2, n_embd=32, vocab_size=512,
                  padded_vocab_size=None, global_batch_size=8, local_batch_size=4, max_steps=60, lr=3e-3,
                  lr_warmup_steps=2, val_every_steps=10, val_tokens=512, ckpt_every_steps=10, device="cpu",
                  dtype="float32", compile=False, dist_timeout_s=60, out_dir=str(out_dir))
    config.update(overrides)
    return [f"--{key}={value!r}" if isinstance(value, str) else f"--{key}={value}" for key, value in config.items()]


def save_tiny_hf_gpt2(path, vocab_size):
    """A random 2-layer, 32-wide GPT2LMHeadModel saved by transformers at `path` (seed 0); returns `path`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


# -----------------------------------------------------------------------------
# Hugging Face GPT-2s to load and compare against (test_model.py, test_hf_files.py, test_checkpoint.py)

TOL = 1e-5


def random_hf_model(seed=0, **overrides):
    """A transformers GPT-2 with every parameter random, biases and LayerNorms included, so no mapping hides."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    kwargs = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    kwargs.update(overrides)
    kwargs.setdefault("bos_token_id", 50256 if kwargs["vocab_size"] > 50256 else None)
    kwargs.setdefault("eos_token_id", kwargs["bos_token_id"])
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def randomize(model, seed=0):
    """Perturb every parameter of our GPT (its init has zero biases and unit LayerNorms)."""
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(vocab_size, block_size, seed=1):
    """Three full-context rows, so every position embedding is used."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (3, block_size), generator=generator)
    labels = idx.clone()
    labels[0, 5:9] = -100  # ignored positions must be left out of the mean the same way
    return idx, labels


def assert_matches_hf(ours, hf):
    """Same logits, and the same mean loss: transformers shifts labels inside, we take next-token targets."""
    import torch
    cfg = ours.config
    idx, labels = batch(cfg.vocab_size, cfg.block_size)
    with torch.no_grad():
        hf_out = hf(idx, labels=labels)
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        logits, loss = ours(idx)[0], ours(idx, targets)[1]  # with targets the model returns the loss alone
    assert logits.shape == hf_out.logits.shape == (*idx.shape, cfg.vocab_size)
    assert (logits - hf_out.logits).abs().max().item() < TOL
    assert abs(loss.item() - hf_out.loss.item()) < TOL


def save_hf_dir(tmp_path, hf):
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """transformers' own export of a small random GPT-2, and the model itself."""
    hf = random_hf_model()
    path = tmp_path_factory.mktemp("tiny") / "hf"
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(autouse=True)
def signals_kept():
    """The test runner's SIGTERM and SIGINT handlers, put back after every test. train_gpt2.cli() in this process
    leaves the run's handlers installed (on the command line the process exits next), and they absorb SIGTERM: a
    multiprocessing.Pool forked later (prepare_fineweb.py) could then never terminate its workers."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def script(*args, env=None, timeout=300):
    """`python train_gpt2.py ARGS` in a process of its own, its output captured."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=None if env is None else {**os.environ, **env})


@pytest.fixture(scope="session")
def finished(data, tmp_path_factory):
    """A 20-step run with checkpoints at 10 and 20, on its own copy of the data (tests replace it); tests copy it."""
    import train_gpt2
    base = tmp_path_factory.mktemp("finished")
    prefix = str(base / "data" / "bytes")
    os.makedirs(os.path.dirname(prefix))
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, prefix + suffix)
    out = base / "out"
    assert train_gpt2.main(tiny(prefix, out, max_steps=20, index_mapping_dir=str(base / "cache"))) == 0
    return prefix, out


def rerun(finished, tmp_path, **overrides):
    """A copy of the finished run's out_dir (its step-10 checkpoint newest), rerun with overrides."""
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "ckpt" / "step_00000020")
    shutil.rmtree(copy / "hf")
    config = (copy / "train_config.json").read_text()
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=os.path.join(os.path.dirname(prefix), "..", "cache"))
    overrides = [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in overrides.items()]
    return copy, config, args + overrides


def small_byte_datasets(directory, count=2, blocks_each=15):
    """`count` byte-level prefixes of a few Shakespeare paragraphs each: a short epoch."""
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        blocks = [b for b in re.split(r"\n\s*\n", f.read()) if b.strip()]
    for i in range(count):
        builder = IndexedDatasetBuilder(os.path.join(directory, f"part_{i}.bin"), dtype=np.uint16)
        for block in blocks[i * blocks_each:(i + 1) * blocks_each]:
            builder.add_document(np.append(np.frombuffer(block.encode(), dtype=np.uint8), BYTE_EOT).astype(np.uint16))
        builder.finalize(os.path.join(directory, f"part_{i}.idx"))
    return os.path.join(directory, "part_*")


def gpt2_token_dataset(prefix):
    """Shakespeare's first 2,000 paragraphs in GPT-2 tokens, each ending in EOT."""
    from tokenizer import EOT_ID, gpt2_encoding
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8").read()
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for block in text.split("\n\n")[:2000]:
        builder.add_document(np.array(gpt2_encoding().encode_ordinary(block) + [EOT_ID], np.uint16))
    builder.finalize(prefix + ".idx")
    return prefix


def torchrun(args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, "train_gpt2.py"), *args]


def launch_worker(worker, nproc, *args):
    """Start tests/`worker` on `nproc` gloo ranks under torchrun, with the project root as its first argument."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), os.path.join(ROOT, "tests", worker), ROOT, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_results(launch):
    """The `RESULT <json>` lines rank 0 of a launch_worker printed, as dicts."""
    stdout, stderr = launch.communicate(timeout=300)
    assert launch.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in stdout.splitlines() if line.startswith("RESULT ")]


def run(cmd, timeout=300):
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def vislog(path):
    """main.log read the way llm.c's dev/vislog.ipynb reads it: the first key:value after s:N on each line; a later
    line for the same step and stream wins."""
    streams = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"s:(\d+) (\w+):([\d.]+)", line)
            assert m, f"main.log line vislog cannot parse: {line!r}"
            streams.setdefault(m.group(2), {})[int(m.group(1))] = float(m.group(3))
    return streams


def metrics(out_dir, key):
    """{step: value} of a metric in metrics.jsonl (full precision); later records win, as in vislog."""
    found = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if key in record:
                found[record["step"]] = record[key]
    return found


def checkpoints(out_dir):
    return sorted(os.listdir(os.path.join(out_dir, "ckpt")))


def wait_for_line(path, pattern, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if os.path.exists(path):
            with open(path) as f:
                if re.search(pattern, f.read(), re.M):
                    return
        time.sleep(0.01)
    raise TimeoutError(f"{pattern} never appeared in {path}")


def kill_tree(proc):
    """SIGKILL a process and all its descendants (torchrun starts its workers in their own sessions); reap it."""
    for pid in reversed(process_tree(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def hf_difference(out, reference):
    """'' when out/hf holds the same files as reference/hf, byte for byte (the weights bit for bit), else which not."""
    names = sorted(os.listdir(os.path.join(reference, "hf")))
    if not os.path.isdir(os.path.join(out, "hf")) or sorted(os.listdir(os.path.join(out, "hf"))) != names:
        return "hf/ holds other files"
    for name in names:
        with open(os.path.join(out, "hf", name), "rb") as a, open(os.path.join(reference, "hf", name), "rb") as b:
            if a.read() != b.read():
                return f"hf/{name} differs"
    return ""


def process_tree(pid):
    """pid and all its descendants (torchrun starts its workers in their own sessions)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


# -----------------------------------------------------------------------------
# two "nodes" on one machine: network namespaces joined by a veth pair

NETWORK_COUNTER = itertools.count()
# caches a node would find in its own HOME unless these point elsewhere: a node gets none of the test runner's
HOME_CACHES = ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
               "HELLASWAG_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=True)


def kill_namespace(namespace):
    """SIGKILL every process still in the network namespace (all of them were started by the test)."""
    try:
        pids = ip("netns", "pids", namespace).stdout.split()
    except subprocess.CalledProcessError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def network_namespaces():
    """Skips the test, before any module-scoped reference run, where network namespaces cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("two-node test: creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("two-node test: iproute2's `ip` is not installed")
    probe = f"gpt2test{os.getpid()}probe"
    try:
        ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"two-node test: `ip netns add` was refused here: {e.stderr.strip()}")
    ip("netns", "del", probe)
    # a test session killed outright (SIGKILL, SIGTERM) runs no cleanup: its namespaces go when the next one starts
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0]
        owner = re.fullmatch(r"gpt2test(\d+)x\d+n\d", name)
        if owner and not os.path.exists(f"/proc/{owner.group(1)}"):
            kill_namespace(name)
            ip("netns", "del", name)


@pytest.fixture
def two_nodes(network_namespaces, tmp_path):
    """Two "nodes": network namespaces joined by a veth pair, 10.77.0.1/30 and 10.77.0.2/30 (the addresses exist only
    inside them), each with a HOME of its own; a list of dicts (namespace, interface, address, home). Both namespaces,
    and the veth pair with them, are removed afterwards with every process in them, also when the test fails. Needs
    root and iproute2 (CI runs as root); elsewhere the test is skipped saying why."""
    tag = f"{os.getpid()}x{next(NETWORK_COUNTER)}"  # unique per test run: parallel sessions never share a name
    nodes = [dict(namespace=f"gpt2test{tag}n{i}", interface=f"gv{tag}{'ab'[i]}", address=f"10.77.0.{i + 1}",
                  home=str(tmp_path / f"home{i}")) for i in range(2)]
    created = []
    try:
        for node in nodes:
            ip("netns", "add", node["namespace"])
            created.append(node["namespace"])
        try:
            ip("link", "add", nodes[0]["interface"], "netns", nodes[0]["namespace"], "type", "veth",
               "peer", "name", nodes[1]["interface"], "netns", nodes[1]["namespace"])
        except subprocess.CalledProcessError as e:
            pytest.skip(f"two-node test: a veth pair between network namespaces was refused: {e.stderr.strip()}")
        for node in nodes:
            ip("-n", node["namespace"], "addr", "add", node["address"] + "/30", "dev", node["interface"])
            ip("-n", node["namespace"], "link", "set", "lo", "up")
            ip("-n", node["namespace"], "link", "set", node["interface"], "up")
            os.makedirs(node["home"])
        yield nodes
    finally:
        for namespace in created:
            kill_namespace(namespace)
            ip("netns", "del", namespace)  # its end of the veth pair goes with it, and so the pair


def node_torchrun(nodes, index, args, port, rdzv_id):
    """(command, environment) of node `index`'s torchrun: one rank per node, c10d rendezvous hosted by node 0."""
    node = nodes[index]
    cmd = ["ip", "netns", "exec", node["namespace"], sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
           "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={nodes[0]['address']}:{port}",
           f"--rdzv_id={rdzv_id}", f"--rdzv_conf=is_host={int(index == 0)},join_timeout=60,read_timeout=60",
           f"--local_addr={node['address']}", os.path.join(ROOT, "train_gpt2.py"), *args]
    env = {key: value for key, value in os.environ.items() if key not in HOME_CACHES}
    # torchrun sets OMP_NUM_THREADS=1 only for several processes per node: the same threads, the same bits
    env.update(HOME=node["home"], GLOO_SOCKET_IFNAME=node["interface"], OMP_NUM_THREADS="1")
    return cmd, env


def start_nodes(nodes, args, log_dir, port=29400):
    """Both nodes' torchrun started, each in its own session, output in log_dir/node{0,1}.out; the processes."""
    os.makedirs(log_dir, exist_ok=True)
    procs, rdzv_id = [], f"test{os.getpid()}x{port}"
    for index in range(2):
        cmd, env = node_torchrun(nodes, index, args, port, rdzv_id)
        with open(os.path.join(log_dir, f"node{index}.out"), "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def wait_nodes(procs, log_dir, timeout=240):
    """Both nodes' exit statuses and outputs; any process still running after `timeout` seconds is killed."""
    deadline = time.time() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        for proc in procs:
            kill_tree(proc)
    outputs = []
    for index in range(2):
        with open(os.path.join(log_dir, f"node{index}.out")) as f:
            outputs.append(f.read())
    return [proc.returncode for proc in procs], outputs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test marked gpt2 says what it checks: an edit of model.py's architecture is expected to fail it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("gpt2") is not None:
        report.sections.append(("GPT-2 parity", "this test checks parity with GPT-2 (transformers' model, Hugging Face "
                                "files, parameter or FLOP counts, the tied head, the training loss as plain "
                                "cross-entropy, GPT-2's init); after an edit of model.py it is expected to fail, and "
                                "`-m \"not gpt2\"` leaves such tests out"))
