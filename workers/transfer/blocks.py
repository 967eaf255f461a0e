"""Moving KV blocks between a paged cache and the contiguous transfer payload.

The engine's cache is ``[layers, 2, num_blocks*block_size, kv_heads, head_dim]``; block
``b`` owns slots ``[b*block_size, (b+1)*block_size)`` of every layer. The payload of a
transfer is ``[layers, 2, n, block_size, kv_heads, head_dim]``: the n blocks in the order
of the target block ids. The sender gathers, the receiver scatters, both through the
same view of the cache, so a block lands exactly where its id says.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from workers.transfer.header import KVLayout, block_runs


def _block_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    KVLayout.of_cache(cache, block_size)  # validates the shape
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous to be viewed by block")
    layers, _, slots, heads, dim = cache.shape
    return cache.view(layers, 2, slots // block_size, block_size, heads, dim)


def _ids(block_ids: Sequence[int], num_blocks: int, device: torch.device) -> torch.Tensor:
    ids = list(block_ids)
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} outside the cache's [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate block ids in {ids[:16]}")
    return torch.tensor(ids, dtype=torch.long, device=device)


def gather_blocks(cache: torch.Tensor, block_ids: Sequence[int], block_size: int) -> torch.Tensor:
    """A new contiguous payload ``[layers, 2, n, block_size, kv_heads, head_dim]``."""
    view = _block_view(cache, block_size)
    layers, _, num_blocks, *block = view.shape
    ids = _ids(block_ids, num_blocks, cache.device)
    # index_select over a middle axis of the 6-d view is ~20x slower on CPU than over
    # [layers*2, blocks, block elements], where each selected block is one memcpy.
    flat = view.view(layers * 2, num_blocks, -1)
    return flat.index_select(1, ids).view(layers, 2, len(ids), *block)


def scatter_blocks(cache: torch.Tensor, block_ids: Sequence[int], block_size: int,
                   kv: torch.Tensor, layer_start: int = 0) -> None:
    """Write ``kv`` (``[l, 2, n, block_size, kv_heads, head_dim]``, layers
    ``layer_start..layer_start+l``) into the given blocks of ``cache``, in place."""
    view = _block_view(cache, block_size)
    ids = _ids(block_ids, view.shape[2], cache.device)
    end = layer_start + kv.shape[0]
    expect = (kv.shape[0], 2, len(ids), *view.shape[3:])
    if tuple(kv.shape) != expect or not 0 <= layer_start <= end <= view.shape[0]:
        raise ValueError(f"cannot scatter {tuple(kv.shape)} at layer {layer_start} into "
                         f"blocks of {tuple(view.shape)}; expected {expect}")
    if kv.dtype != cache.dtype:
        raise ValueError(f"dtype {kv.dtype} does not match the cache's {cache.dtype}")
    view[layer_start:end].index_copy_(2, ids, kv.to(cache.device))


class KVDestination(Protocol):
    """Where a receive lands. Payload planes are numbered ``2*layer + (0 for K, 1 for V)``
    and blocks by their index in the reservation's block id list.

    Staged framing: the channel receives each message into its own buffer and calls
    ``write`` once it is complete. Direct framing (only when ``direct`` is true): the
    channel receives straight into ``region(...)``. Both happen on a channel thread
    while the transfer is RECEIVING and never after it ended.
    """

    direct: bool

    def write(self, plane_start: int, kv: torch.Tensor) -> None:
        """Copy ``kv`` ``[planes, n, block_size, kv_heads, head_dim]`` (planes
        ``plane_start..``, all n blocks) to its final place. Must not keep ``kv``."""
        ...

    def region(self, plane: int, i0: int, i1: int) -> torch.Tensor:
        """The contiguous final place of blocks ``i0..i1`` of ``plane`` (consecutive ids)."""
        ...


class PagedCacheDestination:
    """Receives blocks into a paged cache at the reserved block ids. Runs of consecutive
    ids can be received in place (``direct``) unless ``direct=False``."""

    def __init__(self, cache: torch.Tensor, block_ids: Sequence[int], block_size: int,
                 direct: bool = True):
        view = _block_view(cache, block_size)
        layers, _, num_blocks, *block = view.shape
        self._ids = _ids(block_ids, num_blocks, cache.device)  # fail now, not mid-receive
        self._planes = view.view(layers * 2, num_blocks, *block)
        self.cache, self.block_ids, self.block_size = cache, list(block_ids), block_size
        self.direct = direct

    def write(self, plane_start: int, kv: torch.Tensor) -> None:
        end = plane_start + kv.shape[0]
        self._planes[plane_start:end].index_copy_(1, self._ids, kv.to(self.cache.device))

    def region(self, plane: int, i0: int, i1: int) -> torch.Tensor:
        first = self.block_ids[i0]
        if self.block_ids[i0:i1] != list(range(first, first + i1 - i0)):
            raise ValueError(f"blocks {self.block_ids[i0:i1]} are not one run")
        return self._planes[plane, first:first + i1 - i0]


class TensorDestination:
    """Receives the payload into a caller's contiguous ``[layers, 2, n, bs, heads, dim]``."""

    direct = True

    def __init__(self, out: torch.Tensor):
        if not out.is_contiguous():
            raise ValueError("TensorDestination needs a contiguous tensor")
        self.out = out
        self._planes = out.view(out.shape[0] * 2, *out.shape[2:])

    def write(self, plane_start: int, kv: torch.Tensor) -> None:
        self._planes[plane_start:plane_start + kv.shape[0]].copy_(kv)

    def region(self, plane: int, i0: int, i1: int) -> torch.Tensor:
        return self._planes[plane, i0:i1]


