"""Learner rank 0: the memory each weight bucket is broadcast from.

Both sides cut the parameters into the same buckets (`protocol.weights.plan_buckets`).
On the learner a bucket is broadcast from one of two places:

- **live**: the parameters' own memory. DeepSpeed ZeRO-1/2 keeps every parameter as a
  view into one flat buffer, in `named_parameters()` order, so a bucket of adjacent
  parameters already is one flat tensor: nothing to copy. Only safe while nothing
  writes the parameters, which `WeightSender.guard` arranges (the optimizer step waits).
- **copy**: a reused buffer per bucket, filled by one memcpy when the bucket is live
  memory, else one copy per parameter (a plain model, ZeRO-3, another dtype).

Both are on the parameters' device: on GPUs NCCL sends straight from GPU memory. Only a gloo
epoch beside a GPU (the shared-GPU fallback, protocol/weights.py), or a ZeRO-3 snapshot kept in
host memory, crosses the PCIe bus, through one reused buffer (`Staging`).

Copies use numpy on CPU: one memcpy on the calling thread. torch's `copy_` splits the
work across its OpenMP pool, and on a shared CPU one descheduled worker stalls the
barrier for all of them (docs/benchmarks.md, weight sync).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from protocol import weights as wg
from protocol.abortable import IN_FLIGHT


class Buckets:
    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype, bucket_bytes: int):
        self.params = params
        self.shapes = [list(p.shape) for p in params]
        self.dtype = dtype
        itemsize = torch.tensor([], dtype=dtype).element_size()
        self.ranges = wg.plan_buckets(self.shapes, itemsize, bucket_bytes)
        self.numels = wg.bucket_numels(self.shapes, self.ranges)
        self._copies: list[torch.Tensor | None] = [None] * len(self.ranges)
        self._live: list[tuple[list[int], torch.Tensor] | None] = [None] * len(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def live(self, i: int) -> torch.Tensor | None:
        """Bucket i as one flat tensor over the parameters' own memory, or None if they are not back to back.

        Re-checked on every call (a data pointer per parameter), since `p.data = ...` can move a parameter.
        """
        params = [self.params[j] for j in self.ranges[i]]
        ptrs = [p.data_ptr() for p in params]
        cached = self._live[i]
        if cached is not None and cached[0] == ptrs:
            return cached[1]
        first = params[0]
        size = first.element_size()
        back_to_back = all(
            p.dtype == self.dtype and p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            for p in params
        ) and all(ptrs[k] + params[k].numel() * size == ptrs[k + 1] for k in range(len(params) - 1))
        if not back_to_back:
            self._live[i] = None
            return None
        flat = torch.empty(0, dtype=self.dtype, device=first.device)
        flat.set_(first.untyped_storage(), first.storage_offset(), (self.numels[i],), (1,))
        self._live[i] = (ptrs, flat)
        return flat

    def copy(self, i: int) -> torch.Tensor:
        """Bucket i copied into its reused buffer (fresh memory would page-fault on first touch, which
        costs as much as the transfer itself on loopback)."""
        out = self._copies[i]
        if out is None:
            first = self.params[self.ranges[i][0]]
            out = self._copies[i] = torch.empty(self.numels[i], dtype=self.dtype, device=first.device)
        with torch.no_grad():
            src = self.live(i)
            if src is not None:
                _memcpy(out, src)
            else:
                offset = 0
                for j in self.ranges[i]:
                    n, p = math.prod(self.shapes[j]), self.params[j].detach()
                    if p.dtype == self.dtype and p.is_contiguous():
                        _memcpy(out[offset : offset + n], p.reshape(-1))
                    else:
                        out[offset : offset + n].copy_(p.reshape(-1))  # converts the dtype
                    offset += n
        return out

    def snapshot(self) -> list[torch.Tensor]:
        """Every bucket copied: what may be broadcast while the parameters keep changing."""
        return [self.copy(i) for i in range(len(self))]

    def send(
        self,
        group: dist.ProcessGroup,
        snapshot: list[torch.Tensor] | None,
        bcast: Callable[[dist.ProcessGroup, torch.Tensor], None] = wg.broadcast,
    ) -> None:
        """Broadcast every bucket from `snapshot`, or, without one, from live memory where there is
        some (the caller guarantees the parameters do not change until this returns). `bcast` sends
        one bucket (protocol/abortable.py's gives up when a member is removed)."""
        for i in range(len(self)):
            if snapshot is not None:
                flat = snapshot[i]
            else:
                live = self.live(i)
                flat = live if live is not None else self.copy(i)
            bcast(group, flat)


class Staging:
    """One reused buffer that an epoch sends buckets from when they sit on the other side of the PCIe bus.

    - a gloo epoch beside a GPU (the shared-GPU fallback): GPU buckets are copied to pinned host memory;
    - an NCCL epoch with a snapshot kept in host memory (`weights.snapshot = "host"`, ZeRO-3): host buckets
      are copied to the GPU.
    Pinned host memory: the copy is one DMA (pageable memory would be staged by the driver in chunks).
    As large as the largest bucket, not the model: buckets take it in turn (protocol/weights.ring_offsets), each
    right after the one before or back at the start. The caller's pipeline (protocol/abortable.py) makes room
    before each copy, so only the IN_FLIGHT - 1 buckets before can still be in flight; a bucket that would land
    on their elements waits for them first (`drain`).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # elements: the largest bucket's
        self._buf: torch.Tensor | None = None
        self._recent: deque[tuple[int, int]] = deque(maxlen=IN_FLIGHT - 1)  # elements of the buckets that may be in flight

    def to(self, device: torch.device, flat: torch.Tensor, drain: Callable[[], None]) -> torch.Tensor:
        """`flat` where a group on `device` sends from: itself, or its copy in the staging buffer."""
        if flat.device == device:
            return flat
        n, buf = flat.numel(), self._buf
        if buf is None or buf.device != device or buf.dtype != flat.dtype or buf.numel() < n:
            pin = device.type == "cpu"  # only ever reached beside a GPU (one side of the copy is CUDA)
            buf = self._buf = torch.empty(max(n, self.capacity), dtype=flat.dtype, device=device, pin_memory=pin)
            self._recent.clear()  # fresh memory: a send still reading the old buffer keeps that alive
        end = self._recent[-1][1] if self._recent else 0
        at = end if end + n <= buf.numel() else 0
        if any(wg.overlap((at, at + n), r) for r in self._recent):
            drain()
        out = buf[at : at + n]
        out.copy_(flat)  # blocking to the host: gloo reads it on its own threads as soon as the broadcast starts
        self._recent.append((at, at + n))
        return out

    def drop(self) -> None:
        """Forget the buffer: an abandoned send may still be reading it."""
        self._buf = None
        self._recent.clear()


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type != "cpu":
        dst.copy_(src)
        return
    # bytes views: numpy has no bfloat16, and a byte copy is all this needs
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
