"""KV cache memory: request rows, the per-layer K/V buffers, and the token-slot allocator.

Layout:
  ReqToTokenPool.req_to_token[row, pos] = KV slot of token `pos` of the request in `row`.
  MHATokenToKVPool.k_buffer[layer][slot] = K of one token, shape [num_kv_heads, head_dim].
Slot 0 is the dummy slot: the allocator never hands it out, so padded tokens of a graph replay can
write their K/V there harmlessly and no kernel needs a mask for them.
"""

from __future__ import annotations

from typing import Optional

import torch


# None: a separate host twin of req_to_token off the CPU only; True / False force it (tests).
SEPARATE_HOST_TWIN: Optional[bool] = None


class ReqToTokenPool:
    """Maps a request row to the KV slots of its tokens.

    Every write goes to the device table (read by the attention kernels) and to a host twin, from
    which the scheduler reads a request's slots (when it finishes, or to cache a prefill's KV) with
    no device->host copy: such a copy waits for all the GPU work queued before it, which would also
    serialise a forward still in flight. Writes go through `write` / `write_rows` only."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # int32: the attention kernels index it directly.
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        # On a CPU device the table is its own twin (tests set SEPARATE_HOST_TWIN to check the twin).
        separate = SEPARATE_HOST_TWIN if SEPARATE_HOST_TWIN is not None else self.device.type != "cpu"
        self.host = torch.zeros((size, max_context_len), dtype=torch.int32) if separate else self.req_to_token
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> Optional[list[int]]:
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, row: int | list[int]) -> None:
        rows = [row] if isinstance(row, int) else list(row)
        self.free_slots.extend(rows)

    def write(self, row: int, start: int, locs: torch.Tensor) -> None:
        """Row `row`, positions start.. get the slots `locs`. The scheduler's slots are host
        tensors; a device tensor (tests) is read back for the twin, which waits for the GPU."""
        end = start + locs.numel()
        if self.host is not self.req_to_token:
            self.host[row, start:end] = locs.to("cpu", torch.int32)
        self.req_to_token[row, start:end] = locs.to(self.device, torch.int32, non_blocking=True)

    def write_rows(self, rows: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
                   device_views: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> None:
        """Scattered writes: req_to_token[rows[i], positions[i]] = locs[i] (host tensors). A batch
        builder that moved them to the device already passes those copies (`device_views`), so the
        device table is written by one indexing kernel and no other copy."""
        if self.host is not self.req_to_token:
            self.host[rows, positions] = locs.to(torch.int32)
        rows_d, positions_d, locs_d = device_views if device_views is not None else (
            t.to(self.device, non_blocking=True) for t in (rows, positions, locs))
        self.req_to_token[rows_d, positions_d] = locs_d.to(torch.int32)

    def slots(self, rows: list[int], end: int, start: int = 0) -> torch.Tensor:
        """Slots start..end-1 of each row, int64 [len(rows), end - start], from the host twin."""
        return self.host[rows, start:end].to(torch.int64)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """K and V for every layer, `size + 1` slots each (slot 0 is the dummy slot)."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        shape = (size + 1, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]

    @staticmethod
    def bytes_per_token(dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int) -> int:
        return 2 * layer_num * head_num * head_dim * torch.tensor([], dtype=dtype).element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of the tokens at slots `loc`. `k`, `v` are [T, head_num * head_dim] or 3-D."""
        k = k.view(-1, self.head_num, self.head_dim)
        v = v.view(-1, self.head_num, self.head_dim)
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size; slot 0 is never handed out.

    The free list lives on the host: the scheduler allocates every step, and a host list costs no
    device synchronisation. Callers move the slots to the device when they build a batch.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size > self.free_slots.numel():
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        assert not bool((slots == 0).any()), "slot 0 is the dummy slot and is never allocated"
        self.free_slots = torch.cat((self.free_slots, slots.to("cpu", torch.int64)))
