"""Where a KV block's bytes are, whatever engine laid the cache out: a list of per-layer byte regions.

pdserve's pool is one tensor `[blocks, layers, 2, heads, block_size, head_dim]`: a block is one contiguous span
and each of its layers a slice of it. vLLM's cache is one tensor per layer `[blocks, ...]`: a block is one span
per layer tensor. Both are "layer l of block b starts at `base_l + b * stride_l` and is `layer_bytes` long", so
the transfer code (socket server, checksums, fault damage) addresses blocks through this one description and
never assumes a layout. Bytes move opaquely: both ends must have the same layout, which the handshake's
compatibility hash checks.

A cache in device memory (vLLM's on a GPU) has no host byte view: it is described by addresses alone, for the
planes that register device memory with their engine, and as per-layer byte tensors, so checksums and fault
damage run on the device with torch ops. Planes that copy through host views refuse it (`refuse_device_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class DataPlaneError(RuntimeError):
    pass


def byte_view(kv: torch.Tensor) -> memoryview:
    """A tensor as flat bytes (no copy), for sockets and checksums."""
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def refuse_device_memory(plane: str, device: torch.device) -> None:
    """Planes that copy bytes through the host serve host memory only: say which plane can serve a device's."""
    if device.type != "cpu":
        raise DataPlaneError(f"the {plane} data plane copies KV through host memory and cannot serve a KV cache "
                             f"on {device}; use the nixl data plane, which registers device memory with NIXL")


def check_block_ids(block_ids: list[int], num_blocks: int) -> None:
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise DataPlaneError(f"block id {b} outside the pool [0, {num_blocks})")


@dataclass(frozen=True, slots=True)
class _Layer:
    data: memoryview | None  # the layer's bytes for block 0 onwards; None for device memory
    stride: int  # bytes from one block to the next
    address: int  # where `data` starts in this process's memory, for planes that copy between processes


class BlockRegions:
    """Byte access to whole blocks and single layers of blocks, in a layout-independent way."""

    def __init__(self, layers: Sequence[_Layer], layer_bytes: int, num_blocks: int, contiguous: bool,
                 device: torch.device = torch.device("cpu"), device_layers: Sequence[torch.Tensor] = ()) -> None:
        self._layers = list(layers)
        self.device = device
        # Device memory as a `[blocks, layer_bytes]` byte tensor per layer, for checksums and damage on the
        # device (empty for host memory, and for device memory described by address only).
        self.device_layers = tuple(device_layers)
        self.layer_bytes = layer_bytes
        self.num_blocks = num_blocks
        self.num_layers = len(self._layers)
        self.block_bytes = layer_bytes * self.num_layers
        # Whether a block's layers follow each other in memory (and blocks each other): whole blocks, and runs
        # of adjacent blocks, are then single spans.
        self._contiguous = contiguous

    @classmethod
    def from_pool(cls, kv: torch.Tensor) -> BlockRegions:
        """pdserve's pool `[blocks, layers, ...]`: one contiguous tensor."""
        data = byte_view(kv)
        block_bytes = kv[0].numel() * kv.element_size()
        layer_bytes = block_bytes // kv.shape[1]
        layers = [_Layer(data[i * layer_bytes:], block_bytes, kv.data_ptr() + i * layer_bytes)
                  for i in range(kv.shape[1])]
        return cls(layers, layer_bytes, kv.shape[0], contiguous=True)

    @classmethod
    def from_layers(cls, tensors: Sequence[torch.Tensor]) -> BlockRegions:
        """One tensor per layer, each `[blocks, ...]` and contiguous (vLLM's KV cache), all alike."""
        first = tensors[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
            raise DataPlaneError("the per-layer KV tensors differ in shape or dtype")
        if not all(t.is_contiguous() for t in tensors):
            raise DataPlaneError("a per-layer KV tensor is not contiguous")
        layer_bytes = first[0].numel() * first.element_size()
        if first.device.type != "cpu":
            return cls.described([(t.data_ptr(), layer_bytes) for t in tensors], layer_bytes, first.shape[0],
                                 first.device, [t.view(first.shape[0], -1).view(torch.uint8) for t in tensors])
        return cls([_Layer(byte_view(t), layer_bytes, t.data_ptr()) for t in tensors], layer_bytes, first.shape[0],
                   contiguous=len(tensors) == 1)

    @classmethod
    def described(cls, extents: Sequence[tuple[int, int]], layer_bytes: int, num_blocks: int, device: torch.device,
                  device_layers: Sequence[torch.Tensor] = ()) -> BlockRegions:
        """Memory this process cannot view as bytes (a GPU's): each layer by (address of block 0, stride) alone,
        and optionally as `[blocks, layer_bytes]` byte tensors on `device`."""
        if device_layers and layer_bytes % 4:
            raise DataPlaneError(f"a KV block layer of {layer_bytes} bytes is not whole 32-bit words")
        return cls([_Layer(None, stride, address) for address, stride in extents], layer_bytes, num_blocks,
                   contiguous=False, device=device, device_layers=device_layers)

    def layer_extents(self) -> list[tuple[int, int]]:
        """(address of block 0's bytes, stride) per layer: where another process on this host finds them."""
        return [(entry.address, entry.stride) for entry in self._layers]

    def layer_view(self, block: int, layer: int) -> memoryview:
        entry = self._layers[layer]
        if entry.data is None:
            raise DataPlaneError(f"KV blocks on {self.device} have no host byte view")
        start = block * entry.stride
        return entry.data[start:start + self.layer_bytes]

    def block_views(self, block: int) -> list[memoryview]:
        """A block's bytes as spans, in layer order."""
        if self._contiguous:
            return [self._layers[0].data[block * self.block_bytes:(block + 1) * self.block_bytes]]
        return [self.layer_view(block, layer) for layer in range(self.num_layers)]

    def spans(self, block_ids: list[int], layer: int | None) -> list[memoryview]:
        """Byte views of the blocks (or of one layer of each) in exactly the order named; bytes on the wire
        follow that order, so adjacent ascending ids merge into one view but nothing is reordered."""
        check_block_ids(block_ids, self.num_blocks)
        if layer is not None:
            if not 0 <= layer < self.num_layers:
                raise DataPlaneError(f"layer {layer} outside [0, {self.num_layers})")
            return [self.layer_view(b, layer) for b in block_ids]
        if not self._contiguous:
            return [view for b in block_ids for view in self.block_views(b)]
        data = self._layers[0].data
        return [data[start * self.block_bytes:(start + n) * self.block_bytes] for start, n in ordered_runs(block_ids)]

    def size(self, block_ids: list[int], layer: int | None) -> int:
        return len(block_ids) * (self.block_bytes if layer is None else self.layer_bytes)

    def fill(self, block: int, value: int, nbytes: int | None = None) -> None:
        """Overwrite a block's bytes (or its first `nbytes`) with `value`: injected transit damage."""
        left = self.block_bytes if nbytes is None else nbytes
        if self.device_layers:
            for layer in self.device_layers:
                layer[block, :max(0, min(left, self.layer_bytes))].fill_(value)
                left -= self.layer_bytes
            return
        for view in self.block_views(block):
            n = min(left, len(view))
            view[:n] = bytes([value]) * n
            left -= n
            if left <= 0:
                return


def ordered_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) runs of ids that follow each other in the given order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
