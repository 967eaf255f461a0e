"""A worker's role and its end of the KV channel, and changing the role in place.

One worker program, three roles (DESIGN.md): a ``prefill`` worker holds a
:class:`KVSender`, a ``decode`` worker a :class:`KVReceiver` (and the engine loop
registers its reservations with it), a ``mixed`` one neither. :func:`open_end` builds a
role's end; :func:`channel_ends` builds the engine loop with the starting role's.

Changing the role (``SetRole``; :class:`RoleSwitch`), one change at a time (a second
one meanwhile is refused FAILED_PRECONDITION). The engine, its weights and its KV cache,
prefix cache included, stay; only the channel end and what names the role change:

1. check the role (INVALID_ARGUMENT, naming the roles); the role it has: answered at once;
2. step out of the registry (:meth:`Presence.step_out`): routers stop choosing this
   worker within their discovery interval;
3. drain what the old role's channel end carries, at most the drain timeout
   (:func:`wait_idle`); requests it does not carry run on in the new role (``Generate``
   and a decode's tokens need no channel end):

   - ``mixed``: it has no end, nothing to drain: the change takes milliseconds;
   - ``decode``: serve what was routed here for ``drain_grace_s``, then wait until no
     reservation waits for its KV and nothing is in transfer; the sequences decoding
     go on;
   - ``prefill``: as SIGTERM's drain: the grace, then until nothing runs, waits or is in
     transfer (a prompt computing here sends its KV through the old end).

   On timeout it steps back in with the old role and answers FAILED_PRECONDITION: a
   role change never aborts a request. (Before 2026-12-05 every role drained whole: a
   2-core Xeon's headline runs spent 5-11 s a switch of two changes);
4. open the new role's end (a receiver on a fresh port for decode); if it cannot open,
   step back in with the old role, UNAVAILABLE;
5. swap, with no await in between (no call runs meanwhile): the servicer's ends and
   config (``GetLoad`` says the new role), the engine loop's reservation hooks, the
   heartbeat's :class:`WorkerInfo` (role, ``kv_address``), the metrics' ``role`` label;
6. close the old end (its pairs are told; prefill workers open new pairs to the new
   receiver), step back in (a new epoch: the prefix index gets the whole cache again),
   count ``worker_role_changes_total{from_role,to_role}``, log the reason, answer.

A caller that hangs up (its deadline passed) does not stop a change half way, out of
the registry: it runs on to its end, bounded by the drain timeout.

Stragglers (a router that missed the departure) are served in the role they find, and
none is lost: a ``Prefill`` on a worker no longer prefill is refused and the decode
worker computes the prompt; a ``Decode`` on one no longer decode is refused
FAILED_PRECONDITION and the router reserves on another (one let in just before the change
reserves locally: computed here); a reservation placed with the old receiver just
before it closed is computed here. ``Generate`` works in every role.

Trust: ``SetRole`` is a call of the internal ``Worker`` service like ``Prefill`` and
``Decode``, on the same listener: with ``--cluster-tls-dir`` only clients holding a
certificate of the cluster CA reach it (mutual TLS); without, whoever reaches the
worker's port may call it, as every other worker call: keep that port private.

Runs on the server's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from common.cost_model import StepSums
from common.metrics import Metrics
from common.registry import ROLES, WorkerInfo

from .engine_commands import KVExpect
from .engine_loop import EngineLoop
from .kv_targets import KVTargets
from .presence import Presence
from .transfer import ChannelStats, KVLayout, KVReceiver, KVSender, PagedCacheDestination

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .engine.llm_engine import LLMEngine


class UsesEnds(Protocol):
    """What a role change needs of the gRPC servicer (:class:`workers.server.
    WorkerServicer`): to take the new role's ends at once."""

    def use(self, config: WorkerConfig, sender: KVSender | None, receiver: KVReceiver | None,
            targets: KVTargets | None) -> None: ...

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelEnd:
    """A role's end of the KV channel: a sender (prefill), a receiver and the engine
    loop's hook into it (decode), or nothing (mixed)."""

    role: str
    sender: KVSender | None = None
    receiver: KVReceiver | None = None
    expect: KVExpect | None = None

    @property
    def kv_address(self) -> str:
        """Where prefill workers send KV (decode); empty otherwise."""
        return self.receiver.address if self.receiver is not None else ""

    def stats(self) -> ChannelStats | None:
        end = self.sender or self.receiver
        return end.stats() if end is not None else None

    def close(self) -> None:
        """Blocks while the pairs close (seconds at most)."""
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


