"""``pstrain launch --ps M --workers N -- python train.py``: a :class:`~pstrain.LocalCluster`
from the shell, with the command run as its coordinator.

It gives the coordinator an address (its ``/metrics`` and ``pstrain status`` endpoint),
prints every task's address, and writes a *run directory* while the job runs:
``cluster.json`` (what ``pstrain status --cluster`` reads), ``token`` (mode 0600:
``--token-file``, Prometheus' ``credentials_file``) and ``targets.json`` (Prometheus'
``file_sd_configs``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from .._base.errors import PstrainError
from .._base.tasks import TaskOwner
from .._formats.files.tensor_files import write_atomically
from ..launch import LocalCluster
from ..server.config import paired_tier_flags
from .arguments import bytes_flag, directory, log_level, positive_int

__all__ = ["RunDirectory", "add_launch_parser"]


def add_launch_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="start a local cluster and run a command as its coordinator",
        description="Start M ps and N worker processes on 127.0.0.1, run CMD with the cluster in "
        "PSTRAIN_CONFIG and the token in PSTRAIN_TOKEN, and stop everything when CMD "
        "exits (or on Ctrl-C). Exits with CMD's code.",
    )
    p.add_argument("--ps", type=positive_int, default=1, help="number of parameter servers (default 1)")
    p.add_argument("--workers", type=positive_int, default=1, help="number of workers (default 1)")
    p.add_argument("--log-level", type=log_level, default="WARNING", help="servers' log level (WARNING)")
    p.add_argument(
        "--dashboard",
        nargs="?",
        const="127.0.0.1:0",
        default=None,
        metavar="HOST:PORT",
        help="the coordinator CMD makes serves the live dashboard there (default "
        "127.0.0.1, any free port) and prints its one-time login URL "
        "(PSTRAIN_DASHBOARD)",
    )
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where to write cluster.json, token (0600) and targets.json while the job "
        "runs (default: a new temporary directory, removed at the end)",
    )
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="run each server on its share of the cores (pstrain serve --cpus; "
        "LocalCluster(pin_cpus=True)): ps i and worker i share a core when the tasks outnumber them",
    )
    p.add_argument(
        "--memory-budget",
        type=bytes_flag,
        default=None,
        metavar="SIZE",
        help="each ps's budget in RAM for its variables and tables (512MiB, 2GiB ...): a dynamic "
        "table's rows past it live under --table-dir (pstrain serve --memory-budget). "
        "Needs --table-dir",
    )
    p.add_argument(
        "--table-dir",
        type=directory,
        default=None,
        metavar="DIR",
        help="where the ps keep the rows past --memory-budget (local disk; each ps its own "
        "directory inside, removed when it stops). Needs --memory-budget",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise PstrainError(
            "pstrain launch needs a command: pstrain launch --ps 1 --workers 2 -- python train.py"
        )
    if shutil.which(cmd[0]) is None:  # before any server starts
        raise PstrainError(
            f"{cmd[0]!r}: no such command (not on PATH, nor an executable file); nothing was started"
        )
    paired_tier_flags(args.memory_budget, args.table_dir)  # (before any server starts)
    from .._transport.bridge import run

    tiers = {"memory_budget": args.memory_budget, "table_dir": args.table_dir}
    return run(
        _launch_async(
            cmd, args.ps, args.workers, args.log_level, args.dashboard, args.run_dir, args.pin_cpus, **tiers
        )
    )


async def _launch_async(
    cmd: list[str],
    num_ps: int,
    num_workers: int,
    log_level: str,
    dashboard: str | None = None,
    run_dir: str | None = None,
    pin_cpus: bool = False,
    memory_budget: int | str | None = None,
    table_dir: str | None = None,
) -> int:
    async with LocalCluster(
        num_ps,
        num_workers,
        log_level=log_level,
        pin_cpus=pin_cpus,
        memory_budget=memory_budget,
        table_dir=table_dir,
    ) as cluster:
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
            print(_table(config, dashboard, files, num_ps, num_workers, cmd), file=sys.stderr, flush=True)
            return await _run_coordinator(cmd, env)


async def _run_coordinator(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` as the coordinator, its output prefixed; Ctrl-C or SIGTERM is passed on
    to it (SIGKILL if it has not ended 10 s later). Returns its exit code."""
    # In its own process group: a terminal's Ctrl-C reaches only this process, which passes
    # it on once (a second SIGINT would tell the program to stop at once).
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
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
        groups = [
            {"targets": addresses, "labels": {"job": "pstrain", "role": role}}
            for role, addresses in self.config["cluster"].items()
        ]
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


def _table(
    config: dict[str, Any],
    dashboard: str | None,
    files: RunDirectory,
    num_ps: int,
    num_workers: int,
    cmd: list[str],
) -> str:
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
    lines += [
        f"  cluster file  {files.cluster}",
        f"  token file    {files.token_file}  (mode 0600)",
        f"  prometheus    {files.targets}  (file_sd_configs; credentials_file: the token file)",
        f"  watch with    pstrain status --cluster {files.cluster} --token-file {files.token_file}",
    ]
    return "\n".join(lines)


async def _prefix(proc: asyncio.subprocess.Process, prefix: str) -> None:
    assert proc.stdout is not None
    while True:
        raw = await proc.stdout.readline()
        if not raw:
            return
        sys.stdout.write(prefix + raw.decode(errors="replace"))
        sys.stdout.flush()
