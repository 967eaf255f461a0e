"""KV transfer between prefill and decode workers over torch.distributed.

A decode worker runs one :class:`KVReceiver` (it hosts the rendezvous store) and
reserves each incoming request with ``expect``; a prefill worker runs one
:class:`KVSender` and ``send``s the blocks the decode worker lacks (or offers them
early, while the step that computes them runs: ``offer_paged``). The first send to a
decode worker opens their pair: a 2-rank process group of its own (gloo on CPU, NCCL on
CUDA), so pairs come and go without touching anyone else. Both ends get a
:class:`TransferHandle` that moves PENDING -> SENDING/RECEIVING -> DONE | FAILED |
TIMED_OUT; see :mod:`workers.transfer.channel` for the full lifecycle and
:mod:`workers.transfer.header` for the wire format (no pickle anywhere).
"""

from workers.transfer.blocks import (
    KVDestination,
    PagedCacheDestination,
    TensorDestination,
    gather_blocks,
    scatter_blocks,
)
from workers.transfer.channel import ChannelError, TransferConfig
from workers.transfer.header import HeaderError, KVLayout, TransferHeader, request_id64
from workers.transfer.receiver import KVReceiver
from workers.transfer.sender import EarlyOffer, KVSender
from workers.transfer.state import (
    ChannelStats,
    TransferHandle,
    TransferResult,
    TransferState,
)

__all__ = [
    "ChannelError",
    "ChannelStats",
    "EarlyOffer",
    "HeaderError",
    "KVDestination",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "PagedCacheDestination",
    "TensorDestination",
    "TransferConfig",
    "TransferHandle",
    "TransferHeader",
    "TransferResult",
    "TransferState",
    "gather_blocks",
    "request_id64",
    "scatter_blocks",
]
