"""A real Slurm on one machine: munged, slurmctld and slurmd nodes in network namespaces (tests/netns.py).

    root namespace: munged (its own key and socket), slurmctld on the bridge address 10.A.B.254
        |-- netns n1 10.A.B.1, hostname n1: slurmd      (learner component, batch host)
        |-- netns n2 10.A.B.2, hostname n2: slurmd      (actor component)
        |-- netns n3 10.A.B.3, hostname n3: slurmd      (add_actors.sbatch)

    partitions: main (the default; PriorityTier 1, preemption GraceTime GRACE_S) and urgent (PriorityTier 2):
    a job in urgent preempts main's jobs on its nodes (PreemptMode=REQUEUE), as on a site with preemption.
    Each node has Gres=gpu:GPUS that Slurm counts and allocates, plain files standing in for the devices: a job
    asking for GPUs is scheduled as on a GPU cluster, and torch on its nodes sees no CUDA.

Each slurmd has a UTS namespace of its own, so `hostname` and `hostname -I` in a job answer as they would on a
separate machine; every job runs as root on the shared filesystem (the run directory every node reads). The
scheduler is backfill with a 1 s cycle: heterogeneous jobs start only on the backfill cycle (30 s by default).

Everything lives in one temporary folder (config, state, logs, munge key and socket) and `stop()` ends every
daemon (whole process groups) and deletes the namespaces. Debian's slurm-wlm and munge are installed by
tests/slurm/install.sh (as root, through apt) where missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from netns import NetnsUnavailable, Network

from deploy import procs
from protocol.net import free_port

HERE = Path(__file__).resolve().parent
NODES = ("n1", "n2", "n3")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")
START_S = 60.0  # daemons up and every node idle
GRACE_S = 60  # main's preemption GraceTime: a preempted job's time to checkpoint
GPUS = 2  # each node's gres: gpu:2, counted and allocated by Slurm, with no CUDA device behind it


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the cluster (not root, no apt to install Slurm, no namespaces)."""