def open_end(config: WorkerConfig, role: str, engine: Callable[[], LLMEngine]) -> ChannelEnd:
    """``role``'s end; ``engine()`` gives the engine once it exists (decode: the
    receiver lands KV in its paged cache). A receiver binds a port: blocks briefly."""
    name = f"{role}@{config.host}:{config.port}"
    if role == "prefill":
        return ChannelEnd(role, sender=KVSender(name, config.transfer))
    if role != "decode":
        return ChannelEnd(role)
    receiver = KVReceiver(name, config.transfer)
    layout: list[KVLayout] = []  # the cache's, at the first reservation

    def expect(request_id: str, block_ids: list[int]):  # noqa: ANN202 - TransferHandle
        kv = engine().kv_view()
        if not layout:
            layout.append(KVLayout.of_cache(kv.cache, kv.block_size, kv.kv_format,
                                            kv.kv_digest))
        return receiver.expect(request_id, layout[0], block_ids,
                               PagedCacheDestination(kv.cache, block_ids, kv.block_size),
                               timeout_s=config.reservation_timeout_s)

    return ChannelEnd(role, receiver=receiver, expect=expect)


def channel_ends(config: WorkerConfig, build: Callable[[], LLMEngine],
                 step_listener: Callable[[float, float, StepSums], None] | None = None
                 ) -> tuple[EngineLoop, ChannelEnd]:
    """The engine loop (its engine built by ``build`` on the engine thread; each step's
    sums to ``step_listener``, see :class:`EngineLoop`) with the starting role's end of
    the KV channel wired in."""
    end = open_end(config, config.role, lambda: loop.engine)
    try:
        loop = EngineLoop(build, end.expect, end.kv_address, config.transfer.offer_timeout_s,
                          config.step_trace, step_listener)
    except BaseException:
        end.close()
        raise
    return loop, end


async def wait_idle(loop: EngineLoop, in_transfer: Callable[[], int], grace_s: float,
                    timeout_s: float, channel_only: bool = False) -> float | None:
    """Wait until nothing runs, waits, is reserved or is in transfer (``in_transfer()``
    transfers of the channel end), and at least ``grace_s`` passed (requests routed
    before routers saw this worker leave may still come). ``channel_only``: only what
    is reserved or in transfer (what runs and waits goes on). Seconds it took; None when
    ``timeout_s`` passed first."""
    def idle() -> bool:
        load = loop.load()
        return not (load.reserved or in_transfer()
                    or (not channel_only and (load.running or load.waiting)))

    started = time.monotonic()
    while (took := time.monotonic() - started) < timeout_s:
        drained = idle()
        if drained and took >= grace_s and channel_only:
            # A reserve let in just before is queued, not counted yet: once the engine
            # took it, a placed one is registered with the receiver (in transfer); one
            # waiting for room may not show until the next step, and runs locally
            # after the swap.
            try:
                await asyncio.wait_for(loop.barrier(), timeout_s - took)
            except asyncio.TimeoutError:  # Python 3.10: not the builtin TimeoutError
                return None
            drained = idle()
        if drained and took >= grace_s:
            return took
        await asyncio.sleep(0.1)
    return None


class RoleChangeError(Exception):
    """Why ``SetRole`` did not change the role; ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RoleChanged:
    role: str
    previous_role: str
    drained_s: float
    kv_address: str
    prefill_cap: int = 0
    """The engine's stall-free cap after the call (0: none)."""


