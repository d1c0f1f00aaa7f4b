"""What the ``pstrain`` subcommands share: logging, the coordinator's endpoint (joins,
membership), and the evaluator role."""

from __future__ import annotations

import logging
import sys
from typing import Any

from .._base.cluster import task_name
from .._base.errors import PstrainError
from .._formats.messages.operations import Join, JoinPs, LeavePs, Membership
from .._formats.messages.records import Operation, R
from .._transport.bridge import run
from .._transport.channels import Channel
from ..server.config import EvaluatorConfig

__all__ = ["coordinator_call", "evaluate", "join", "leave", "membership", "retag_logging", "setup_logging"]


class _Tag(logging.Filter):
    """Puts the task's current name into each record (a ps that joined is renamed)."""

    tag = ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.pstrain_task = self.tag
        return True


_TAG = _Tag()


def setup_logging(level: str, tag: str) -> None:
    _TAG.tag = tag
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s [%(pstrain_task)s] %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_TAG)


def retag_logging(tag: str) -> None:
    """The task's log lines say ``tag`` from now on (a ps that joined, under its index)."""
    _TAG.tag = tag


async def coordinator_call(
    coordinator: str, message: Operation[R], token: str | None, timeout: float = 10.0
) -> R:
    """``message`` to the coordinator's endpoint (a server like the others: the stream, with
    the cluster token proved both ways)."""
    channel = Channel(coordinator, token=token, task=task_name("chief", 0), connect_timeout=timeout)
    try:
        return await channel.request(message, timeout=timeout)
    finally:
        await channel.close()


async def membership(
    coordinator: str, token: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The worker slots of the job whose coordinator serves at ``coordinator``, and its
    placement map (the ps and their shares, the move under way)."""
    reply = await coordinator_call(coordinator, Membership(), token)
    return reply.workers, reply.ps


async def join(
    coordinator: str, address: str, token: str | None, *, ps: bool = False, index: int | None = None
) -> int:
    """Ask the coordinator at ``coordinator`` for a worker slot (``ps``: a ps index; with
    ``index``, the ps that took it joins); returns its index."""
    message = JoinPs(address=address, index=index) if ps else Join(address=address)
    try:
        reply = await coordinator_call(coordinator, message, token, timeout=30.0)
    except PstrainError as exc:
        raise PstrainError(f"joining {coordinator} failed: {type(exc).__name__}: {exc}") from exc
    return int(reply.index)


async def leave(coordinator: str, index: int, token: str | None, timeout: float) -> None:
    """Ask the coordinator to move ps ``index``'s variables to the other ps, and wait for it
    (up to ``timeout``); a failure is logged: the ps leaves anyway."""
    try:
        await coordinator_call(coordinator, LeavePs(index=index), token, timeout=timeout)
        logging.getLogger(__name__).info("ps %d drained: its variables moved to the other ps", index)
    except PstrainError as exc:
        logging.getLogger(__name__).error(
            "ps %d could not drain within %g s (%s: %s); leaving anyway",
            index,
            timeout,
            type(exc).__name__,
            exc,
        )


def evaluate(config: EvaluatorConfig) -> int:
    import runpy

    from .._checkpoint.evaluator import SidecarEvaluator  # numpy and safetensors: only for this role

    if not config.checkpoint_dir or not config.eval_script:
        raise PstrainError("the evaluator needs --checkpoint-dir and --eval-script")
    namespace = runpy.run_path(config.eval_script)
    if not callable(namespace.get("evaluate")):
        raise PstrainError(f"{config.eval_script} must define evaluate(variables, iterations)")
    evaluator = SidecarEvaluator(
        namespace["evaluate"], config.checkpoint_dir, max_evaluations=config.max_evaluations
    )
    print(f"pstrain evaluator watching {config.checkpoint_dir}", flush=True)
    for path, iterations, result in run(evaluator.run()):
        print(f"{path} iterations={iterations} {result}", flush=True)
    return 0
