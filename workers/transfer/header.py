"""The KV transfer message: a fixed-size int64 header, the target block ids, then raw KV.

An offer is ``HEADER_SLOTS`` little-endian int64 values followed by ``num_blocks``
little-endian int64 target block ids. Nothing in it executes on load: the receiver reads
integers and checks each one against what it reserved before it posts a single receive
for the payload. The payload itself is never in the offer; it travels afterwards as raw
tensor bytes, ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, seen as
``2*layers`` *planes* (one per layer and K/V) of ``num_blocks`` blocks, and cut into
messages by one of two framings that the receiver picks when it accepts
(:func:`message_plan`, computed identically on both ends):

- *staged*: ``chunk_planes`` whole planes per message (the sender's proposal, from its
  chunk size); the receiver lands each message in a buffer of its own and scatters it;
- *direct*: one message per plane and per run of consecutive target block ids; each
  message is then one contiguous slice of the paged cache, and the receiver receives
  straight into it (no second copy). Chosen when the runs make messages large enough.

Slots (int64 each)::

    0 magic<<8 | version     1 header slots (16)     2 request id (64-bit, blake2b)
    3 seq on the pair        4 pair id               5 num_blocks
    6 num_layers             7 kv (always 2)         8 block_size
    9 kv_heads              10 head_dim (row elems)  11 dtype | format << 8 | digest << 16
   12 payload bytes         13 chunk_planes (staged) 14 payload checksum
   15 checksum of slots 0..14

Slot 14 (version 2 on) is the xxh3_64 of the payload in canonical order, whichever
framing carries it (:mod:`workers.transfer.checksum`); the receiver fails a transfer
whose landed bytes hash otherwise. Slot 15 guards the header alone (FNV-1a).

Slot 11 (version 3 on) carries the KV cache format (:mod:`common.kv_cache_dtype`) above
the element dtype: a quantized cache's rows are ``uint8`` bytes (values and scales, see
:mod:`workers.models.kv_format`) and travel as stored, so ``head_dim`` is then the row's
byte count, and the format tells FP8 E4M3 rows from E5M2 rows of the same size. Its
bits 16..31 carry the 16-bit digest of the key transform a quantized cache stores keys
under (0: none): KV written under another is refused like another format.

Slot 11's bits 32..39 (version 4 on) are flags. :data:`FLAG_TRAILER` marks an *early*
offer, made while the prefill's last step still computes the KV: slot 14 is then 0, and
the checksum travels after the payload in a trailer message (:func:`encode_trailer`,
message index :data:`TRAILER_MESSAGE`) that also says whether the payload is the KV at
all: :data:`TRAILER_VOID` (the request ended without its KV, e.g. at its first token:
the payload is filler and the receiver ends the transfer CANCELLED) or
:data:`TRAILER_EXPIRED` (no decision within the sender's ``early_go_timeout_s``:
filler, TIMED_OUT). With a cluster key the trailer carries a MAC as the offer
does (:mod:`workers.transfer.auth`).

The module is pure: no sockets, no threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.kv_cache_dtype import CODE_FORMATS, FORMAT_CODES, check_kv_cache_dtype

MAGIC = 0x50444B56  # "PDKV"
VERSION = 4  # 4: flags in slot 11 (the trailer); 3: the KV cache format; 2: the checksum
HEADER_SLOTS = 16
HEADER_BYTES = HEADER_SLOTS * 8
MAX_MESSAGES = 1024  # a message index fits the low 10 bits of a gloo tag (tag_for)
TRAILER_MESSAGE = MAX_MESSAGES - 1
"""The trailer's message index; payload plans use the indices below it."""
MAX_PAYLOAD_MESSAGES = MAX_MESSAGES - 1
MAX_BLOCKS = 1 << 20
FLAG_TRAILER = 1
"""An early offer: the checksum comes in the trailer, after the payload."""
TRAILER_OK, TRAILER_VOID, TRAILER_EXPIRED = 0, 1, 2
TRAILER_BYTES = 16
"""The trailer without its MAC: the payload checksum and the status, int64 each."""

# Fixed forever: codes are on the wire. Add new dtypes at the end, never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.int8: 6,
    torch.uint8: 7,
}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}

_WIRE_INT64 = np.dtype("<i8")
_MASK64 = (1 << 64) - 1


class HeaderError(ValueError):
    """An offer that cannot be parsed. ``seq`` and ``pair_id`` are set when the header got
    far enough to name its transfer, so the receiver can refuse it instead of dropping it."""

    def __init__(self, message: str, seq: int | None = None,
                 pair_id: int | None = None) -> None:
        super().__init__(message)
        self.seq, self.pair_id = seq, pair_id


