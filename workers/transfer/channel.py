"""The KV transfer channel between a prefill worker and a decode worker.

Lifecycle of one transfer (prefill P sends blocks of request R to decode D)::

    D: KVReceiver(...)               hosts the rendezvous store on its serving interface
    D: h = receiver.expect(R, layout, block_ids, destination)        h: PENDING
    P: s = sender.send(D.address, R, block_ids, kv)                  s: PENDING
         first send to D only: join (a new pair id, its own 2-rank process group:
         rank 0 = P, rank 1 = D; gloo on CPU pinned to the host, NCCL on CUDA)
    P: offer = header + block ids, pushed on D's inbox queue in the store
    D: the inbox thread pops it, matches R's reservation (an offer that comes first
       waits for it, at most offer_timeout_s); a receive thread checks layout, dtype,
       count, block ids and size BEFORE posting any receive, and refuses on any
       mismatch (P: FAILED, D: FAILED, destination untouched)
    D: accept (compare_set on the transfer's decision key, then a note on the pair's
       reply queue) and post the first receives                       h: RECEIVING
    P: woken by the note, reads the accept                           s: SENDING
    P: payload messages over the pair's process group, one gloo tag per message
    D: each message lands in a channel buffer and is scattered into the destination
       (staged), or lands in the destination itself when the target blocks form long
       runs (direct: one message per layer, K/V and run; no second copy)
                                                                     h, s: DONE
    Any timeout or broken connection: FAILED / TIMED_OUT with the reason, the pair is
    closed, and the next send to D opens a new one.

An early offer (``KVSender.offer_paged``, how a prefill worker offers by default) runs
the same steps in another order: the offer and accept while the prefill's step still
computes the KV (the header's checksum slot empty, its trailer flag set); then each
payload message as soon as its layers are computed (the forward says so, layer by
layer) or at ``go``; then a trailer message with the checksum, or saying the payload is
void (the request ended without its KV: CANCELLED on both ends, the pair in step).

Why the header does not ride on gloo: a gloo receive that times out closes the whole
pair, and a message larger than the posted buffer aborts the process. So the control
path (offers, decisions) uses the store, whose waits time out harmlessly and whose
compare_set gives the accept-versus-sender-timeout race a single winner; gloo only ever
carries payload whose size both ends have already agreed on.

The channel writes into reserved blocks; it never allocates or frees them. A terminal
state is the caller's cue to free (FAILED, TIMED_OUT) or commit (DONE) them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from common.cost_model import KV_OFFERS as _KV_OFFERS
from workers.transfer.rendezvous import check_host

FAULT_FLIP_ENV = "PDSERVE_FAULT_FLIP_KV_BYTE"
"""Fault injection for the chaos harness and tests: ``TransferConfig.fault_flip_kv_byte``
of a prefill worker's sender (:func:`fault_hooks_from_env`)."""


KV_OFFERS = _KV_OFFERS
"""When a prefill worker offers a prompt's KV (``TransferConfig.offer``; the cost
model's list, :data:`common.cost_model.KV_OFFERS`)."""


class ChannelError(RuntimeError):
    """A pair could not be opened or broke; the message says which pair and why."""


