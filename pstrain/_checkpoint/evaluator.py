"""SidecarEvaluator: evaluate the latest checkpoint of a running job, again and again.

It watches a checkpoint directory (as written by ``CheckpointManager``),
always evaluates the *latest* complete checkpoint (intermediate ones may be
skipped), logs the metrics with the restored ``iterations``, and stops after
``max_evaluations`` evaluations (never, when None). A checkpoint it cannot
read yet (still being written, or just deleted by ``max_to_keep``) is retried
at the next poll; a malformed one is logged and skipped, and watching goes on.
It reads the files directly: no cluster is needed.

``eval_fn(variables, iterations)`` gets the checkpoint's arrays by name and the
optimizer's step count, and returns a dict of metrics (it may be async).

::

    evaluator = SidecarEvaluator(evaluate, "/tmp/run", max_evaluations=3)
    results = await evaluator.run()

From the shell: ``pstrain serve --role evaluator --checkpoint-dir DIR
--eval-script eval.py`` (the script defines ``evaluate(variables, iterations)``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError, NotFoundError
from .._base.exports import expose
from .manager import CheckpointManager
from .offline import load_variables

logger = logging.getLogger(__name__)

__all__ = ["SidecarEvaluator"]


def restored_iterations(variables: dict[str, np.ndarray]) -> int:
    """The optimizer step count saved in a checkpoint (TF's rule: it must be there)."""
    for name, value in variables.items():
        if name == "iterations" or name.endswith("/iterations"):
            return int(value)
    raise RuntimeError(
        "`iterations` cannot be loaded from the checkpoint file: save the "
        "optimizer in the Checkpoint so the evaluator knows the step"
    )


class SidecarEvaluator:
    """Evaluates checkpoints from ``checkpoint_dir`` as they appear."""

    def __init__(
        self,
        eval_fn: Callable[..., Any],
        checkpoint_dir: str,
        *,
        checkpoint_name: str = "ckpt",
        max_evaluations: int | None = None,
        poll_interval_s: float = 1.0,
        hint_after_s: float = 30.0,
    ) -> None:
        if not callable(eval_fn):
            raise InvalidArgumentError("eval_fn must be callable: eval_fn(variables, iterations)")
        if max_evaluations is not None and max_evaluations < 1:
            raise InvalidArgumentError("max_evaluations must be positive, or None to run forever")
        self.eval_fn = eval_fn
        self.checkpoint_dir = checkpoint_dir
        self.max_evaluations = max_evaluations
        self.poll_interval_s = poll_interval_s
        self.hint_after_s = hint_after_s
        self._manager = CheckpointManager(
            None,  # type: ignore[arg-type]
            checkpoint_dir,
            max_to_keep=None,
            checkpoint_name=checkpoint_name,
        )
        self.results: list[tuple[str, int, Any]] = []

    async def evaluate(self, path: str) -> Any:
        """Evaluate one checkpoint; returns what ``eval_fn`` returned."""
        variables = await asyncio.get_running_loop().run_in_executor(None, load_variables, path)
        iterations = restored_iterations(variables)
        result = self._call(variables, iterations)
        if inspect.isawaitable(result):
            result = await result
        logger.info("evaluated %s at iterations %d: %s", path, iterations, result)
        self.results.append((path, iterations, result))
        return result

    def _call(self, variables: dict[str, np.ndarray], iterations: int) -> Any:
        """``eval_fn(variables, iterations)``, or ``eval_fn(variables)`` if it takes one argument."""
        try:
            params = inspect.signature(self.eval_fn).parameters.values()
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            takes_many = any(p.kind == p.VAR_POSITIONAL for p in params) or len(positional) >= 2
        except (TypeError, ValueError):
            takes_many = True
        return self.eval_fn(variables, iterations) if takes_many else self.eval_fn(variables)

    async def start(self) -> list[tuple[str, int, Any]]:
        """TF's name for :meth:`run`."""
        return await self.run()

    async def run(self) -> list[tuple[str, int, Any]]:
        """Poll, evaluate the latest new checkpoint each time; returns (path, iterations, metrics)."""
        last: str | None = None
        waiting_since = time.monotonic()
        while self.max_evaluations is None or len(self.results) < self.max_evaluations:
            latest = self._manager.latest_checkpoint
            if latest is not None and latest != last:
                try:
                    await self.evaluate(latest)
                    last = latest
                    waiting_since = time.monotonic()
                    continue
                except InvalidArgumentError as exc:  # malformed: it will not get better
                    logger.error("skipping checkpoint %s: %s", latest, exc)
                    last = latest
                    continue
                except (NotFoundError, OSError) as exc:  # still being written, or just deleted
                    logger.warning("could not read %s yet (%s); retrying", latest, exc)
            elif time.monotonic() - waiting_since > self.hint_after_s:
                logger.info(
                    "no new checkpoint in %s for %.0f s; still waiting",
                    self.checkpoint_dir,
                    time.monotonic() - waiting_since,
                )
                waiting_since = time.monotonic()
            await asyncio.sleep(self.poll_interval_s)
        return self.results


expose(globals(), "pstrain.evaluator")
