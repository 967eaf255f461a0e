"""The KV payload checksum and the header slot that carries it, without processes.

The checksum is defined on the payload's canonical order (plane by plane, blocks in
target order), so the sender can take it before the receiver picks a framing; these
pin that every source and every framing's message stream give the same digest, that a
single flipped bit changes it, and the wire format of the slot.
"""

from __future__ import annotations

import random

import pytest
import torch
import xxhash

from workers.transfer.blocks import PagedSource, TensorSource, gather_blocks
from workers.transfer.channel import FAULT_FLIP_ENV, TransferConfig, fault_hooks_from_env
from workers.transfer.checksum import PayloadHash, flip_one_byte, payload_checksum, to_int64
from workers.transfer.header import (
    HEADER_SLOTS,
    MAGIC,
    VERSION,
    HeaderError,
    KVLayout,
    TransferHeader,
    _checksum,
    decode_offer,
    encode_offer,
    message_plan,
)

LAYOUT = KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def paged_cache(seed: int, num_blocks: int = 24, layout: KVLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks * layout.block_size, layout.kv_heads,
             layout.head_dim)
    return torch.randn(shape, generator=g).to(layout.dtype)


def header(n: int, chunk_planes: int, checksum: int = 0) -> TransferHeader:
    return TransferHeader(11, 5, 2, n, LAYOUT, LAYOUT.payload_bytes(n), chunk_planes, checksum)


def planes_of(payload: torch.Tensor) -> torch.Tensor:
    return payload.view(payload.shape[0] * 2, *payload.shape[2:])


def test_checksum_is_xxh3_64_of_the_payload_bytes_as_a_signed_int64() -> None:
    data = torch.arange(256, dtype=torch.uint8)
    assert payload_checksum([data]) == -7779787747613135503  # pinned: it is on the wire
    assert payload_checksum([data]) == to_int64(xxhash.xxh3_64_intdigest(bytes(range(256))))
    assert to_int64((1 << 64) - 1) == -1 and to_int64(5) == 5
    h = PayloadHash()  # pieces hash as their concatenation
    h.update(data[:100])
    h.update(data[100:])
    assert h.digest() == payload_checksum([data])


def test_paged_and_tensor_sources_hash_the_same_canonical_order() -> None:
    cache = paged_cache(1)
    src = [7, 8, 9, 2, 15, 16, 3]  # runs, a step back, singletons
    payload = gather_blocks(cache, src, LAYOUT.block_size)
    want = payload_checksum([payload.contiguous()])
    assert payload_checksum(TensorSource(payload).pieces()) == want
    assert payload_checksum(PagedSource(cache, src, LAYOUT.block_size).pieces()) == want
    # the same blocks in another order are another payload
    other = PagedSource(cache, [8, 7, 9, 2, 15, 16, 3], LAYOUT.block_size)
    assert payload_checksum(other.pieces()) != want


@pytest.mark.parametrize("seed", range(5))
def test_staged_and_direct_framings_stream_the_same_digest(seed: int) -> None:
    """The receiver hashes messages in plan order as they land; whatever the framing and
    the target ids, that is the digest the sender took before offering."""
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    target = sorted(rng.sample(range(64), n)) if seed % 2 else rng.sample(range(64), n)
    payload = gather_blocks(paged_cache(seed), rng.sample(range(24), n), LAYOUT.block_size)
    want = payload_checksum(TensorSource(payload).pieces())
    planes = planes_of(payload)
    for chunk_planes in (1, 2, 4, LAYOUT.num_planes):
        for direct in (False, True):
            h = PayloadHash()
            for m in message_plan(header(n, chunk_planes), target, direct):
                h.update(planes[m.p0:m.p1, m.i0:m.i1])  # what lands, message by message
            assert h.digest() == want, (chunk_planes, direct, target)


def test_a_single_flipped_bit_anywhere_changes_the_checksum() -> None:
    payload = gather_blocks(paged_cache(3), list(range(6)), LAYOUT.block_size).contiguous()
    want = payload_checksum([payload])
    raw = payload.view(-1).view(torch.uint8)
    rng = random.Random(0)
    for pos in [0, raw.numel() - 1, *rng.sample(range(raw.numel()), 200)]:
        bit = 1 << rng.randrange(8)
        raw[pos] ^= bit
        assert payload_checksum([payload]) != want, pos
        raw[pos] ^= bit
    assert payload_checksum([payload]) == want


def test_fault_flip_changes_one_byte_of_a_copy_only() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(4, 16).to(dtype)
        before = t.clone()
        flipped = flip_one_byte(t)
        assert torch.equal(t, before)  # the sender's KV is untouched
        diff = flipped.view(-1).view(torch.uint8) != t.view(-1).view(torch.uint8)
        assert int(diff.sum()) == 1
        assert payload_checksum([flipped]) != payload_checksum([t])
        # the top byte (sign, exponent): the value is wrong, not rounded
        i = t.numel() // 2
        assert abs(float(flipped.view(-1)[i]) - float(t.view(-1)[i])) > 1.0 or bool(
            flipped.view(-1)[i].isnan())


@pytest.mark.parametrize("checksum", [0, 1, -1, (1 << 63) - 1, -(1 << 63), -7779787747613135503])
def test_header_round_trips_the_payload_checksum_in_slot_14(checksum: int) -> None:
    h = header(3, 2, checksum)
    assert VERSION >= 2
    assert int(h.to_tensor()[14]) == checksum
    assert decode_offer(encode_offer(h, [4, 9, 1])) == (h, [4, 9, 1])


def test_offer_of_an_older_version_is_refused_by_name() -> None:
    """A version 1 sender (slot 14 reserved, no checksum) is told why, on its transfer."""
    slots = [int(v) for v in header(2, 1).to_tensor()]
    slots[0] = MAGIC << 8 | 1
    slots[14] = 0
    slots[15] = _checksum(slots[:15])
    data = encode_offer(header(2, 1), [1, 2])
    old = torch.tensor(slots, dtype=torch.int64).numpy().astype("<i8").tobytes() + data[
        HEADER_SLOTS * 8:]
    with pytest.raises(HeaderError, match=rf"offer version 1; this receiver speaks version "
                                          rf"{VERSION}.*payload checksum") as e:
        decode_offer(old)
    assert (e.value.seq, e.value.pair_id) == (5, 2)  # so the receiver refuses, not drops


def test_a_corrupt_checksum_slot_is_a_corrupt_header() -> None:
    data = bytearray(encode_offer(header(2, 1, 12345), [1, 2]))
    data[14 * 8] ^= 1
    with pytest.raises(HeaderError, match="header checksum mismatch"):
        decode_offer(bytes(data))


def test_the_flip_hook_is_off_by_default_and_only_the_environment_turns_it_on() -> None:
    cfg = TransferConfig()
    assert cfg.fault_flip_kv_byte == ""
    assert fault_hooks_from_env(cfg, {}) is cfg
    assert fault_hooks_from_env(cfg, {FAULT_FLIP_ENV: ""}) is cfg
    assert fault_hooks_from_env(cfg, {FAULT_FLIP_ENV: "chaos-flip"}).fault_flip_kv_byte == (
        "chaos-flip")
    named = TransferConfig(fault_flip_kv_byte="mine")
    assert fault_hooks_from_env(named, {FAULT_FLIP_ENV: "other"}) is named
