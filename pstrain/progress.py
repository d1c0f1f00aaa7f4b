"""Progress bars for long work: tqdm when on a terminal, silent otherwise.

::

    with Progress(1000, "steps") as bar:
        await bar.track(remote_values, coordinator)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A tqdm bar (off when stderr is not a TTY or ``quiet``) that can follow RemoteValues."""

    def __init__(self, total: int, desc: str, *, quiet: bool = False, unit: str = "step") -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            dynamic_ncols=True,
            leave=True,
            disable=quiet or not sys.stderr.isatty(),
        )

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.bar.update(n)
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    async def track(self, remote_values: Sequence[Any], coordinator: Any, postfix: Any = None) -> None:
        """Advance as each RemoteValue resolves, then ``join()`` (which raises the first error).

        ``postfix(value)`` may return a dict shown beside the bar (e.g. the loss).
        """
        for rv in remote_values:
            try:
                value = await rv
            except Exception:
                break  # join() below raises the error that started it
            self.bar.update(1)
            if postfix is not None and self.bar.n % 20 == 0:
                self.bar.set_postfix(postfix(value), refresh=False)
        await coordinator.join()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
