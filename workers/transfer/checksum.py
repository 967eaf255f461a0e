"""The KV payload checksum: xxh3_64 over the payload's bytes in canonical order.

*What is hashed.* The payload in its canonical order: plane by plane (plane ``2*layer``
is the layer's K, ``2*layer + 1`` its V), each plane's blocks in the order of the target
block ids -- the bytes of the contiguous ``[layers, 2, n, block_size, kv_heads,
head_dim]`` payload. Every framing's plan (:func:`workers.transfer.header.message_plan`)
covers that payload once, in that order (staged: runs of whole planes; direct: each
plane's runs of target ids, ascending), so one running hash fed the messages in plan
order gives the same digest whichever framing the receiver picks. The sender hashes
before it offers (it does not know the framing yet) and puts the digest in the offer's
header; the receiver hashes what landed (direct: the destination's regions; staged: each
message's buffer before it is reused) and fails the transfer on a mismatch before
anything can commit the blocks.

*Why xxh3_64* (the ``xxhash`` package: the reference xxHash C code, maintained, wheels
for every platform): it runs at memory speed. Measured on the development machine (a
2-core Xeon VM, one thread, load average ~7): 8 MiB of bf16 in cache, xxh3_64 23.5
GiB/s, xxh64 11.3, ``zlib.crc32`` 4.5, a plain copy 5.0. A SmolLM2-135M payload of
2048 tokens (45 MiB bf16 / 90 MiB fp32, out of cache): the sender's pass 70-125 us/MiB
(one tensor or one run of blocks) to 150 us/MiB (scattered blocks, 7680 pieces); the
receiver's 50-150 us/MiB; ``zlib.crc32`` 290-500 us/MiB, a copy 470-520. End to end
(bf16, 45 MiB, with and without the hash interleaved over 24 transfers on one pair)
the channel took +280-490 us/MiB, +30-40%, on that box: its ~1 GB/s leaves 1 ms/MiB,
the sender's pass runs in series before the offer, and with no idle core the
receiver's hashing (each message as it lands, while later ones are still on the wire)
is not hidden either. A crc would cost three times as much. 64 bits also let a random
corruption slip through once in 2**64, not once in 2**32. It is an integrity check
against faults (a flipped bit in memory, a torn or misframed receive), not a MAC: with
a cluster key the offer that carries it is authenticated (:mod:`workers.transfer.auth`).

NCCL payloads on a GPU are hashed through a host copy (correct, slower); a device-side
hash would be the fix there.

The module is pure: no sockets, no threads.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import xxhash

_SIGN = 1 << 63


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a uint8 array, without a copy on the CPU."""
    if not t.is_contiguous():
        raise ValueError(f"only a contiguous tensor can be hashed, got strides {t.stride()}")
    return t.detach().cpu().reshape(-1).view(torch.uint8).numpy()


def to_int64(digest: int) -> int:
    """An unsigned 64-bit digest as the signed int64 a header slot holds."""
    return digest - (1 << 64) if digest >= _SIGN else digest


class PayloadHash:
    """A running xxh3_64 of payload pieces fed in canonical order (see the module
    docstring). One per transfer; not thread-safe."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, piece: torch.Tensor | np.ndarray) -> None:
        """Add the bytes of a contiguous tensor or array (reads it; a device tensor is
        copied to the host first)."""
        self._h.update(piece if isinstance(piece, np.ndarray) else _as_bytes(piece))

    def digest(self) -> int:
        """The checksum so far, as a signed int64 (what header slot 14 carries)."""
        return to_int64(self._h.intdigest())


def payload_checksum(pieces: Iterable[torch.Tensor | np.ndarray]) -> int:
    """The checksum of a payload given as contiguous pieces in canonical order."""
    h = PayloadHash()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def flip_one_byte(t: torch.Tensor) -> torch.Tensor:
    """Fault injection only (``TransferConfig.fault_flip_kv_byte``): a copy of ``t`` with
    every bit of one byte flipped -- the most significant byte of its middle element,
    which holds sign and exponent, so the value changes beyond any rounding. ``t``
    itself (the sender's KV) is left as it is."""
    out = t.clone().contiguous()
    raw = out.view(-1).view(torch.uint8)
    size = out.element_size()
    index = (out.numel() // 2) * size + size - 1  # little-endian: the last byte is the top
    raw[index] ^= 0xFF
    return out