class TensorSource:
    """Payload messages sliced out of one contiguous ``[layers, 2, n, bs, heads, dim]``."""

    def __init__(self, kv: torch.Tensor):
        kv = kv.contiguous()
        self._planes = kv.view(kv.shape[0] * 2, *kv.shape[2:])

    def message(self, p0: int, p1: int, i0: int, i1: int) -> torch.Tensor:
        return self._planes[p0:p1, i0:i1]

    def pieces(self) -> Iterator[torch.Tensor]:
        """The whole payload in canonical order, as contiguous views (no copy)."""
        yield self._planes


class PagedSource:
    """Payload messages read straight out of a paged cache at ``block_ids``: a message of
    one plane over a run of consecutive source blocks is a view (no copy); any other is
    gathered on demand, one message at a time. The blocks must stay unchanged (held)
    until the transfer is terminal."""

    def __init__(self, cache: torch.Tensor, block_ids: Sequence[int], block_size: int):
        view = _block_view(cache, block_size)
        layers, _, num_blocks, *block = view.shape
        self._ids_t = _ids(block_ids, num_blocks, cache.device)
        self._ids = list(block_ids)
        self._runs = block_runs(self._ids)
        self._flat = view.view(layers * 2, num_blocks, *block)

    def pieces(self) -> Iterator[torch.Tensor | np.ndarray]:
        """The payload in canonical order (plane by plane, blocks in the order of the
        ids) as contiguous views of the cache, one per plane and run of source ids. A
        CPU cache is viewed as uint8 arrays: scattered ids make ``2*layers*n`` pieces,
        and a numpy slice costs ~0.3 us where a tensor view and its bytes cost ~8."""
        flat: torch.Tensor | np.ndarray = self._flat
        if self._flat.device.type == "cpu":
            flat = self._flat.view(*self._flat.shape[:2], -1).view(torch.uint8).numpy()
        for plane in flat:
            for i0, i1 in self._runs:
                first = self._ids[i0]
                yield plane[first:first + i1 - i0]

    def message(self, p0: int, p1: int, i0: int, i1: int) -> torch.Tensor:
        first = self._ids[i0]
        if p1 - p0 == 1 and self._ids[i0:i1] == list(range(first, first + i1 - i0)):
            return self._flat[p0, first:first + i1 - i0]
        return self._flat[p0:p1].index_select(1, self._ids_t[i0:i1])
