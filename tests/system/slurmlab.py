"""A real SLURM cluster on one machine: one ``slurmd`` per node, each in its own namespace.

``SlurmLab(["n8", "n9", "n10"], cpus=8)`` builds a :class:`~tests.netlab.NetLab`
with a host per node name, then starts, from the distribution's slurm-wlm:

* ``munged`` with a key and a socket of its own (in a temporary directory);
* ``slurmctld`` in the test's namespace, on the lab's gateway address;
* a ``slurmd -N <node>`` in each node's namespace, at that node's address.

Each namespace resolves every node name to its address (``/etc/netns/<ns>/hosts``,
which ``ip netns exec`` mounts over ``/etc/hosts``; the machine's own file is not
touched). :meth:`sbatch` submits from the test's namespace, :meth:`wait_job`
waits for a job to end and returns its state. Leaving the ``with`` block stops
every daemon it started (by PID) and removes its files, namespaces and links.

Root and slurm-wlm are required; without them the constructor raises with a
message saying so (``make test`` installs slurm-wlm and munge).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from .netlab import NetLab

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")


class SlurmLab:
    def __init__(self, nodes: list[str], cpus: int = 8) -> None:
        missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
        if missing:
            raise RuntimeError(
                f"the SLURM test needs {', '.join(missing)} (Debian: apt-get install "
                "slurm-wlm munge); `make test` installs them"
            )
        self.nodes = list(nodes)
        self.cpus = cpus
        self.net = NetLab(self.nodes)
        self.dir = ""
        self._procs: list[subprocess.Popen[Any]] = []
        self._netns_dirs: list[str] = []
        self._made_etc_netns = False
        self._jobs: list[int] = []

    def _bin(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> SlurmLab:
        self.net.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pstrain-slurm-")
        os.chmod(self.dir, 0o755)
        d = self.dir
        with open(f"{d}/munge.key", "wb") as f:
            f.write(os.urandom(128))
        os.chmod(f"{d}/munge.key", 0o600)
        self.munge_socket = f"{d}/munge.socket"
        self._spawn(
            [
                self._bin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={d}/munge.key",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ]
        )
        self._wait(lambda: os.path.exists(self.munge_socket), 20, "munged's socket")
        hosts = (
            "127.0.0.1 localhost\n"
            + "".join(f"{self.net.address(n)} {n}\n" for n in self.nodes)
            + f"{self.net.gateway} slurmctl\n"
        )
        if not os.path.isdir("/etc/netns"):
            os.makedirs("/etc/netns")
            self._made_etc_netns = True
        for n in self.nodes:
            path = f"/etc/netns/{self.net.ns(n)}"
            os.makedirs(path)
            self._netns_dirs.append(path)
            with open(f"{path}/hosts", "w", encoding="utf-8") as f:
                f.write(hosts)
        nodes = "".join(
            f"NodeName={n} NodeAddr={self.net.address(n)} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN\n"
            for n in self.nodes
        )
        self.conf = f"{d}/slurm.conf"
        with open(self.conf, "w", encoding="utf-8") as f:
            f.write(f"""ClusterName=pstrainlab
SlurmctldHost={socket.gethostname().split(".")[0]}({self.net.gateway})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MinJobAge=600
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
{nodes}PartitionName=lab Nodes={",".join(self.nodes)} Default=YES MaxTime=UNLIMITED State=UP
""")
        with open(f"{d}/cgroup.conf", "w", encoding="utf-8") as f:
            f.write("CgroupPlugin=cgroup/v1\n")  # loaded, not used (linuxproc, task/none)
        os.makedirs(f"{d}/state")
        env = self.env()
        self._spawn([self._bin("slurmctld"), "-D", "-i", "-f", self.conf], env=env)
        for n in self.nodes:
            os.makedirs(f"{d}/spool-{n}")
            proc = self.net.start(
                n,
                self._bin("slurmd"),
                "-D",
                "-f",
                self.conf,
                "-N",
                n,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self._procs.append(proc)
        self._wait(self._nodes_idle, 60, "every node idle in sinfo")

    def __exit__(self, *exc: Any) -> None:
        if self._jobs:  # this lab's jobs end first, so that slurmd stops their steps
            subprocess.run(
                [self._bin("scancel"), *map(str, self._jobs)], env=self.env(), capture_output=True, timeout=30
            )
            try:
                self._wait(
                    lambda: all(
                        self.job_state(j)[0] not in ("RUNNING", "PENDING", "COMPLETING") for j in self._jobs
                    ),
                    30,
                    "the lab's jobs ended",
                )
            except (TimeoutError, RuntimeError):
                pass  # the daemons are stopped below regardless
            self._jobs.clear()
        for proc in reversed(self._procs):  # only what this lab started, by its PID
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self._procs.clear()
        self.net.__exit__(*exc)
        for path in self._netns_dirs:
            shutil.rmtree(path, ignore_errors=True)
        self._netns_dirs.clear()
        if self._made_etc_netns:
            os.rmdir("/etc/netns")
            self._made_etc_netns = False
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers --------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": self.conf, **extra}

    def _spawn(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self._procs.append(
            subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SLURM lab: {what} not reached within {timeout:.0f} s; logs in "
                    f"{self.dir}: {self.logs()[-3000:]}"
                )
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"SLURM lab: {dead[0]} exited; {self.logs()[-3000:]}")
            time.sleep(0.2)  # polling a daemon's state, with the deadline above

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)) if self.dir and os.path.isdir(self.dir) else []:
            if name.endswith(".log"):
                with open(f"{self.dir}/{name}", encoding="utf-8", errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-1500:]}")
        return "\n".join(out)

    def _nodes_idle(self) -> bool:
        result = subprocess.run(
            [self._bin("sinfo"), "-h", "-N", "-o", "%N %t"],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        result = subprocess.run(
            [self._bin("sbatch"), "--parsable", *args],
            env=env or self.env(),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        job = int(result.stdout.strip().split(";")[0])
        self._jobs.append(job)
        return job

    def job_state(self, job: int) -> tuple[str, str]:
        """(JobState, ExitCode) as ``scontrol show job`` gives them."""
        out = subprocess.run(
            [self._bin("scontrol"), "show", "job", str(job)],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        state = re.search(r"JobState=(\S+)", out)
        code = re.search(r"ExitCode=(\S+)", out)
        return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "?")

    def wait_job(self, job: int, timeout: float, output: str | None = None) -> tuple[str, str]:
        """Wait for ``job`` to end; on a timeout the error shows the tail of ``output``."""
        ended = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY")
        try:
            self._wait(lambda: self.job_state(job)[0] in ended, timeout, f"job {job} ended")
        except TimeoutError as exc:
            tail = ""
            if output and os.path.exists(output):
                with open(output, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-6000:]
            raise TimeoutError(f"{exc}\n--- job output\n{tail}") from None
        return self.job_state(job)