def request_id64(request_id: str) -> int:
    """A process-independent signed 64-bit id for a request id string.

    blake2b, not Python's ``hash()``: the two ends run in different processes with
    different hash seeds, and both must derive the same number.
    """
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8,
                             person=b"pdserve.kvx.v1").digest()
    return int.from_bytes(digest, "little", signed=True)


def tag_for(seq: int, message: int) -> int:
    """The gloo tag of payload message ``message`` of transfer ``seq`` on one pair.

    Distinct for every in-flight message of every transfer on the pair, so concurrent
    transfers never match each other's receives: the seq wraps after 2**20 transfers,
    far beyond how many can be in flight under the channel's timeouts. Tags lie in
    [2**30, 2**31), inside the C int that gloo takes and clear of small tags.
    """
    if not 0 <= message < MAX_MESSAGES:
        raise ValueError(f"message index {message} outside [0, {MAX_MESSAGES})")
    return (1 << 30) + ((seq & 0xFFFFF) << 10 | message)


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block of KV across every layer, as both ends must agree on it.

    ``head_dim`` is the cache row's element count: the head's dimension for ``auto``, the
    row's bytes (values and scales) for a quantized ``kv_format``."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_format: str = "auto"
    kv_digest: int = 0
    """The key transform's 16-bit digest (:meth:`workers.models.kv_format.KeyTransform.digest`)."""

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_format)
        if not 0 <= self.kv_digest < 1 << 16:
            raise ValueError(f"KVLayout.kv_digest must fit 16 bits, got {self.kv_digest}")
        for name in ("num_layers", "block_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"KVLayout.dtype {self.dtype} has no wire code; "
                             f"supported: {sorted(str(d) for d in DTYPE_CODES)}")

    @classmethod
    def of_cache(cls, cache: torch.Tensor, block_size: int, kv_format: str = "auto",
                 kv_digest: int = 0) -> KVLayout:
        """The layout of a paged cache ``[layers, 2, num_blocks*block_size, heads, row]``
        storing ``kv_format``."""
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[2] % block_size:
            raise ValueError(f"expected a cache [layers, 2, num_blocks*{block_size}, kv_heads, "
                             f"head_dim], got shape {tuple(cache.shape)}")
        return cls(cache.shape[0], block_size, cache.shape[3], cache.shape[4], cache.dtype,
                   kv_format, kv_digest)

    def describe(self) -> str:
        """The format as an error names it: ``fp8_e4m3 (uint8 rows of 65)``."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.kv_format == "auto":
            return f"{dtype} (the model's dtype; rows of {self.head_dim})"
        offsets = f", key transform #{self.kv_digest:04x}" if self.kv_digest else ""
        return f"{self.kv_format} ({dtype} rows of {self.head_dim}{offsets})"

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def num_planes(self) -> int:
        return 2 * self.num_layers

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of one block in one plane (one layer's K or V)."""
        return self.block_size * self.kv_heads * self.head_dim * self.element_size

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.kv_heads, self.head_dim)

    def payload_bytes(self, num_blocks: int) -> int:
        return self.num_planes * num_blocks * self.plane_block_bytes


