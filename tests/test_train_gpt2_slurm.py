"""train_gpt2.sbatch under a real Slurm: slurm-wlm's munged, slurmctld and slurmd, started here from a private
slurm.conf (one node of 2 CPUs, its own ports, state and spool under a temporary folder). A requeue, a time limit,
scancel and a bad key each end the way docs/slurm.md says, and every resumed run's train losses equal an
uninterrupted run's, step for step. The scenarios' jobs (1 CPU each) run at the same time, driven from one module
fixture; each test waits for its own. Needs root and slurm-wlm + munge (.ci/run installs them); skipped otherwise.
Without a Slurm (the fast tests): the script is valid bash, asks Slurm for what its endings need, and, run by bash with
stand-ins for srun, scontrol and scancel, starts the torchrun docs/slurm.md describes and ends each way it says."""
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, metrics, tiny, write_byte_dataset


PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# a 4-layer model of one sequence per micro-step: ~40 ms a step on one core, so a run's length is set in steps
MODEL = dict(n_layer=4, n_head=4, n_embd=128, local_batch_size=1, val_every_steps=50, ckpt_every_steps=50)
SHORT_STEPS = 100  # the requeue and scancel runs; they are interrupted after STOP_AFTER steps
STOP_AFTER = 60  # past the periodic checkpoint at 50, so the stop writes a checkpoint of its own
# the time-limit run's training time at the pace measured before it starts, more than its first slot holds (the
# warning comes 90 to 120 s after the start, less the start-up) so that it is requeued at least once; beside the
# other jobs it runs slower than that pace and may need a third slot
TIME_LIMIT_TRAIN_S = 125
REQUEUE_WAIT_S = 20  # Slurm restarts a requeued job after cred_expire (5 s here) and a scheduler pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(folder, node):
    """The slurm.conf of a one-node cluster of 2 CPUs that lives under `folder` (ports picked free)."""
    return f"""ClusterName=gpt2test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it starts again (default 120 s)
AuthInfo=socket={folder}/munge.socket,cred_expire=5
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobRequeue=1
# ended jobs stay readable by `scontrol show job` for this long (no accounting here)
MinJobAge=600
SchedulerType=sched/builtin
# a pending job that became eligible (a requeued one) is looked at every second, not every minute
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """The client side of the private cluster: sbatch, scontrol, scancel with its SLURM_CONF."""

    def __init__(self, folder):
        self.folder = folder
        self.env = dict(os.environ, SLURM_CONF=os.path.join(folder, "slurm.conf"), OMP_NUM_THREADS="1",
                        NPROC_PER_NODE="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])

    def __call__(self, *cmd, check=True):
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert not check or result.returncode == 0, f"{cmd}: {result.stdout}{result.stderr}"
        return result.stdout

    def sbatch(self, output, args, *options):
        """Submit train_gpt2.sbatch from the project directory, as a user would, with the test's node options (no
        GPUs, 1 CPU) and `options`; the job id. The job's output goes to `output`."""
        out = self("sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={output}",
                   *options, os.path.join(ROOT, "train_gpt2.sbatch"), *args)
        return out.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job`'s fields of the job: JobState, Restarts, ..."""
        return dict(re.findall(r"(\w+)=(\S*)", self("scontrol", "--oneliner", "show", "job", job_id)))

    def wait_end(self, job_id, timeout):
        """The job's fields once it has ended and its processes are gone (a cancelled job is CANCELLED at once, and
        COMPLETING while its run writes the checkpoint)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.job(job_id)
            if job["JobState"] in ENDED and "COMPLETING" not in self("squeue", "--noheader", f"--jobs={job_id}",
                                                                    "--format=%T", check=False):
                return job
            time.sleep(1)
        raise TimeoutError(f"job {job_id} did not end in {timeout} s: {job}")


def start_daemons(folder):
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(folder, sub))
    with open(os.path.join(folder, "slurm.conf"), "w") as f:
        f.write(slurm_conf(folder, node))
    with open(os.path.join(folder, "munge.key"), "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(os.path.join(folder, "munge.key"), 0o600)
    conf = os.path.join(folder, "slurm.conf")
    for cmd in (["munged", "--force", f"--socket={folder}/munge.socket", f"--key-file={folder}/munge.key",
                 f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                 f"--seed-file={folder}/munged.seed"],
                ["slurmctld", "-f", conf], ["slurmd", "-f", conf]):
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)  # each forks its daemon and returns


def stop_daemons(slurm):
    """Cancel what is left of the jobs, then stop the daemons this file started, by their pid files."""
    slurm("scancel", "--user=root", check=False)
    deadline = time.time() + 60
    while time.time() < deadline and slurm("squeue", "--noheader", check=False).strip():
        time.sleep(1)
    for name in ("slurmd", "slurmctld", "munged"):
        try:
            with open(os.path.join(slurm.folder, name + ".pid")) as f:
                pid = int(f.read())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
        for _ in range(100):
            if not os.path.exists(f"/proc/{pid}"):
                break
            time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("Slurm test: the daemons it starts (munged, slurmctld, slurmd) need root")
    missing = [p for p in PROGRAMS if shutil.which(p, path=os.environ["PATH"] + ":/usr/sbin:/sbin") is None]
    if missing:
        pytest.skip(f"Slurm test: {', '.join(missing)} not installed (apt-get install slurm-wlm munge)")
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip(f"Slurm test: no torchrun beside {sys.executable}")
    folder = str(tmp_path_factory.mktemp("slurm"))
    slurm = Slurm(folder)
    slurm.env["PATH"] += ":/usr/sbin:/sbin"
    try:
        start_daemons(folder)
        deadline = time.time() + 60
        while slurm("sinfo", "--noheader", "--format=%T", check=False).strip() != "idle":
            assert time.time() < deadline, "the test cluster's node never came up: see " + folder
            time.sleep(0.5)
        yield slurm
    finally:
        stop_daemons(slurm)


def start_reference(data, out_dir, steps):
    """An uninterrupted run of the same config, started directly (one process, as each job's torchrun runs one)."""
    cmd = [sys.executable, os.path.join(ROOT, "train_gpt2.py"), *tiny(data, out_dir, max_steps=steps, **MODEL)]
    with open(out_dir + ".out", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))


def reference_losses(proc, out_dir):
    try:
        assert proc.wait(timeout=900) == 0, read(out_dir + ".out")[-3000:]
    finally:
        proc.kill()
        proc.wait()
    return metrics(out_dir, "train_loss")


def step_times(out_dir):
    """{step: time} of the train steps a running run has logged so far (whole lines of metrics.jsonl)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = [line for line in f.readlines() if line.endswith("\n")]
    return {r["step"]: r["time"] for r in map(json.loads, lines) if "train_loss" in r}


def seconds_per_step(proc, out_dir, first=20, last=60, timeout=300):
    """The wall time of a step of a running reference, evaluation and checkpoints included, from metrics.jsonl."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        times = step_times(out_dir)
        if last in times:
            return (times[last] - times[first]) / (last - first)
        assert proc.poll() is None, read(out_dir + ".out")[-3000:]
        time.sleep(0.2)
    raise TimeoutError(f"the reference run never reached step {last}")


def read(path):
    with open(path) as f:
        return f.read()


def wait_for_step(slurm, job_id, out_dir, step, timeout=300):
    """Wait until the job's run has logged the train loss of `step`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if max(step_times(out_dir), default=-1) >= step:
            return
        assert slurm.job(job_id)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job(job_id)
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} never reached step {step}")


def requeue_run(slurm, data, base):
    out, log = str(base / "requeue"), str(base / "requeue.out")
    args = tiny(data, out, max_steps=SHORT_STEPS, **MODEL)
    job_id = slurm.sbatch(log, args)
    wait_for_step(slurm, job_id, out, STOP_AFTER)
    slurm("scontrol", "requeue", job_id)
    ended = slurm.wait_end(job_id, timeout=600)
    losses, text = metrics(out, "train_loss"), read(log)
    metrics_bytes = read(os.path.join(out, "metrics.jsonl"))
    again = slurm.sbatch(str(base / "requeue-again.out"), args)  # the finished run, submitted once more
    return dict(ended=ended, losses=losses, output=text, again=slurm.wait_end(again, timeout=300),
                again_output=read(base / "requeue-again.out"), metrics_before=metrics_bytes,
                metrics_after=read(os.path.join(out, "metrics.jsonl")))


def time_limit_run(slurm, job_id, out, log):
    ended = slurm.wait_end(job_id, timeout=900)
    return dict(ended=ended, losses=metrics(out, "train_loss"), output=read(log))


def scancel_run(slurm, data, base):
    out, log = str(base / "scancel"), str(base / "scancel.out")
    args = tiny(data, out, max_steps=SHORT_STEPS, **MODEL)
    job_id = slurm.sbatch(log, args)
    wait_for_step(slurm, job_id, out, STOP_AFTER)
    slurm("scancel", job_id)
    ended = slurm.wait_end(job_id, timeout=120)
    time.sleep(REQUEUE_WAIT_S)  # long enough for a requeued job to have started again
    later = slurm.job(job_id)
    checkpoints = sorted(os.listdir(os.path.join(out, "ckpt")))
    resumed = slurm.sbatch(str(base / "scancel-resumed.out"), args)
    return dict(ended=ended, later=later, checkpoints=checkpoints, output=read(log),
                resumed=slurm.wait_end(resumed, timeout=600), losses=metrics(out, "train_loss"))


def bad_key_run(slurm, data, base):
    log = str(base / "bad_key.out")
    job_id = slurm.sbatch(log, [*tiny(data, str(base / "bad_key"), **MODEL), "--max_step=5"])
    ended = slurm.wait_end(job_id, timeout=300)
    time.sleep(REQUEUE_WAIT_S)
    return dict(ended=ended, later=slurm.job(job_id), output=read(log))


@pytest.fixture(scope="module")
def scenarios(slurm, tmp_path_factory):
    """Every scenario's job submitted at once and driven in a thread of its own; futures of what each saw."""
    base = tmp_path_factory.mktemp("scenarios")
    data = str(base / "shakespeare_bytes")
    write_byte_dataset(data)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=6)
    runs = dict(bad_key=pool.submit(bad_key_run, slurm, data, base))  # a job of seconds, on one CPU
    short = str(base / "reference_short")
    proc = start_reference(data, short, SHORT_STEPS)
    procs = [proc]
    try:
        # the time-limit run must outlast its first slot: its length in steps comes from the reference's pace (the
        # job then runs beside the others as the reference runs beside the bad key's job); it takes the other CPU
        steps = max(SHORT_STEPS, round(TIME_LIMIT_TRAIN_S / seconds_per_step(proc, short)))
        out, log = str(base / "time_limit"), str(base / "time_limit.out")
        job_id = slurm.sbatch(log, tiny(data, out, max_steps=steps, **MODEL), "--time=3", "--signal=B:USR1@60")
        runs["time_limit"] = pool.submit(time_limit_run, slurm, job_id, out, log)
        long = str(base / "reference_long")
        procs.append(start_reference(data, long, steps))
        runs["reference_long"] = pool.submit(reference_losses, procs[-1], long)
        runs["requeue"] = pool.submit(requeue_run, slurm, data, base)
        runs["scancel"] = pool.submit(scancel_run, slurm, data, base)
    finally:
        short_losses = reference_losses(proc, short)
    yield dict(runs, reference_short=short_losses)
    for proc in procs:  # still running only when a test failed early
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.slow
def test_requeue_mid_run_resumes_and_completes_with_the_uninterrupted_losses(scenarios):
    seen = scenarios["requeue"].result()
    assert seen["ended"]["JobState"] == "COMPLETED" and seen["ended"]["Restarts"] == "1", seen["ended"]
    assert seen["losses"] == scenarios["reference_short"]
    # --open-mode=append: the first start's output survived the requeue, with its stop at a checkpoint
    assert "(restart 0)" in seen["output"] and "(restart 1)" in seen["output"], seen["output"][-3000:]
    assert re.search(r"^stopped by a signal at step \d+", seen["output"], re.M), seen["output"][-3000:]
    # the finished run submitted again: the job ends at once and the run does nothing
    assert seen["again"]["JobState"] == "COMPLETED" and seen["again"]["Restarts"] == "0", seen["again"]
    assert "this run is already complete" in seen["again_output"], seen["again_output"][-3000:]
    assert seen["metrics_after"] == seen["metrics_before"]


@pytest.mark.slow
def test_a_time_limit_shorter_than_the_run_requeues_it_until_complete(scenarios):
    seen = scenarios["time_limit"].result()
    ended, output = seen["ended"], seen["output"]
    assert ended["JobState"] == "COMPLETED" and int(ended["Restarts"]) >= 1, (ended, output[-3000:])
    warnings = output.count("train_gpt2.sbatch: time limit near")
    stops = len(re.findall(r"^stopped by a signal at step \d+", output, re.M))
    # A warning that lands after the run's end (a loaded machine) costs one more start, which finds
    # the run complete and ends at once.
    late = output.count("this run is already complete")
    assert late <= 1 and warnings == stops + late == int(ended["Restarts"]), output[-3000:]
    assert seen["losses"] == scenarios["reference_long"].result()


@pytest.mark.slow
def test_scancel_checkpoints_ends_the_job_for_good_and_a_new_sbatch_resumes(scenarios):
    seen = scenarios["scancel"].result()
    for job in (seen["ended"], seen["later"]):
        assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", job
    # the stop's checkpoint, at the step in progress: past the last periodic one (at 50)
    stop = int(re.search(r"^stopped by a signal at step (\d+)", seen["output"], re.M).group(1))
    assert stop > STOP_AFTER and seen["checkpoints"][-1] == f"step_{stop:08d}", (seen["checkpoints"], stop)
    assert seen["resumed"]["JobState"] == "COMPLETED", seen["resumed"]
    assert seen["losses"] == scenarios["reference_short"]


@pytest.mark.slow
def test_a_bad_key_fails_the_job_once_with_the_error_in_its_output(scenarios):
    seen = scenarios["bad_key"].result()
    for job in (seen["ended"], seen["later"]):
        assert job["JobState"] == "FAILED" and job["Restarts"] == "0", job
    errors = re.findall(r"^train_gpt2\.py: error: .*$", seen["output"], re.M)
    assert errors == ["train_gpt2.py: error: command line --max_step=5: unknown config key 'max_step'; "
                      "did you mean 'max_steps'?"], seen["output"][-3000:]


def test_the_batch_script_is_valid_bash_and_asks_slurm_for_what_its_endings_need():
    """The warning goes to the batch shell (B:), the job may be requeued, and a requeue appends to
    its output instead of truncating it."""
    script = os.path.join(ROOT, "train_gpt2.sbatch")
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with open(script, encoding="utf-8") as f:
        options = [line.split(None, 1)[1].strip() for line in f if line.startswith("#SBATCH")]
    assert "--requeue" in options and "--open-mode=append" in options
    assert any(option.startswith("--signal=B:USR1@") for option in options)


# Stand-ins for Slurm's commands: srun records its arguments (one a line) and the shutdown timeout it was given, then
# acts out FAKE_RUN; scontrol answers `show hostnames` and records the rest, as scancel does.
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$LOG/srun"
echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > "$LOG/shutdown_timeout"
case "$FAKE_RUN" in
  finish) exit 0 ;;
  fail) exit 1 ;;
  warning) kill -USR1 "$PPID"; sleep 0.3; exit 1 ;;  # the batch shell's time-limit warning; torchrun exits 1
  sigterm) kill -TERM "$PPID"; sleep 0.3; exit 1 ;;  # preemption, scontrol requeue or scancel: the shell too
esac
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo node7; echo node8; else echo "scontrol $*" >> "$LOG/calls"; fi
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$LOG/calls"
"""


def run_with_stand_ins(tmp_path, fake_run, args=(), **env):
    """train_gpt2.sbatch run by bash as job 1234 on two nodes (node[7-8]) of 8 GPUs and 64 CPUs, Slurm's commands
    replaced; (exit status, output, srun's arguments, the other Slurm calls)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(exist_ok=True)
    shutil.rmtree(log, ignore_errors=True)
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job = dict(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="node[7-8]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="8",
               SLURM_CPUS_PER_TASK="64", LOG=str(log), FAKE_RUN=fake_run)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC_PER_NODE", "MASTER_PORT"))}
    full_env = dict(base, **job, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    full_env.update(env)
    full_env = {k: v for k, v in full_env.items() if v is not None}
    result = subprocess.run(["bash", os.path.join(ROOT, "train_gpt2.sbatch"), *args], cwd=ROOT, env=full_env,
                            capture_output=True, text=True, timeout=60)
    srun = (log / "srun").read_text().splitlines() if (log / "srun").exists() else None
    calls = (log / "calls").read_text().splitlines() if (log / "calls").exists() else []
    return result.returncode, result.stdout + result.stderr, srun, calls


def test_the_batch_script_starts_one_torchrun_per_node_as_the_docs_say(tmp_path):
    """docs/slurm.md: srun starts one torchrun per node of NPROC_PER_NODE processes (default: the job's GPUs), the
    nodes meet in a c10d rendezvous on the first node at MASTER_PORT (default 20000 + job id mod 20000), the
    arguments after the script go to train_gpt2.py unchanged, and torchrun waits 600 s for its workers' checkpoint."""
    args = ["configs/gpt2_124m.py", "--local_batch_size=32", "--out_dir=out dir"]
    status, output, srun, calls = run_with_stand_ins(tmp_path, "finish", args)
    assert status == 0, output
    assert srun == ["--ntasks-per-node=1", "--cpus-per-task=64", "torchrun", "--nnodes=2", "--nproc_per_node=8",
                    "--rdzv_backend=c10d", "--rdzv_endpoint=node7:21234", "--rdzv_id=1234", "train_gpt2.py", *args]
    assert (tmp_path / "log" / "shutdown_timeout").read_text() == "600\n" and calls == []
    assert "train_gpt2.sbatch: job 1234 (restart 0): 2 node(s) x 8 process(es)" in output
    assert output.rstrip().endswith("train_gpt2.sbatch: run ended with status 0")
    _, _, srun, _ = run_with_stand_ins(tmp_path, "finish", args, NPROC_PER_NODE="4", MASTER_PORT="29500",
                                       TORCH_ELASTIC_SHUTDOWN_TIMEOUT="900")
    assert "--nproc_per_node=4" in srun and "--rdzv_endpoint=node7:29500" in srun
    assert (tmp_path / "log" / "shutdown_timeout").read_text() == "900\n"
    status, output, srun, _ = run_with_stand_ins(tmp_path, "finish", args, SLURM_GPUS_ON_NODE=None)
    assert (status, srun) == (1, None)
    assert "train_gpt2.sbatch: error: the job has no GPUs: ask for them (--gpus-per-node) or set NPROC_PER_NODE" \
        in output


@pytest.mark.parametrize("fake_run, status, calls, said", [
    ("fail", 1, [], "run ended with status 1"),  # an error: never requeued
    ("sigterm", 1, [], "SIGTERM: waiting for the run to checkpoint"),  # Slurm requeues or ends it, not the script
    ("warning", 1, ["scancel --signal=TERM 1234", "scontrol requeue 1234"],
     "requeueing: the next start resumes from the checkpoint"),
])
def test_the_batch_script_requeues_its_job_only_after_the_time_limit_warning(tmp_path, fake_run, status, calls, said):
    result, output, _, made = run_with_stand_ins(tmp_path, fake_run, ["configs/gpt2_124m.py"])
    assert (result, made) == (status, calls), output
    assert f"train_gpt2.sbatch: {said}" in output
