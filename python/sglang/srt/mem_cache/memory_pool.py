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


class ReqToTokenPool:
    """Maps a request row to the KV slots of its tokens."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # int32: the attention kernels index it directly.
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
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
        self.req_to_token[row, start : start + locs.numel()] = locs.to(torch.int32)

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
