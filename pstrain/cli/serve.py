"""``pstrain serve``: one task of a cluster (a ps, a worker, or the evaluator).

The server stack (the transport, the ps, the worker) is imported when a task starts, not
with this module: ``pstrain --help`` and a mistyped flag answer in about 0.4 s instead
of 1.1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._base.cluster import ClusterSpec, parse_address
from .._base.errors import PstrainError
from .._base.resolvers import SlurmClusterResolver, read_config, read_token
from .._base.tasks import TaskOwner
from .arguments import (
    LOG_LEVELS,
    address,
    bytes_flag,
    cpus_flag,
    directory,
    index_number,
    keep_freed_flag,
    log_level,
    port_number,
    positive_int,
    seconds,
)
from .memory import DEFAULT_KEEP, keep_freed, one_heap

if TYPE_CHECKING:
    from ..server.config import ServeConfig

logger = logging.getLogger("pstrain.cli")

__all__ = ["serve", "serve_config", "serve_parser"]

SERVE_EPILOG = """\
The cluster comes from --cluster FILE, else PSTRAIN_CONFIG, else TF_CONFIG: the
JSON TensorFlow uses, e.g.
  {"cluster": {"chief": ["10.0.0.1:2222"], "ps": ["10.0.0.2:2222"],
               "worker": ["10.0.0.3:2222", "10.0.0.4:2222"]},
   "task": {"type": "ps", "index": 0}}
