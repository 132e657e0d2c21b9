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
host memory, crosses the PCIe bus, one bucket at a time (`Staging`).

Copies use numpy on CPU: one memcpy on the calling thread. torch's `copy_` splits the
work across its OpenMP pool, and on a shared CPU one descheduled worker stalls the
barrier for all of them (docs/benchmarks.md, weight sync).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from protocol import weights as wg


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
    One buffer, not one per bucket: each broadcast has ended before the next bucket is copied in (the
    waits are on the host, protocol/abortable.py), so staging holds a bucket, not the model.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def to(self, device: torch.device, flat: torch.Tensor) -> torch.Tensor:
        """`flat` where a group on `device` sends from: itself, or its copy in the staging buffer."""
        if flat.device == device:
            return flat
        buf = self._buf
        if buf is None or buf.device != device or buf.dtype != flat.dtype or buf.numel() < flat.numel():
            pin = device.type == "cpu"  # only ever reached beside a GPU (one side of the copy is CUDA)
            buf = self._buf = torch.empty(flat.numel(), dtype=flat.dtype, device=device, pin_memory=pin)
        out = buf[: flat.numel()]
        out.copy_(flat)  # blocking to the host: gloo reads it on its own threads as soon as the broadcast starts
        return out

    def drop(self) -> None:
        """Forget the buffer: an abandoned send may still be reading it."""
        self._buf = None


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type != "cpu":
        dst.copy_(src)
        return
    # bytes views: numpy has no bfloat16, and a byte copy is all this needs
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
