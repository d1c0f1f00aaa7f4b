"""What a server task is started with, built once: :class:`ServeConfig`.

``pstrain serve`` builds it from its flags and the environment (``PSTRAIN_CONFIG`` or
``TF_CONFIG``, ``PSTRAIN_TOKEN``, SLURM's variables: ``cli/serve.py``), and everything after
reads it: :class:`~pstrain.server.Server` takes it (``Server(config)``), and so do the
joining, draining and evaluator code of the command. Nothing past that point sees a flag.
"""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass
from typing import Any

from .._base.cluster import ClusterSpec
from .._base.errors import PstrainError
from .._transport.frames import DEFAULT_MAX_BODY

__all__ = ["EvaluatorConfig", "PsLimits", "ServeConfig", "client_ssl", "paired_tier_flags", "server_ssl"]


def paired_tier_flags(memory_budget: Any, table_dir: Any) -> None:
    """``--memory-budget`` and ``--table-dir`` come together (``pstrain serve``, ``launch``)."""
    if (memory_budget is None) != (table_dir is None):
        given, missing = (
            ("--memory-budget", "--table-dir") if table_dir is None else ("--table-dir", "--memory-budget")
        )
        raise PstrainError(
            f"{given} needs {missing}: a ps tiers its tables with both (a budget in RAM, "
            "and a directory on local disk for the rows past it)"
        )


@dataclass(frozen=True)
class PsLimits:
    """A ps's limits and what it refuses (``None``: the ps's default)."""

    allow_pickle: bool = True
    checkpoint_root: str | None = None
    max_variable_bytes: int | None = None
    max_reply_bytes: int | None = None
    max_store_bytes: int | None = None
    #: bytes the tables' rows, slots and indexes may take in RAM; the rest under ``table_dir``
    memory_budget: int | None = None
    table_dir: str | None = None

    def __post_init__(self) -> None:
        paired_tier_flags(self.memory_budget, self.table_dir)

    def options(self) -> dict[str, Any]:
        """The ``ParameterServer`` keyword arguments these set."""
        out: dict[str, Any] = {"allow_pickle": self.allow_pickle, "checkpoint_root": self.checkpoint_root}
        for name in (
            "max_variable_bytes",
            "max_reply_bytes",
            "max_store_bytes",
            "memory_budget",
            "table_dir",
        ):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class EvaluatorConfig:
    """The sidecar evaluator's: the checkpoints it watches and the script that evaluates."""

    checkpoint_dir: str | None = None
    eval_script: str | None = None
    max_evaluations: int | None = None


@dataclass(frozen=True)
class ServeConfig:
    """One task: its role and index in the cluster ``spec`` (None: none given), where it
    listens, its token and TLS files, and what each role needs."""

    role: str
    index: int = 0
    spec: ClusterSpec | None = None
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    metrics_public: bool = False
    exit_on_shutdown: bool = False
    #: a TCP socket inherited already bound (``LocalCluster`` restarts a task on its port so)
    listen_fd: int | None = None
    ps: PsLimits = dataclasses.field(default_factory=PsLimits)
    closure_threads: int = 4  # worker: threads that run plain ``def`` closures
    #: bytes of freed memory malloc keeps for the next steps (``cli/memory.py``; 0: glibc's way)
    keep_freed: int = 0
    #: a running job's coordinator endpoint to join, and the address to give it
    join: str | None = None
    advertise: str | None = None
    drain_timeout: float = 60.0
    exit_with_parent: bool = False
    log_level: str = "INFO"
    evaluator: EvaluatorConfig = dataclasses.field(default_factory=EvaluatorConfig)
    #: what the command set of the numeric libraries' thread counts (said once it logs)
    threads_sized: str | None = None
    #: the cores the command pinned the task to (``--cpus``; said once it logs)
    cpus_pinned: str | None = None

    def server_options(self) -> dict[str, Any]:
        """What every server of this task is built with."""
        return dict(
            host=self.host,
            port=self.port,
            token=self.token,
            exit_on_shutdown=self.exit_on_shutdown,
            ssl_context=server_ssl(self.tls_cert, self.tls_key),
            max_body=self.max_body,
            metrics_public=self.metrics_public,
        )


def server_ssl(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The TLS context a server listens with (None: plain TCP)."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise PstrainError("TLS needs both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise PstrainError(
            f"--tls-cert {cert} / --tls-key {key}: cannot be loaded ({exc.strerror or exc})"
        ) from None
    return ctx


def client_ssl(cafile: str | None) -> ssl.SSLContext | None:
    """A client TLS context that verifies servers against ``cafile``."""
    if not cafile:
        return None
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise PstrainError(f"--tls-ca {cafile}: cannot be loaded ({exc.strerror or exc})") from None