--role/--index default to its "task". Without any cluster a ps or worker still
starts (workers learn the ps addresses from the coordinator).
The token comes from --token-file, else PSTRAIN_TOKEN, else PSTRAIN_TOKEN_FILE.
"""


def serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run one task: a ps, a worker or the sidecar evaluator",
        description="Run one task of a pstrain cluster until SIGTERM or SIGINT.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--role",
        choices=["ps", "worker", "evaluator"],
        help="which task to run (default: the config's task.type)",
    )
    p.add_argument("--index", type=index_number, help="task index within its role (default: task.index)")
    p.add_argument("--cluster", metavar="FILE", help="cluster config JSON file (TF_CONFIG format)")
    p.add_argument(
        "--slurm-jobs",
        metavar="JOBS",
        help="inside a SLURM step: the tasks per job, e.g. chief=1,ps=1,worker=3 "
        "(role and index then come from SLURM_PROCID)",
    )
    p.add_argument(
        "--port-base",
        type=port_number,
        default=8888,
        help="with --slurm-jobs: the first port on each node (default 8888)",
    )
    p.add_argument(
        "--host", default=None, help="address to bind (default 127.0.0.1; another address needs a token)"
    )
    p.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="port to bind (default: this task's port in the cluster; 0 picks a free one)",
    )
    p.add_argument("--token-file", metavar="FILE", help="file holding the cluster token")
    p.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA file to verify other tasks' certificates (workers -> ps, ps -> ps in a move)",
    )
    p.add_argument(
        "--max-body",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help="largest request body accepted (default 2 GiB); larger -> 413",
    )
    p.add_argument(
        "--checkpoint-dir", metavar="DIR", help="evaluator: the directory the job's CheckpointManager writes"
    )
    p.add_argument(
        "--eval-script",
        metavar="FILE",
        help="evaluator: a Python file defining evaluate(variables, iterations) -> metrics",
    )
    p.add_argument(
        "--max-evaluations",
        type=positive_int,
        default=None,
        help="evaluator: stop after this many evaluations (default: run forever)",
    )
    p.add_argument(
        "--join",
        type=address,
        metavar="HOST:PORT",
        help="join a running job through its coordinator's endpoint (the address of its "
        "/metrics). A worker takes the slot of a worker that is gone, or grows the "
        "job; a ps gets the next index, and a share of the variables moves to it "
        "while training runs (on SIGTERM they move away again before it exits). "
        "It follows that coordinator: when another one serves there (started again "
        "after it was lost), it joins that one too",
    )
    p.add_argument(
        "--advertise",
        type=address,
        metavar="HOST:PORT",
        help="with --join: the address the coordinator should use (default: the listening address)",
    )
    p.add_argument(
        "--exit-on-shutdown",
        action="store_true",
        default=None,
        help="leave when the coordinator says its job is done "
        "(coordinator.shutdown_cluster(); the default with --slurm-jobs, so that the "
        "SLURM job ends)",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="worker: on SIGTERM, take no new closures and wait this long for the running "
        "ones before leaving (on Ctrl-C, at most 4 s); ps started with --join: on "
        "SIGTERM, wait this long for its variables to move to the other ps",
    )
    p.add_argument(
        "--keep-freed",
        type=keep_freed_flag,
        default=None,
        metavar="SIZE",
        help="worker: freed memory its malloc keeps for the next steps' arrays instead of "
        "returning it to the system, which then faults every page in again each step "
        "(default 256MiB; 0: glibc's own behaviour; other roles: 0)",
    )
    p.add_argument(
        "--closure-threads",
        type=positive_int,
        default=4,
        help="worker: threads that run plain-def closures (default 4)",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve GET /metrics without the token (for a Prometheus without it)",
    )
    p.add_argument(
        "--no-pickle",
        action="store_true",
        help="ps: refuse every pickled payload (strategy.extended.update then fails "
        "with a clear error; nothing else needs pickles on a ps)",
    )
    p.add_argument(
        "--checkpoint-root",
        type=directory,
        metavar="DIR",
        default=None,
        help="ps: read and write checkpoint files only under DIR (default: the "
        "directory the ps is started in)",
    )
    p.add_argument(
        "--max-variable-bytes",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help="ps: largest variable (or part of a sharded one) it creates (default 512 MiB)",
    )
    p.add_argument(
        "--max-reply-bytes",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help="ps: largest reply of whole variables (vars/read) it sends "
        "(default 1 GiB; read fewer variables per request past it)",
    )
    p.add_argument(
        "--max-store-bytes",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help="ps: bytes of variables and dynamic tables it holds at most in RAM (default 80%% "
        "of the memory it may use: the machine's, or its cgroup's limit if lower, less what it "
        "holds at start and what its HTTP face will hold once set up); creations, table growth "
        "and restores past it are refused",
    )
    p.add_argument(
        "--memory-budget",
        type=bytes_flag,
        default=None,
        metavar="SIZE",
        help="ps: bytes its variables, dynamic tables' rows, optimizer slots and indexes may "
        "take in RAM (512MiB, 2GiB ...), a sixteenth kept for requests in flight; a dynamic "
        "table's rows past it live under --table-dir; a "
        "fixed variable (or its optimizer slots) is given RAM from the tables' rows in RAM, which "
        "move to disk; a table that cannot fit, or a variable that still would pass it, is "
        "refused (ResourceExhaustedError). Needs --table-dir",
    )
    p.add_argument(
        "--table-dir",
        type=directory,
        default=None,
        metavar="DIR",
        help="ps: where rows past --memory-budget live (local disk; each ps process keeps its "
        "own directory inside, removed when it stops). Needs --memory-budget",
    )
    p.add_argument(
        "--log-level",
        type=log_level,
        default="INFO",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default INFO)",
    )
    p.add_argument(
        "--listen-fd",
        type=index_number,
        default=None,
        metavar="FD",
        help="listen on the TCP socket inherited as this file descriptor, already "
        "bound to --host:--port (LocalCluster restarts a task on its port so)",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one exits (LocalCluster uses it)",
    )
    p.add_argument(
        "--cpus",
        type=cpus_flag,
        default=None,
        metavar="LIST",
        help="run on these cores only (0-3,6 ...; LocalCluster(pin_cpus=True) gives each task "
        "its share): tasks sharing a machine keep their caches (default: any core)",
    )


def _raise_open_files_limit(want: int = 8192) -> None:
    """A server may hold a thousand connections still authenticating (the pre-auth cap):
    lift the soft limit on open files towards the hard one where it is lower."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def serve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeConfig:
    """The task ``pstrain serve``'s flags and the environment describe: its role and index
    (flags first, then ``PSTRAIN_CONFIG``/``TF_CONFIG`` or SLURM's variables), where it
    listens, its token, and what its role needs. Built once; nothing after reads a flag."""
    from .._transport.frames import DEFAULT_MAX_BODY
    from ..server.config import EvaluatorConfig, PsLimits, ServeConfig

    spec: ClusterSpec | None = None
    role, index, host = args.role, args.index, args.host
    config = read_config(args.cluster, environ)  # PSTRAIN_CONFIG: JSON, or a file's path
    if config is not None:
        spec, task_type, task_id = config
        role = role or task_type
        index = index if index is not None else task_id
    elif args.slurm_jobs:
        jobs = {}
        for item in args.slurm_jobs.split(","):
            name, _, count = item.partition("=")
            if not count.isdigit():
                raise PstrainError(f"--slurm-jobs takes job=count pairs, got {item!r}")
            jobs[name.strip()] = int(count)
        slurm = SlurmClusterResolver(jobs=jobs, port_base=args.port_base)
        spec = slurm.cluster_spec()
        role = role or slurm.task_type
        index = index if index is not None else slurm.task_id
        if host is None:
            host = "0.0.0.0"  # other nodes must reach it; a token is then required
    if role not in ("ps", "worker", "evaluator"):
        raise PstrainError(
            "pstrain serve needs --role ps|worker|evaluator (or a config whose "
            f"task.type is one of them; got {role!r})"
        )
    index = index or 0
    port = args.port
    if spec is not None and role != "evaluator":
        _, spec_port = parse_address(spec.task_address(role, index))
        port = spec_port if port is None else port
    exit_on_shutdown = args.exit_on_shutdown if args.exit_on_shutdown is not None else bool(args.slurm_jobs)
    return ServeConfig(
        role=role,
        index=index,
        spec=spec,
        host=host or "127.0.0.1",
        port=port or 0,
        token=read_token(environ, args.token_file) if role != "evaluator" else None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        max_body=args.max_body or DEFAULT_MAX_BODY,
        metrics_public=args.metrics_public,
        exit_on_shutdown=exit_on_shutdown,
        listen_fd=args.listen_fd,
        ps=PsLimits(
            allow_pickle=not args.no_pickle,
            checkpoint_root=args.checkpoint_root,
            max_variable_bytes=args.max_variable_bytes,
            max_reply_bytes=args.max_reply_bytes,
            max_store_bytes=args.max_store_bytes,
            memory_budget=int(args.memory_budget) if args.memory_budget else None,
            table_dir=args.table_dir,
        ),
        closure_threads=args.closure_threads,
        keep_freed=(DEFAULT_KEEP if role == "worker" else 0) if args.keep_freed is None else args.keep_freed,
        join=args.join,
        advertise=args.advertise,
        drain_timeout=args.drain_timeout,
        exit_with_parent=args.exit_with_parent,
        log_level=args.log_level,
        evaluator=EvaluatorConfig(args.checkpoint_dir, args.eval_script, args.max_evaluations),
        threads_sized=getattr(args, "threads_sized", None),
        cpus_pinned=getattr(args, "cpus_pinned", None),
    )


