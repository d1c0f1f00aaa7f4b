"""Local clusters: real ps and worker processes on loopback, for users and tests.

``LocalCluster(num_ps, num_workers)`` starts each task as a ``pstrain serve``
process on an ephemeral port, waits for its ``listening on`` line, and hands
the coordinator a resolver and the generated token. ``kill(job, i)`` sends
SIGKILL (a preemption drill); ``restart(job, i)`` brings the task back on the
same port. Leaving the ``async with`` block, by return, exception or Ctrl-C,
stops every process it started (SIGTERM, then SIGKILL); the servers also exit
on their own if this process dies.

``pstrain launch`` (``cli/launch.py``) starts one from the shell and runs a command as
its coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import socket
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ._base.checks import byte_size, check_options
from ._base.cluster import ClusterSpec, reserved_port
from ._base.errors import InvalidArgumentError, PstrainError
from ._base.resolvers import RunningCluster
from ._base.tasks import TaskOwner
from .cli.arguments import level_name
from .cli.threads import cpu_shares, size_threads, threads_for

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

    ``memory_budget`` (bytes, or ``"512MiB"``) and ``table_dir`` tier every ps's dynamic
    tables, as ``pstrain serve --memory-budget --table-dir`` does: each ps keeps their rows,
    slots and indexes within the budget in RAM, and the rest on disk under ``table_dir``.

    ``pin_cpus=True`` runs each task on its share of the cores this process may use
    (``pstrain serve --cpus``): with as many tasks as cores or more, ps ``i`` and worker
    ``i`` share core ``i`` (modulo the cores); with fewer, each task has its own run of
    cores. Tasks that stay on their cores keep their caches: W8, 2 ps and 2 workers on 2
    cores, trains about 8 % faster pinned. Off by default: the kernel's own placement is
    the better one when the tasks' loads are uneven.
    """

    def __init__(
        self,
        num_ps: int = 1,
        num_workers: int = 1,
        token: str | None = None,
        *,
        startup_timeout_s: float = 60.0,
        log_level: str = "WARNING",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
        memory_budget: int | str | None = None,
        table_dir: str | os.PathLike[str] | None = None,
        pin_cpus: bool = False,
    ) -> None:
        if (memory_budget is None) != (table_dir is None):
            raise InvalidArgumentError(
                "LocalCluster: memory_budget needs table_dir, and table_dir memory_budget (each ps "
                "keeps its tables' rows within the budget in RAM, the rest under table_dir)"
            )
        check_options(
            "LocalCluster",
            {"num_ps": num_ps, "num_workers": num_workers},
            {"startup_timeout_s": startup_timeout_s},
        )  # before any process starts
        self.num_ps = num_ps
        self.num_workers = num_workers
        self.token = token or secrets.token_urlsafe(24)
        self.startup_timeout_s = startup_timeout_s
        self.log_level = level_name(log_level)
        self.extra_args = list(extra_args)
        self.env = env
        # Where the ps may read and write checkpoints (default: this process's directory).
        self.checkpoint_root = os.path.abspath(checkpoint_root or os.getcwd())
        #: Each ps's budget for its tables in RAM, in bytes, and where the rest goes.
        self.memory_budget = byte_size(memory_budget, "memory_budget") if memory_budget is not None else None
        self.table_dir = os.path.abspath(table_dir) if table_dir is not None else None
        self._tasks = {("ps", i): _Task("ps", i) for i in range(num_ps)}
        self._tasks.update({("worker", i): _Task("worker", i) for i in range(num_workers)})
        #: Each task's cores (``pin_cpus``), None: any core.
        self.cpus: dict[tuple[str, int], list[int]] | None = None
        if pin_cpus:
            shares = cpu_shares(len(self._tasks), sorted(os.sched_getaffinity(0)))
            self.cpus = dict(zip(self._tasks, shares))
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
        return [
            sys.executable,
            "-m",
            "pstrain.cli",
            "serve",
            "--role",
            task.job,
            "--index",
            str(task.index),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            self.log_level,
            "--exit-with-parent",
            *(["--listen-fd", str(bound.fileno())] if bound is not None else []),
            *(["--checkpoint-root", self.checkpoint_root] if task.job == "ps" else []),
            *(
                ["--memory-budget", str(self.memory_budget), "--table-dir", self.table_dir]
                if task.job == "ps" and self.memory_budget is not None and self.table_dir is not None
                else []
            ),
            *(["--cpus", ",".join(map(str, self.cpus[task.job, task.index]))] if self.cpus else []),
            *self.extra_args,
        ]

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
                *self._command(task, port, bound),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,  # both, prefixed with the task
                start_new_session=True,
                pass_fds=(bound.fileno(),) if bound is not None else (),
            )
        assert task.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._read_address(task), self.startup_timeout_s)
        except TimeoutError:
            raise PstrainError(
                f"{task.job}:{task.index} did not start listening within {self.startup_timeout_s:g} s"
            ) from None
        task.address = line
        task.pump = self._pumps.spawn(self._forward(task))

    async def _read_address(self, task: _Task) -> str:
        assert task.proc is not None and task.proc.stdout is not None
        while True:
            raw = await task.proc.stdout.readline()
            if not raw:
                code = await task.proc.wait()
                raise PstrainError(
                    f"{task.job}:{task.index} exited with code {code} before listening (see its log above)"
                )
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
        """The process id of task ``job:index``, or None while it is not running (killed, or not started)."""
        proc = self._task(job, index).proc
        return proc.pid if proc is not None and proc.returncode is None else None

    # -- what the coordinator needs ------------------------------------------------------------------
    @property
    def cluster_spec(self) -> ClusterSpec:
        """The tasks' addresses on 127.0.0.1 (once started), as a :class:`ClusterSpec`."""
        if not all(t.address for t in self._tasks.values()):
            raise PstrainError("the LocalCluster is not started")
        return ClusterSpec(
            {
                "ps": [str(self._tasks[("ps", i)].address) for i in range(self.num_ps)],
                "worker": [str(self._tasks[("worker", i)].address) for i in range(self.num_workers)],
            }
        )
