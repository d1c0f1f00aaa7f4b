"""Local clusters: real ps and worker processes on loopback, for users and tests.

``LocalCluster(num_ps, num_workers)`` starts each task as a ``pstrain serve``
process on an ephemeral port, waits for its ``listening on`` line, and hands
the coordinator a resolver and the generated token. ``kill(job, i)`` sends
SIGKILL (a preemption drill); ``restart(job, i)`` brings the task back on the
same port. Leaving the ``async with`` block, by return, exception or Ctrl-C,
stops every process it started (SIGTERM, then SIGKILL); the servers also exit
on their own if this process dies.

``pstrain launch --ps M --workers N -- python train.py`` does the same from
the shell and runs the command as the coordinator. It gives the coordinator an address
(its ``/metrics`` and ``pstrain status`` endpoint), prints every task's address, and
writes a *run directory* while the job runs: ``cluster.json`` (what ``pstrain status
--cluster`` reads), ``token`` (mode 0600: ``--token-file``, Prometheus'
``credentials_file``) and ``targets.json`` (Prometheus' ``file_sd_configs``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

from ._base.checks import check_options
from ._base.cluster import ClusterSpec, reserved_port
from ._base.errors import InvalidArgumentError, PstrainError
from ._base.resolvers import RunningCluster
from ._base.tasks import TaskOwner
from ._formats.tensor_files import write_atomically
from .cli.arguments import level_name, log_level, positive_int
from .cli.threads import size_threads, threads_for

logger = logging.getLogger(__name__)

__all__ = ["LocalCluster"]

_LISTENING = re.compile(r"listening on (\S+)")


class _Task:
    def __init__(self, job: str, index: int) -> None:
        self.job = job
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.address: str | None = None
        self.pump: asyncio.Task[None] | None = None


class LocalCluster(RunningCluster):
    """A cluster of real processes on 127.0.0.1 (``async with``).

    ::

        async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    """

    def __init__(self, num_ps: int = 1, num_workers: int = 1, token: str | None = None, *,
                 startup_timeout_s: float = 60.0, log_level: str = "WARNING",
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 checkpoint_root: str | os.PathLike[str] | None = None) -> None:
        check_options("LocalCluster", {"num_ps": num_ps, "num_workers": num_workers},
                      {"startup_timeout_s": startup_timeout_s})  # before any process starts
        self.num_ps = num_ps
        self.num_workers = num_workers
        self.token = token or secrets.token_urlsafe(24)
        self.startup_timeout_s = startup_timeout_s
        self.log_level = level_name(log_level)
        self.extra_args = list(extra_args)
        self.env = env
        # Where the ps may read and write checkpoints (default: this process's directory).
        self.checkpoint_root = os.path.abspath(checkpoint_root or os.getcwd())
        self._tasks = {("ps", i): _Task("ps", i) for i in range(num_ps)}
        self._tasks.update({("worker", i): _Task("worker", i) for i in range(num_workers)})
        self._started = False
        self._pumps = TaskOwner("LocalCluster log pumps")

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> LocalCluster:
        """Start every task and wait until each listens."""
        try:
            await asyncio.gather(*(self._spawn(t) for t in self._tasks.values()))
        except BaseException:
            await self.stop()
            raise
        self._started = True
        return self

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.shield(self.stop())

    def _command(self, task: _Task, port: int, bound: socket.socket | None) -> list[str]:
        return [sys.executable, "-m", "pstrain.cli", "serve", "--role", task.job,
                "--index", str(task.index), "--host", "127.0.0.1", "--port", str(port),
                "--log-level", self.log_level, "--exit-with-parent",
                *(["--listen-fd", str(bound.fileno())] if bound is not None else []),
                *(["--checkpoint-root", self.checkpoint_root] if task.job == "ps" else []),
                *self.extra_args]

    async def _spawn(self, task: _Task, port: int = 0, bound: socket.socket | None = None) -> None:
        env = dict(os.environ if self.env is None else self.env)
        for key in ("TF_CONFIG", "PSTRAIN_CONFIG", "PSTRAIN_TOKEN_FILE"):
            env.pop(key, None)
        env["PSTRAIN_TOKEN"] = self.token
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Several processes share this machine's cores: BLAS pools sized for the whole
        # machine in each of them oversubscribe it (W3 ran 5x slower). Unless the user chose.
        size_threads(env, threads_for(self.num_ps + self.num_workers))
        with warnings.catch_warnings():  # JAX, if imported, warns of any fork; this one execs
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            # Their own session: a terminal's Ctrl-C (SIGINT to its foreground process group)
            # reaches the program, which finishes its steps and then stops them; they still
            # exit if it dies (--exit-with-parent). A session each also gives each server its
            # own share of the CPU (Linux autogroups).
            task.proc = await asyncio.create_subprocess_exec(
                *self._command(task, port, bound), stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env,  # both, prefixed with the task
                start_new_session=True, pass_fds=(bound.fileno(),) if bound is not None else ())
        assert task.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._read_address(task), self.startup_timeout_s)
        except TimeoutError:
            raise PstrainError(f"{task.job}:{task.index} did not start listening within "
                               f"{self.startup_timeout_s:g} s") from None
        task.address = line
        task.pump = self._pumps.spawn(self._forward(task))

    async def _read_address(self, task: _Task) -> str:
        assert task.proc is not None and task.proc.stdout is not None
        while True:
            raw = await task.proc.stdout.readline()
            if not raw:
                code = await task.proc.wait()
                raise PstrainError(f"{task.job}:{task.index} exited with code {code} before "
                                   "listening (see its log above)")
            line = raw.decode(errors="replace")
            match = _LISTENING.search(line)
            if match:
                return match.group(1)
            sys.stderr.write(f"[{task.job}:{task.index}] {line}")  # its log before listening

    async def _forward(self, task: _Task) -> None:
        """Keep the child's output (stdout and stderr) drained, each line prefixed with its
        task, onto this process's stderr."""
        assert task.proc is not None and task.proc.stdout is not None
        while True:
            raw = await task.proc.stdout.readline()
            if not raw:
                return
            sys.stderr.write(f"[{task.job}:{task.index}] {raw.decode(errors='replace')}")

    async def stop(self) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL after 5 s."""
        procs = [t for t in self._tasks.values() if t.proc is not None and t.proc.returncode is None]
        for t in procs:
            try:
                t.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass
        for t in procs:
            try:
                await asyncio.wait_for(t.proc.wait(), 5.0)  # type: ignore[union-attr]
            except TimeoutError:
                t.proc.kill()  # type: ignore[union-attr]
                await t.proc.wait()  # type: ignore[union-attr]
        for t in self._tasks.values():
            if t.pump is not None:
                t.pump.cancel()
                try:
                    await t.pump
                except BaseException:
                    pass
                t.pump = None
        self._started = False

    # -- fault drills -----------------------------------------------------------------------------
    def _task(self, job: str, index: int) -> _Task:
        task = self._tasks.get((job, index))
        if task is None:
            raise InvalidArgumentError(f"no task {job}:{index} in this LocalCluster")
        return task

    async def kill(self, job: str, index: int) -> None:
        """SIGKILL task ``job:index`` (as a preemption would) and wait until it is gone."""
        task = self._task(job, index)
        if task.proc is not None and task.proc.returncode is None:
            task.proc.kill()
            await task.proc.wait()

    async def restart(self, job: str, index: int) -> None:
        """Start task ``job:index`` again on its old port (killing it first if alive).

        The port is bound again here as soon as the task is gone, and the socket handed to
        the new process: no other process can take the port while it starts (a second
        or so), and until it listens a connection is refused, as by a task that is down.
        """
        task = self._task(job, index)
        await self.kill(job, index)
        if task.pump is not None:
            task.pump.cancel()
        assert task.address is not None
        port = int(task.address.rsplit(":", 1)[1])
        with reserved_port("127.0.0.1", port, f"{job}:{index}") as bound:
            await self._spawn(task, port, bound)  # (this process's copy is closed after)

    def pid(self, job: str, index: int) -> int | None:
        proc = self._task(job, index).proc
        return proc.pid if proc is not None and proc.returncode is None else None

    # -- what the coordinator needs ------------------------------------------------------------------
    @property
    def cluster_spec(self) -> ClusterSpec:
        if not all(t.address for t in self._tasks.values()):
            raise PstrainError("the LocalCluster is not started")
        return ClusterSpec({
            "ps": [str(self._tasks[("ps", i)].address) for i in range(self.num_ps)],
            "worker": [str(self._tasks[("worker", i)].address) for i in range(self.num_workers)],
        })


# -- pstrain launch ------------------------------------------------------------------------------
def add_launch_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch", help="start a local cluster and run a command as its coordinator",
        description="Start M ps and N worker processes on 127.0.0.1, run CMD with the cluster in "
                    "PSTRAIN_CONFIG and the token in PSTRAIN_TOKEN, and stop everything when CMD "
                    "exits (or on Ctrl-C). Exits with CMD's code.")
    p.add_argument("--ps", type=positive_int, default=1, help="number of parameter servers (default 1)")
    p.add_argument("--workers", type=positive_int, default=1, help="number of workers (default 1)")
    p.add_argument("--log-level", type=log_level, default="WARNING", help="servers' log level (WARNING)")
    p.add_argument("--dashboard", nargs="?", const="127.0.0.1:0", default=None, metavar="HOST:PORT",
                   help="the coordinator CMD makes serves the live dashboard there (default "
                        "127.0.0.1, any free port) and prints its one-time login URL "
                        "(PSTRAIN_DASHBOARD)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where to write cluster.json, token (0600) and targets.json while the job "
                        "runs (default: a new temporary directory, removed at the end)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise PstrainError("pstrain launch needs a command: pstrain launch --ps 1 --workers 2 -- "
                           "python train.py")
    if shutil.which(cmd[0]) is None:  # before any server starts
        raise PstrainError(f"{cmd[0]!r}: no such command (not on PATH, nor an executable file); "
                           "nothing was started")
    from ._transport.bridge import run

    return run(_launch_async(cmd, args.ps, args.workers, args.log_level, args.dashboard,
                             args.run_dir))


async def _launch_async(cmd: list[str], num_ps: int, num_workers: int, log_level: str,
                        dashboard: str | None = None, run_dir: str | None = None) -> int:
    async with LocalCluster(num_ps, num_workers, log_level=log_level) as cluster:
        chief = f"127.0.0.1:{_free_port()}"  # the coordinator serves its endpoint there
        config = cluster.config()
        config["cluster"]["chief"] = [chief]
        if dashboard is not None and dashboard.endswith(":0"):  # a port now, to print it
            dashboard = f"{dashboard.rsplit(':', 1)[0]}:{_free_port()}"
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        if dashboard is not None:
            env["PSTRAIN_DASHBOARD"] = dashboard
        env["PSTRAIN_CONFIG"] = json.dumps(config)
        env["PSTRAIN_TOKEN"] = cluster.token
        env.setdefault("PYTHONUNBUFFERED", "1")
        with RunDirectory(run_dir, config, cluster.token) as files:
            print(_table(config, dashboard, files, num_ps, num_workers, cmd), file=sys.stderr,
                  flush=True)
            return await _run_coordinator(cmd, env)


async def _run_coordinator(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` as the coordinator, its output prefixed; Ctrl-C or SIGTERM is passed on
    to it (SIGKILL if it has not ended 10 s later). Returns its exit code."""
    # In its own process group: a terminal's Ctrl-C reaches only this process, which passes
    # it on once (a second SIGINT would tell the program to stop at once).
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT,
                                                start_new_session=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = TaskOwner("pstrain launch")
    pump = tasks.spawn(_prefix(proc, "[chief] "))
    stopper = tasks.spawn(stop.wait())
    waiter = tasks.spawn(proc.wait(), observed=True)
    try:
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), 10.0)
            except TimeoutError:
                proc.kill()
                await waiter
        await pump
    finally:
        await tasks.close()
    return waiter.result() if waiter.result() is not None else 1