def serve(args: argparse.Namespace) -> int:
    parent = os.getppid()  # now, before the parent has any chance to be gone
    _raise_open_files_limit()
    if args.exit_with_parent and parent == 1:
        return 0  # started by a process that has already died
    config = serve_config(args, os.environ)
    from .._transport.bridge import run
    from .._transport.interrupt import GRACE_S
    from ..server import Server
    from .common import evaluate, leave, setup_logging
    from .joining import follow, incarnation, join_as

    role, index, token = config.role, config.index, config.token
    setup_logging(config.log_level, f"{role}:{index}")
    bounded = one_heap(config.ps.memory_budget) if role == "ps" and config.ps.memory_budget else None
    for said in (config.threads_sized, config.cpus_pinned, keep_freed(config.keep_freed), bounded):
        if said:
            logger.info("%s:%d: %s", role, index, said)
    if role == "evaluator":
        return evaluate(config.evaluator)
    server: Any = Server(config).impl
    if not token:
        logger.warning(
            "no cluster token set: any local process can use this server (set PSTRAIN_TOKEN or --token-file)"
        )

    interrupts: list[str] = []  # what a Ctrl-C left, said in one line at the end

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        term = asyncio.Event()  # SIGTERM (drain a worker first)
        forced = asyncio.Event()  # a second Ctrl-C: stop now

        def on_term() -> None:
            term.set()
            stop.set()

        def on_int() -> None:  # Ctrl-C: a worker finishes what runs (a few seconds at most)
            (forced if interrupts else stop).set()
            interrupts.append("")

        loop.add_signal_handler(signal.SIGTERM, on_term)
        loop.add_signal_handler(signal.SIGINT, on_int)  # before announcing: a signal stops cleanly
        if config.join:
            server.answers_any_index = True  # until the coordinator gives it its index
        address = await server.start()
        print(f"pstrain {role}:{index} listening on {address}", flush=True)
        watchers = TaskOwner("pstrain serve")
        if config.join:  # and again whenever another coordinator serves there (restarted)
            rejoin = join_as(role, server, config.join, config.advertise or address, token)
            joined = await incarnation(config.join, token)  # before: one started since is joined too
            given = await rejoin()
            print(f"pstrain {role} joined {config.join} as {role} {given}", flush=True)
            watchers.spawn(follow(role, config.join, token, joined, rejoin))
        if config.exit_with_parent:
            watchers.spawn(_watch_parent(parent, stop))
        watchers.spawn(_on_event(server.shutdown_requested, stop))
        await stop.wait()
        if role == "worker" and (term.is_set() or interrupts):  # hand work back, then go
            running = server.begin_drain()
            limit = min(config.drain_timeout, GRACE_S) if interrupts else config.drain_timeout
            waits = [asyncio.ensure_future(server.drained(limit)), asyncio.ensure_future(forced.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            done = waits[0].done() and waits[0].result()
            for w in waits:
                w.cancel()
            if not done:
                logger.warning("closures still running after %g s of draining; leaving anyway", limit)
            if interrupts:
                interrupts[0] = (
                    f"the {running} closure(s) in flight finished"
                    if done
                    else f"of {running} closure(s) in flight, some were abandoned after {limit:g} s"
                )
        if role == "ps" and config.join and term.is_set():  # a preemption notice: move away first
            await leave(config.join, server.index, token, config.drain_timeout)
        logger.info("signal received, stopping")
        await watchers.close()
        await server.stop()

    run(main())
    if interrupts:
        said = interrupts[0] or (
            "stopped; its variables live until the process ends: the coordinator's checkpoints keep them"
            if role == "ps"
            else "stopped"
        )
        now = getattr(server, "index", index)  # a ps that joined: the index it was given
        print(f"pstrain {role}:{now}: interrupted (Ctrl-C): {said}", file=sys.stderr, flush=True)
        return 130
    return 0


async def _on_event(event: asyncio.Event, stop: asyncio.Event) -> None:
    await event.wait()
    stop.set()


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    """Stop when the parent goes away (it may have been SIGKILLed and cannot clean up)."""
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    logger.warning("parent process %d is gone, stopping", parent)
    stop.set()
