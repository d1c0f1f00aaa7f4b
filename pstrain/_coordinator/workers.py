"""The coordinator's workers: one dispatcher per slot, joins, and the fences of lost ones.

The slots' lifecycle is the sans-I/O :class:`~pstrain._coordinator.membership.Membership`;
each :class:`~pstrain._coordinator.dispatch.WorkerDispatcher` drives its slot. This module
holds them together: a worker started with ``pstrain serve --role worker --join`` takes a
vacant slot or grows the cluster, and a slot's lost dispatches are fenced on every ps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .._base.cluster import ClusterSpec, parse_address
from .._base.tags import cause
from .._distribute.strategy import ParameterServerStrategy
from .._formats.messages.operations import Fence
from .._transport.channels import Channel, ChannelPool
from .dispatch import DispatchSettings, WorkerDispatcher
from .membership import Membership
from .resources import ResourceRegistry
from .scheduling import ClosureQueue

logger = logging.getLogger(__name__)

__all__ = ["Workers"]


class Workers:
    """The worker slots of one coordinator and their dispatchers."""

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        queue: ClosureQueue,
        resources: ResourceRegistry,
        settings: DispatchSettings,
        *,
        tasks: Any,
        ps_timeout_s: float,
        on_scalars: Callable[[list[Any]], None],
    ) -> None:
        self.strategy = strategy
        self.channels: ChannelPool = strategy.channels
        self.queue = queue
        self.resources = resources
        self.settings = settings
        self.tasks = tasks
        self.ps_timeout_s = ps_timeout_s
        self.on_scalars = on_scalars
        spec = self.channels.cluster_spec
        #: The worker slots and their lifecycle (sans-I/O); each dispatcher drives its slot.
        self.slots = Membership(spec.job_tasks("worker"))
        self.dispatchers = [self._dispatcher(slot.index, spec) for slot in self.slots]
        self.started = False
        self._admitting = asyncio.Lock()

    def start(self, spawn: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self.started = True
        for w in self.dispatchers:
            spawn(w.run())

    async def fence(self, worker: int, epoch: int) -> None:
        """Every ps refuses ``worker``'s updates from dispatches before ``epoch`` (a restore
        sends it again first: a ps that restarted has lost it)."""
        owner = self.strategy.placement.owner
        logger.info(
            "fencing worker %d's dispatches before %d off every ps (cause=%s)",
            worker,
            epoch,
            cause(worker, epoch - 1),
        )
        self.channels.session.fences[worker] = max(self.channels.session.fences.get(worker, 0), epoch)
        await asyncio.gather(
            *(
                self.channels.channel("ps", k).request(
                    Fence(worker=worker, epoch=epoch, owner=owner), timeout=self.ps_timeout_s
                )
                for k in self.channels.session.routes.active()
            )
        )

    async def fence_stragglers(self) -> None:
        """After the job's error, closures still running past ``cancel_grace_s`` (their
        RemoteValues raised CancelledError) have their dispatch fenced off every ps: an
        update they send later, after the job restored a checkpoint say, is refused. The
        worker cancels them when the next batch, under the new epoch, reaches it."""

        async def fence(d: WorkerDispatcher, epoch: int) -> None:
            logger.warning(
                "%s: %d closure(s) still run after the job's error and the cancel "
                "grace; their updates are refused from now on",
                d.task,
                d.in_flight,
            )
            try:
                await self.fence(d.index, epoch)
            except Exception as err:  # a ps we cannot reach cannot take their updates either
                logger.warning("could not fence %s off every ps: %s", d.task, err)

        await asyncio.gather(
            *(fence(d, epoch) for d in self.dispatchers if (epoch := d.slot.give_up(d.in_flight)) is not None)
        )

    async def admit(self, address: str) -> int:
        """A worker joins at ``address``: it takes the first slot whose worker is gone, or
        the cluster grows by one worker. Returns the worker's index. A joiner that does not
        answer there as a pstrain worker of this job (nothing listens, another server, a
        wrong token) is refused, and the job's workers stay as they were."""
        parse_address(address)  # InvalidArgumentError for a bad one
        async with self._admitting:  # one join at a time: the slot checked is the slot taken
            slot = self.slots.slot_for(address)
            if slot is not None and slot.up:  # the worker asking again (a reply lost, say)
                return slot.index
            await self.channels.answers(
                address,
                "worker",
                len(self.dispatchers) if slot is None else slot.index,
                self.settings.worker_timeout_s,
                otherwise="so it did not join (the job's workers are unchanged)",
            )
            return await self._take(address)

    async def _take(self, address: str) -> int:
        slot, grew = self.slots.admit(address)
        spec = self.channels.cluster_spec.as_dict()
        spec["worker"] = self.slots.addresses()
        new_spec = ClusterSpec(spec)
        self.channels.cluster_spec = new_spec
        for w in self.dispatchers:
            w.cluster_spec = new_spec
        if grew:
            index = self.resources.add_worker()
            assert index == slot.index, (index, slot.index)
            w = self._dispatcher(index, new_spec)
            self.dispatchers.append(w)
            self.strategy.worker_joined()
            if self.started:
                self.tasks.spawn(w.run())
            logger.info(
                "%s joined at %s (the cluster grew to %d workers)", w.task, address, len(self.dispatchers)
            )
        else:
            w = self.dispatchers[slot.index]
            await self.channels.forget("worker", slot.index)
            logger.info("%s is now at %s (joined)", w.task, address)
        w.wake_probe()
        return slot.index

    def _dispatcher(self, index: int, spec: ClusterSpec) -> WorkerDispatcher:
        placement = self.strategy.placement
        pool = self.channels

        def channel() -> Channel:
            return pool.channel("worker", index)

        return WorkerDispatcher(
            self.slots.slot(index),
            self.queue,
            self.resources,
            channel,
            spec,
            self.tasks,
            self.settings,
            before_send=placement.creations_to_send,
            fence=self.fence,
            on_scalars=self.on_scalars,
            owner=placement.owner,
            peers=self.slots.up,
            routes=lambda: pool.session.routes,
        )