def _free_port() -> int:
    """A port free on 127.0.0.1 now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RunDirectory:
    """The files that let an operator watch a launched job, written while it runs:
    ``cluster.json`` (``pstrain status --cluster``), ``token`` (0600) and ``targets.json``
    (Prometheus ``file_sd_configs``, one target group per role). A directory it created is
    removed at the end; in a given one, only its files are."""

    def __init__(self, path: str | None, config: dict[str, Any], token: str) -> None:
        self.created = path is None
        self.path = os.path.abspath(path) if path else tempfile.mkdtemp(prefix="pstrain-launch-")
        self.config = config
        self.token = token
        self.cluster = os.path.join(self.path, "cluster.json")
        self.token_file = os.path.join(self.path, "token")
        self.targets = os.path.join(self.path, "targets.json")

    def __enter__(self) -> RunDirectory:
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        _write(self.token_file, self.token + "\n", 0o600)
        _write(self.cluster, json.dumps(self.config, indent=1) + "\n", 0o644)
        groups = [{"targets": addresses, "labels": {"job": "pstrain", "role": role}}
                  for role, addresses in self.config["cluster"].items()]
        _write(self.targets, json.dumps(groups, indent=1) + "\n", 0o644)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for path in (self.cluster, self.token_file, self.targets):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _write(path: str, text: str, mode: int) -> None:
    """``text`` to ``path``, created with ``mode`` and replacing a file of an earlier run
    atomically."""
    write_atomically(path, lambda f: f.write(text.encode()), mode=mode)


def _table(config: dict[str, Any], dashboard: str | None, files: RunDirectory, num_ps: int,
           num_workers: int, cmd: list[str]) -> str:
    """What ``pstrain launch`` prints once the cluster is up."""
    rows = [("TASK", "ADDRESS")]
    for job in ("chief", "ps", "worker"):
        for i, address in enumerate(config["cluster"].get(job, [])):
            note = "  (the coordinator)" if job == "chief" else ""
            rows.append((f"{job}:{i}", address + note))
    rows.append(("metrics", f"http://{config['cluster']['chief'][0]}/metrics  (Bearer: the token file)"))
    if dashboard is not None:
        rows.append(("dashboard", f"http://{dashboard}  (the coordinator prints its login URL)"))
    width = max(len(r[0]) for r in rows)
    lines = [f"pstrain launch: {num_ps} ps, {num_workers} worker(s) up; running {' '.join(cmd)}"]
    lines += [f"  {task:<{width}}  {address}" for task, address in rows]
    lines += [f"  cluster file  {files.cluster}",
              f"  token file    {files.token_file}  (mode 0600)",
              f"  prometheus    {files.targets}  (file_sd_configs; credentials_file: the token file)",
              f"  watch with    pstrain status --cluster {files.cluster} --token-file {files.token_file}"]
    return "\n".join(lines)


async def _prefix(proc: asyncio.subprocess.Process, prefix: str) -> None:
    assert proc.stdout is not None
    while True:
        raw = await proc.stdout.readline()
        if not raw:
            return
        sys.stdout.write(prefix + raw.decode(errors="replace"))
        sys.stdout.flush()