@dataclass(frozen=True)
class TransferConfig:
    """One endpoint's settings; the same defaults serve both ends.

    ``host`` is the interface the endpoint serves on (the store and the gloo devices
    bind it; never all interfaces). Timeouts bound every blocking call:
    ``connect_timeout_s`` opening a pair, ``offer_timeout_s`` a sender waiting for an
    accept (default, per send) and a receiver keeping an offer nobody reserved for,
    ``data_timeout_s`` each payload message, ``expect_timeout_s`` a reservation waiting
    for its offer (default, per expect). ``offer`` (a prefill worker's, one of
    :data:`KV_OFFERS`): ``layers`` offers each request's KV while the step that computes
    it runs (:meth:`KVSender.offer_paged`) and sends each layer's KV as the forward
    finishes it; ``step`` offers early too but sends when the step ends; ``after`` offers
    once it ended. An accepted early offer waits at most ``early_go_timeout_s`` for its
    KV (the receiver's first payload message and its trailer wait that much longer than
    ``data_timeout_s``; the messages between, a layer's compute apart, do not).
    ``chunk_bytes`` sizes staged messages (sender);
    a receiver takes the direct framing when its messages average ``direct_min_bytes``.

    ``auth_key`` (the cluster key, 32 bytes from the cluster secret): joins, offers and
    byes must carry a MAC under it, fresh within ``auth_max_skew_s`` and never replayed
    (at most ``auth_max_nonces`` remembered), and the decode side's accepts carry one
    too (:mod:`workers.transfer.auth`); None: unauthenticated, as any store client
    could then open a pair and offer KV. Both ends must agree. Decode-side bounds:
    ``max_pairs`` pairs open (at the bound a join replaces the pair idle longest, or is
    refused while all are busy), ``max_parked_offers`` offers waiting for their
    reservation, ``max_reservations`` reservations waiting for KV (``expect`` raises
    beyond: the caller computes the prompt itself).

    ``fault_drop_midway`` is fault injection for tests: a sender stops every transfer
    whose request id contains it after half its payload and closes the pair, as a link
    that dies mid-transfer would. ``fault_flip_kv_byte`` likewise: a sender flips one
    byte of the payload of every transfer whose request id contains it, on the wire
    only and after the payload checksum was taken, as memory or a link that corrupts a
    byte would; the decode side must catch it. Empty (the default) disables either; no
    message on the network can set them, only the worker's environment
    (``PDSERVE_FAULT_DROP_TRANSFER``, :data:`FAULT_FLIP_ENV`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    connect_timeout_s: float = 10.0
    offer_timeout_s: float = 10.0
    data_timeout_s: float = 30.0
    expect_timeout_s: float = 60.0
    offer: str = "layers"
    early_go_timeout_s: float = 60.0
    chunk_bytes: int = 8 << 20
    direct_min_bytes: int = 256 << 10
    recv_window: int = 4
    staging_pool_bytes: int = 256 << 20
    max_inflight_per_pair: int = 4
    max_payload_bytes: int = 16 << 30
    housekeeping_interval_s: float = 0.05
    idle_wait_s: float = 600.0
    auth_key: bytes | None = field(default=None, repr=False)
    auth_max_skew_s: float = 30.0
    auth_max_nonces: int = 65536
    max_pairs: int = 256
    max_parked_offers: int = 1024
    max_reservations: int = 4096
    fault_drop_midway: str = ""
    fault_flip_kv_byte: str = ""

    def __post_init__(self) -> None:
        check_host(self.host)
        if self.offer not in KV_OFFERS:
            raise ValueError(f"TransferConfig.offer {self.offer!r}: choose from "
                             f"{', '.join(KV_OFFERS)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"TransferConfig.port {self.port} outside [0, 65536)")
        for name in ("connect_timeout_s", "offer_timeout_s", "data_timeout_s",
                     "expect_timeout_s", "early_go_timeout_s", "housekeeping_interval_s",
                     "idle_wait_s",
                     "auth_max_skew_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0")
        if self.staging_pool_bytes < 0:
            raise ValueError("TransferConfig.staging_pool_bytes must be >= 0")
        for name in ("chunk_bytes", "direct_min_bytes", "recv_window",
                     "max_inflight_per_pair", "max_payload_bytes", "auth_max_nonces",
                     "max_pairs", "max_parked_offers", "max_reservations"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransferConfig.{name} must be >= 1")
        if self.auth_key is not None and len(self.auth_key) < 16:
            raise ValueError("TransferConfig.auth_key must have at least 16 bytes")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"TransferConfig.device must be 'cpu' or 'cuda[:N]', "
                             f"got {self.device!r}")

    @property
    def backend(self) -> str:
        """NCCL when this endpoint's KV lives on CUDA and NCCL is built in, else gloo."""
        if self.device.startswith("cuda") and dist.is_nccl_available():
            return "nccl"
        return "gloo"

    @property
    def wire_device(self) -> str:
        """Where payload buffers live: on the GPU for NCCL, in host memory for gloo."""
        return self.device if self.backend == "nccl" else "cpu"

    @property
    def pair_concurrency(self) -> int:
        """NCCL ignores tags and matches point-to-point calls in order, so a NCCL pair
        carries one payload at a time; gloo's tags let several interleave."""
        return 1 if self.backend == "nccl" else self.max_inflight_per_pair


def fault_hooks_from_env(config: TransferConfig,
                         environ: Mapping[str, str] = os.environ) -> TransferConfig:
    """``config`` with ``fault_flip_kv_byte`` from :data:`FAULT_FLIP_ENV` when that is set
    and the config names none. ``pdserve worker``'s command line reads it, at the edge
    beside ``PDSERVE_FAULT_DROP_TRANSFER`` (``cluster/cli/component.py``): every
    launcher (plain processes, Ray actors) runs that command line."""
    mark = environ.get(FAULT_FLIP_ENV, "")
    if not mark or config.fault_flip_kv_byte:
        return config
    return dataclasses.replace(config, fault_flip_kv_byte=mark)