class RoleSwitch:
    """The worker's current role and channel end; :meth:`change` changes them (see the
    module docstring). ``info``: the registry entry the heartbeat keeps (with
    ``presence``); ``metrics``: its ``role`` label follows the role."""

    def __init__(self, config: WorkerConfig, loop: EngineLoop, end: ChannelEnd,
                 servicer: UsesEnds, presence: Presence | None = None,
                 info: WorkerInfo | None = None, metrics: Metrics | None = None,
                 targets: KVTargets | None = None) -> None:
        self.config, self.end = config, end
        self._loop, self._servicer, self._presence = loop, servicer, presence
        self.info, self._metrics, self._targets = info, metrics, targets
        self._changing: str | None = None  # the role a change under way goes to
        self._closed = False
        self.prefill_cap = config.engine.prefill_tokens_while_decoding
        """The engine's stall-free cap (``SetRole`` may set it, with or without a new
        role)."""

    @property
    def role(self) -> str:
        return self.end.role

    async def change(self, role: str, reason: str = "",
                     drain_timeout_s: float | None = None,
                     prefill_cap: int | None = None) -> RoleChanged:
        """Change to ``role``; raises :class:`RoleChangeError`. Waits for the drain.
        ``prefill_cap``: the engine's stall-free cap from its next step on, set once the
        call is accepted (a valid role, no other change under way), whatever the change
        then does (None: kept); a refused call sets nothing."""
        old = self.role
        role = role or old  # "": keep the role (a call that sets only the cap)
        if role not in ROLES:
            raise RoleChangeError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"role {role[:40]!r}: want one of {', '.join(ROLES)}")
        if self._changing is not None:
            raise RoleChangeError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"a change of this worker's role ({old} -> "
                                  f"{self._changing}) is under way; ask again once it "
                                  "answered")
        if self._closed:
            raise RoleChangeError(grpc.StatusCode.FAILED_PRECONDITION,
                                  "this worker is shutting down")
        if prefill_cap is not None and prefill_cap != self.prefill_cap:
            self._loop.set_prefill_cap(prefill_cap)
            log.info("prompt tokens per step while decoding: %s -> %s (reason: %s)",
                     self.prefill_cap or "no cap", prefill_cap or "no cap",
                     reason or "none given")
            self.prefill_cap = prefill_cap
        if role == old:
            return RoleChanged(role, old, 0.0, self.end.kv_address, self.prefill_cap)
        timeout = drain_timeout_s if drain_timeout_s else self.config.drain_timeout_s
        self._changing = role
        task = asyncio.ensure_future(self._change(old, role, reason, timeout))
        task.add_done_callback(self._changed)
        # A caller that hangs up (its deadline passed) does not leave the change half
        # done, out of the registry: it runs on to its end, bounded by the drain timeout.
        return await asyncio.shield(task)

    @property
    def changing(self) -> str | None:
        """The role a change under way goes to (None: none is)."""
        return self._changing

    def _changed(self, task: asyncio.Future) -> None:
        self._changing = None
        if not task.cancelled() and task.exception() is not None:  # retrieved: no warning
            log.info("role change ended: %s", task.exception())

    async def _change(self, old: str, role: str, reason: str,
                      timeout_s: float) -> RoleChanged:
        log.info("changing role %s -> %s (reason: %s): leaving the registry and draining",
                 old, role, reason or "none given")
        if self._presence is not None:
            await self._presence.step_out()
        drained = 0.0 if old == "mixed" else await wait_idle(
            self._loop, self._in_transfer, self.config.drain_grace_s, timeout_s,
            channel_only=old == "decode")
        if drained is None:
            await self._step_in()
            load = self._loop.load()
            log.warning("role change %s -> %s: not drained within %gs; still %s", old, role,
                        timeout_s, old)
            raise RoleChangeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"could not drain within {timeout_s:g}s ({load.running} running, "
                f"{load.waiting} waiting, {load.reserved} reserved, {self._in_transfer()} "
                f"transfers): still {old}, serving on; retry later or with a longer "
                "drain_timeout_s")
        try:
            new = await asyncio.to_thread(open_end, self.config, role, lambda: self._loop.engine)
        except Exception as e:  # noqa: BLE001 - a port, a thread: keep the old role
            log.exception("could not open the %s end of the KV channel", role)
            await self._step_in()
            raise RoleChangeError(grpc.StatusCode.UNAVAILABLE,
                                  f"could not open the {role} end of the KV channel: {e}; "
                                  f"still {old}") from e
        old_end = self._swap(new)
        await asyncio.to_thread(old_end.close)
        if self._closed:  # shut down meanwhile, closing the end it had then
            await asyncio.to_thread(new.close)
        await self._step_in()
        if self._metrics is not None:
            self._metrics.inc("worker_role_changes_total", from_role=old, to_role=role)
        log.info("role changed %s -> %s after a %.1fs drain (reason: %s)", old, role, drained,
                 reason or "none given")
        return RoleChanged(role, old, drained, new.kv_address, self.prefill_cap)

    def _swap(self, new: ChannelEnd) -> ChannelEnd:
        """Everything that names the role, at once (no await: no call runs between)."""
        presence = self._presence
        if new.sender is not None and self._targets is None and presence is not None:
            self._targets = KVTargets(presence.registry.live)  # kept for later changes
        old, self.end = self.end, new
        self.config = dataclasses.replace(self.config, role=new.role)
        self._servicer.use(self.config, new.sender, new.receiver,
                           self._targets if new.sender is not None else None)
        self._loop.set_kv_receiver(new.expect, new.kv_address)
        if self.info is not None:
            self.info = dataclasses.replace(self.info, role=new.role,
                                            kv_address=new.kv_address)
        if self._metrics is not None:
            self._metrics.relabel(role=new.role)
        return old

    def _in_transfer(self) -> int:
        stats = self.end.stats()
        return stats.in_flight if stats is not None else 0

    async def _step_in(self) -> None:
        if self._presence is not None and self.info is not None and not self._closed:
            await self._presence.step_in(self.info)

    def close(self) -> None:
        """Shutting down: no more changes; closes the current end (blocks briefly)."""
        self._closed = True
        self.end.close()