@dataclass(frozen=True)
class TransferHeader:
    """What one offer announces. Built by the sender, checked by the receiver."""

    request_id64: int
    seq: int
    pair_id: int
    num_blocks: int
    layout: KVLayout
    payload_bytes: int
    chunk_planes: int
    payload_checksum: int
    """xxh3_64 of the payload in canonical order, as a signed int64; 0 in an early offer."""
    flags: int = 0
    """:data:`FLAG_TRAILER` or 0."""

    @property
    def trailer(self) -> bool:
        """Whether the checksum (and the payload's status) come after the payload."""
        return bool(self.flags & FLAG_TRAILER)

    def to_tensor(self) -> torch.Tensor:
        lay = self.layout
        slots = [
            MAGIC << 8 | VERSION, HEADER_SLOTS, self.request_id64, self.seq, self.pair_id,
            self.num_blocks, lay.num_layers, 2, lay.block_size, lay.kv_heads, lay.head_dim,
            (DTYPE_CODES[lay.dtype] | FORMAT_CODES[lay.kv_format] << 8 | lay.kv_digest << 16
             | self.flags << 32),
            self.payload_bytes,
            self.chunk_planes,
            self.payload_checksum,
        ]
        slots.append(_checksum(slots))
        return torch.tensor(slots, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TransferHeader:
        """Parse and sanity-check a header. Raises HeaderError; never trusts a size it
        has not bounded."""
        if t.dtype != torch.int64 or t.shape != (HEADER_SLOTS,):
            raise HeaderError(f"header must be int64[{HEADER_SLOTS}], got "
                              f"{t.dtype}{list(t.shape)}")
        s = [int(v) for v in t.tolist()]
        if s[0] >> 8 != MAGIC:
            raise HeaderError(f"bad magic {s[0] >> 8:#x}; not a pdserve KV offer")
        if s[1] != HEADER_SLOTS:
            raise HeaderError(f"offer version {s[0] & 0xFF} with {s[1]} slots; this "
                              f"receiver speaks version {VERSION} with {HEADER_SLOTS}")
        if s[15] != _checksum(s[:15]):
            raise HeaderError("header checksum mismatch (corrupt offer)")
        seq, pair = s[3], s[4]  # trusted from here on: errors can name the transfer
        if s[0] & 0xFF != VERSION:  # refused by name, so an older sender learns why
            raise HeaderError(f"offer version {s[0] & 0xFF}; this receiver speaks version "
                              f"{VERSION} (version 2 added the payload checksum, 3 the KV "
                              "cache format, 4 the early offer's trailer): run the same "
                              "pdserve release on prefill and decode workers", seq, pair)
        if s[7] != 2:
            raise HeaderError(f"kv={s[7]}; expected 2", seq, pair)
        dtype_code, format_code, digest = s[11] & 0xFF, s[11] >> 8 & 0xFF, s[11] >> 16 & 0xFFFF
        flags = s[11] >> 32
        if flags & ~FLAG_TRAILER:
            raise HeaderError(f"unknown offer flags {flags:#x}", seq, pair)
        if flags & FLAG_TRAILER and s[14] != 0:
            raise HeaderError("an early offer (trailer flag) must not carry a checksum", seq,
                              pair)
        if dtype_code not in CODE_DTYPES:
            raise HeaderError(f"unknown dtype code {dtype_code}", seq, pair)
        if format_code not in CODE_FORMATS:
            raise HeaderError(f"unknown KV cache format code {format_code}", seq, pair)
        if not 0 <= s[5] <= MAX_BLOCKS:
            raise HeaderError(f"num_blocks {s[5]} outside [0, {MAX_BLOCKS}]", seq, pair)
        try:
            layout = KVLayout(s[6], s[8], s[9], s[10], CODE_DTYPES[dtype_code],
                              CODE_FORMATS[format_code], digest)
        except ValueError as e:
            raise HeaderError(str(e), seq, pair) from None
        header = cls(s[2], seq, s[4], s[5], layout, s[12], s[13], s[14], flags)
        planes = layout.num_planes
        if not 1 <= header.chunk_planes <= planes or -(-planes // header.chunk_planes) > (
                MAX_PAYLOAD_MESSAGES):
            raise HeaderError(f"chunk_planes {header.chunk_planes} invalid for {planes} "
                              "planes", seq, pair)
        if header.payload_bytes != layout.payload_bytes(header.num_blocks):
            raise HeaderError(f"payload_bytes {header.payload_bytes} != "
                              f"{layout.payload_bytes(header.num_blocks)} implied by the shape",
                              seq, pair)
        return header


@dataclass(frozen=True)
class Message:
    """One payload message: planes ``[p0, p1)`` x block indices ``[i0, i1)`` of the
    payload seen as ``[planes, num_blocks, block_size, kv_heads, head_dim]``; always a
    contiguous slice of it."""

    p0: int
    p1: int
    i0: int
    i1: int


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ascending ids, as ``[i0, i1)`` index ranges."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def message_plan(header: TransferHeader, block_ids: Sequence[int], direct: bool) -> list[Message]:
    """The payload messages of a transfer, in send order; both ends compute the same."""
    planes, n = header.layout.num_planes, header.num_blocks
    if direct:
        runs = block_runs(block_ids)
        return [Message(p, p + 1, i0, i1) for p in range(planes) for i0, i1 in runs]
    c = header.chunk_planes
    return [Message(p, min(p + c, planes), 0, n) for p in range(0, planes, c)]


def direct_plan_fits(header: TransferHeader, block_ids: Sequence[int], min_bytes: int) -> bool:
    """Whether the direct framing has few enough messages, each ``min_bytes`` on average."""
    count = header.layout.num_planes * len(block_runs(block_ids))
    return count <= MAX_PAYLOAD_MESSAGES and header.payload_bytes >= count * min_bytes


def encode_trailer(checksum: int, status: int) -> torch.Tensor:
    """An early offer's trailer without its MAC: ``TRAILER_BYTES`` bytes, uint8."""
    raw = np.array([checksum, status], dtype=_WIRE_INT64).tobytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_trailer(data: bytes) -> tuple[int, int]:
    """(payload checksum, status) of a trailer's first ``TRAILER_BYTES``; HeaderError for
    a status this receiver does not know."""
    checksum, status = (int(v) for v in np.frombuffer(data[:TRAILER_BYTES], dtype=_WIRE_INT64))
    if status not in (TRAILER_OK, TRAILER_VOID, TRAILER_EXPIRED):
        raise HeaderError(f"unknown trailer status {status}")
    return checksum, status


def _checksum(slots: Sequence[int]) -> int:
    acc = 0xCBF29CE484222325
    for v in slots:
        acc = ((acc ^ (v & _MASK64)) * 0x100000001B3) & _MASK64
    return acc - (1 << 64) if acc >= 1 << 63 else acc


def encode_offer(header: TransferHeader, block_ids: Sequence[int]) -> bytes:
    """Header then target block ids, as raw little-endian int64."""
    if len(block_ids) != header.num_blocks:
        raise ValueError(f"{len(block_ids)} block ids for a header of {header.num_blocks}")
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    return (header.to_tensor().numpy().astype(_WIRE_INT64).tobytes()
            + ids.numpy().astype(_WIRE_INT64).tobytes())


def decode_offer(data: bytes) -> tuple[TransferHeader, list[int]]:
    """Inverse of :func:`encode_offer`. Raises HeaderError on anything malformed."""
    if len(data) < HEADER_BYTES or len(data) % 8:
        raise HeaderError(f"offer of {len(data)} bytes is not a header plus int64 ids")
    raw = np.frombuffer(data, dtype=_WIRE_INT64)
    header = TransferHeader.from_tensor(torch.from_numpy(raw[:HEADER_SLOTS].astype(np.int64)))
    ids = raw[HEADER_SLOTS:]
    if len(ids) != header.num_blocks:
        raise HeaderError(f"header announces {header.num_blocks} block ids, offer carries "
                          f"{len(ids)}", header.seq, header.pair_id)
    return header, [int(i) for i in ids]


def check_offer(header: TransferHeader, block_ids: Sequence[int], layout: KVLayout,
                expected_block_ids: Sequence[int], max_payload_bytes: int) -> str | None:
    """Why this offer must be refused for a reservation of ``expected_block_ids`` blocks
    of ``layout``, or None when it matches exactly. Side-effect free."""
    got = header.layout
    if (got.dtype, got.kv_format) == (layout.dtype, layout.kv_format) and (
            got.kv_digest != layout.kv_digest):
        return (f"KV cache key transforms differ: the prefill worker sends {got.describe()}, "
                f"this decode worker stores {layout.describe()}; the transform is calibrated "
                "when a worker starts: run the same model, --dtype and pdserve release on "
                "both")
    if (got.dtype, got.kv_format) != (layout.dtype, layout.kv_format):
        return (f"KV cache dtype mismatch: the prefill worker sends {got.describe()}, this "
                f"decode worker stores {layout.describe()}; start both with the same "
                "--kv-cache-dtype and --dtype")
    if (got.num_layers, got.block_size, got.kv_heads, got.head_dim) != (
            layout.num_layers, layout.block_size, layout.kv_heads, layout.head_dim):
        return (f"shape mismatch: offer layers/block_size/kv_heads/head_dim "
                f"{got.num_layers}/{got.block_size}/{got.kv_heads}/{got.head_dim}, reservation "
                f"{layout.num_layers}/{layout.block_size}/{layout.kv_heads}/{layout.head_dim}")
    if header.num_blocks != len(expected_block_ids):
        return (f"block count mismatch: offer {header.num_blocks}, reservation "
                f"{len(expected_block_ids)}")
    if list(block_ids) != list(expected_block_ids):
        return (f"target block ids mismatch: offer {list(block_ids)[:8]}..., reservation "
                f"{list(expected_block_ids)[:8]}...")
    if header.payload_bytes != layout.payload_bytes(len(expected_block_ids)):
        return f"payload of {header.payload_bytes} bytes does not match the reservation"
    if header.payload_bytes > max_payload_bytes:
        return f"payload of {header.payload_bytes} bytes exceeds the bound {max_payload_bytes}"
    return None