def ensure_installed() -> None:
    """slurm-wlm and munge, installed through apt (tests/slurm/install.sh) where missing; else SlurmUnavailable."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    proc = subprocess.run(["bash", str(HERE / "install.sh")], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"installing slurm-wlm and munge failed: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")


class Cluster:
    def __init__(self, workdir: Path):
        if os.geteuid() != 0:
            raise SlurmUnavailable("the Slurm daemons run as root (SlurmUser=root)")
        ensure_installed()
        self.dir = workdir
        self.daemons: list[subprocess.Popen] = []
        try:
            self.net = Network()
        except NetnsUnavailable as e:
            raise SlurmUnavailable(f"network namespaces unavailable: {e}") from e
        try:
            self.hosts = {n: self.net.add(n) for n in NODES}
            self.ctl_addr = str(self.net.subnet[254])
            self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}
            self._munge()
            self._write_conf()
            self._start()
        except BaseException:
            self.stop()
            raise

    def _munge(self) -> None:
        key = self.dir / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        key.chmod(0o600)
        self.munge_socket = self.dir / "munge.socket"
        argv = ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}"]
        argv += [
            f"--pid-file={self.dir / 'munged.pid'}",
            f"--seed-file={self.dir / 'munged.seed'}",
            f"--log-file={self.dir / 'munged.log'}",
        ]
        self.daemons.append(procs.spawn(argv, log=self.dir / "munged.out"))
        _wait("munged's socket", lambda: self.munge_socket.exists(), self.daemons, 20)

    def _write_conf(self) -> None:
        d = self.dir
        ctl_host = socket.gethostname().split(".")[0]  # slurmctld refuses to run on a host not named here
        lines = [
            "ClusterName=fleetrl",
            f"SlurmctldHost={ctl_host}({self.ctl_addr})",
            f"SlurmctldPort={free_port()}",
            "SlurmdPort=6818",  # each node has a network namespace, so ports of its own
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",  # a requeued job waits this long to start again (120 s by default)
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmdSpoolDir={d / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1",  # het jobs start on the backfill cycle (default 30 s)
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",  # every node is this machine: take the sizes below as they are
            "ReturnToService=2",
            "KillWait=30",  # SIGTERM -> SIGKILL at scancel, Slurm's default
            "MessageTimeout=20",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "MinJobAge=600",  # finished jobs stay visible to squeue/scontrol for the tests' checks
            "PreemptType=preempt/partition_prio",  # a job in a partition of a higher PriorityTier preempts
            "PreemptMode=REQUEUE",
            "GresTypes=gpu",
        ]
        cpus = os.cpu_count() or 1
        for name, host in self.hosts.items():
            lines.append(f"NodeName={name} NodeAddr={host.addr} NodeHostname={name} CPUs={cpus} Gres=gpu:{GPUS} State=UNKNOWN")
        # Preemption as a site sets it up: a job in `urgent` takes the nodes of `main`'s jobs, which Slurm requeues
        # after GRACE_S (SIGTERM at once, as a notice; then the job is ended and started again).
        part = "Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=NO"
        lines.append(f"PartitionName=main {part} Default=YES PriorityTier=1 GraceTime={GRACE_S}")
        lines.append(f"PartitionName=urgent {part} Default=NO PriorityTier=2 PreemptMode=OFF")
        (d / "ctld").mkdir(exist_ok=True)
        (d / "slurm.conf").write_text("\n".join(lines) + "\n")
        # GPUs that Slurm counts and allocates (--gpus-per-node, SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES): gres/gpu
        # needs a File per GPU (without one slurmd drops it and the node is INVAL), which slurmd only stats. Plain
        # files stand in for /dev/nvidiaN: a job is scheduled as on a GPU cluster, and torch on the node sees no CUDA.
        for i in range(GPUS):
            (d / f"gpu{i}").touch()
        (d / "gres.conf").write_text(f"Name=gpu File={d}/gpu[0-{GPUS - 1}]\n")

    def _start(self) -> None:
        ctld = procs.spawn(["slurmctld", "-D", "-i"], env={"SLURM_CONF": self.env["SLURM_CONF"]}, log=self.dir / "slurmctld.out")
        self.daemons.append(ctld)
        _wait("slurmctld", lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, self.daemons, START_S)
        for name, host in self.hosts.items():
            (self.dir / f"spool-{name}").mkdir(exist_ok=True)
            # nsenter, not `ip netns exec`: that remounts /sys, without the cgroup mounts slurmd's plugin needs. A UTS
            # namespace of its own: `hostname` in a job on this node says the node's name.
            cmd = [
                "nsenter",
                f"--net=/run/netns/{host.netns}",
                "unshare",
                "--uts",
                "sh",
                "-c",
                f"hostname {name} && exec slurmd -D -N {name}",
            ]
            env = {"SLURM_CONF": self.env["SLURM_CONF"]}
            self.daemons.append(procs.spawn(cmd, env=env, log=self.dir / f"slurmd-{name}.out"))
        _wait("every node idle", lambda: self.idle_nodes() == len(NODES), self.daemons, START_S)

    def run(self, argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def idle_nodes(self) -> int:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout  # a node once per partition
        return len({line.split()[0] for line in out.splitlines() if line.split()[-1:] == ["idle"]})

    def job_state(self, job: str) -> str:
        """The job's state as squeue/scontrol give it (a het job: its leader's), or "" if Slurm forgot it."""
        out = self.run(["scontrol", "show", "job", job], check=False).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return ""

    def gpus_per_node(self, job: str) -> list[int]:
        """GPUs per node that each component of the job asked for (TresPerNode=gres:gpu:N; 0 for none)."""
        out = self.run(["scontrol", "show", "job", "-o", job]).stdout.splitlines()
        counts = []
        for line in out:
            tres = next((f.split("=", 1)[1] for f in line.split() if f.startswith("TresPerNode=")), "")
            counts.append(next((int(t.rsplit(":", 1)[1]) for t in tres.split(",") if t.startswith("gres:gpu:")), 0))
        return counts

    def restarts(self, job: str) -> int:
        """How many times Slurm started the job again (requeued, preempted): scontrol's Restarts."""
        out = self.run(["scontrol", "show", "job", job], check=False).stdout
        return next((int(w.split("=", 1)[1]) for w in out.split() if w.startswith("Restarts=")), 0)

    def exit_codes(self, job: str) -> list[str]:
        """ExitCode=status:signal of each component (a het job has one per component)."""
        out = self.run(["scontrol", "show", "job", job], check=False).stdout
        return [w.split("=", 1)[1] for w in out.split() if w.startswith("ExitCode=")]

    def wait_done(self, job: str, timeout: float) -> str:
        end = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in end:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job} not done after {timeout} s (state {self.job_state(job)})")

    def stop(self) -> None:
        """Every job cancelled and ended, every daemon stopped, then anything left that runs under this cluster's
        config (slurmstepd daemonizes: it is in no daemon's process group) killed, and the namespaces deleted."""
        if hasattr(self, "env") and (self.dir / "slurm.conf").exists():
            self.run(["scancel", "--user=root"], check=False)
            deadline = time.monotonic() + 45  # KillWait (30 s) bounds a job's stop
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        procs.stop(self.daemons, 10)
        kill_leftovers(self.dir / "slurm.conf")
        if hasattr(self, "net"):
            self.net.teardown()


def kill_leftovers(conf: Path) -> list[int]:
    """SIGKILL every process whose environment names `conf` as SLURM_CONF (slurmstepd, job scripts, learners and
    actors of this cluster's jobs, whatever their process group); returns their pids."""
    mark = f"SLURM_CONF={conf}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
                pids.append(int(pid))
        except (OSError, ValueError):
            continue
    return pids


def _wait(what: str, check, daemons: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        dead = [p.args for p in daemons if p.poll() is not None]
        if dead:
            raise RuntimeError(f"waiting for {what}: {dead[0]} exited")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


if __name__ == "__main__":  # a cluster to poke at by hand: python tests/slurm/cluster.py DIR (Ctrl-C or SIGTERM stops it)
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    c = Cluster(work)
    # both stop it, even where the shell that started it in the background left SIGINT ignored
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"export SLURM_CONF={c.env['SLURM_CONF']}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        c.stop()
