"""Recurrent-state slots: validated views over engine-owned pools, and a standalone pool.

A pool is ``[S, Hv, 128(V), 128(K)]`` in fp32 or bf16, V-first like vLLM's and SGLang's
caches. Engines page their caches, so ``stride(0)`` may exceed one slot (Hv*V*K elements);
the inner three dims must be contiguous. Kernels read and write ``pool[slot]`` in place.
"""

from __future__ import annotations

import torch

from qla_serve._validate import HEAD_DIM, as_index, check_device_arg, check_dtype, check_int, check_pool


class PoolView:
    """A checked handle on an engine-owned state pool (no copy; the engine keeps ownership).

    Args:
        pool: [S, Hv, 128, 128] fp32/bf16 tensor (a strided view of a paged cache is fine).
        num_v_heads: expected Hv (TP-local).
    """

    def __init__(self, pool: torch.Tensor, num_v_heads: int):
        check_pool(pool, check_int("num_v_heads", num_v_heads, minimum=1, what="a positive int"))
        self.tensor = pool

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @classmethod
    def from_paged_cache(cls, cache: torch.Tensor, num_v_heads: int) -> "PoolView":
        """View a paged cache ``[num_blocks, ...]`` whose block starts with one state slot.

        The slot is the first Hv*128*128 elements of each block; the page stride stays.
        """
        num_v_heads = check_int("num_v_heads", num_v_heads, minimum=1, what="a positive int")
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"cache: expected a torch.Tensor, got {type(cache).__name__}")
        slot = num_v_heads * HEAD_DIM * HEAD_DIM
        if cache.dim() < 1 or cache[0].numel() < slot:
            raise ValueError(f"cache: expected blocks of at least {slot} elements, got shape {list(cache.shape)}")
        if cache.dim() == 4 and cache.shape[1:] == (num_v_heads, HEAD_DIM, HEAD_DIM):
            return cls(cache, num_v_heads)
        view = cache.as_strided((cache.shape[0], num_v_heads, HEAD_DIM, HEAD_DIM),
                                (cache.stride(0), HEAD_DIM * HEAD_DIM, HEAD_DIM, 1),
                                cache.storage_offset())
        return cls(view, num_v_heads)


class StatePoolError(ValueError):
    """Misuse of a StatePool: exhaustion, double free, a foreign id."""


class StatePool:
    """A standalone pool of state slots for use outside engines.

    >>> pool = StatePool(num_slots=4, num_v_heads=8, dtype=torch.float32)
    >>> ids = pool.allocate(2)          # int32 CPU tensor of slot ids, states zeroed
    >>> pool.free(ids)
    """

    def __init__(self, num_slots: int, num_v_heads: int, *, dtype=torch.float32, device="cpu"):
        num_slots = check_int("num_slots", num_slots, minimum=1, what="a positive int")
        num_v_heads = check_int("num_v_heads", num_v_heads, minimum=1, what="a positive int")
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
        device = check_device_arg(device)
        self.tensor = torch.zeros(num_slots, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> torch.Tensor:
        """Take ``n`` slots, zero their states, return their ids (int32, CPU)."""
        n = check_int("n", n, minimum=0, what="an int >= 0")
        if n > len(self._free):
            raise StatePoolError(f"allocate: {n} slots requested, {len(self._free)} of {self.num_slots} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        ids_t = torch.tensor(ids, dtype=torch.int32)
        self.reset(ids_t)
        return ids_t

    def free(self, ids) -> None:
        """Return slots. Raises on ids never handed out, freed twice, or repeated in ``ids``."""
        vals = self._ids(ids)
        if len(set(vals)) != len(vals):
            raise StatePoolError(f"free: ids repeated in one call: {vals}")
        for s in vals:
            if s not in self._used:
                what = "already free (double free)" if 0 <= s < self.num_slots else "not a slot of this pool"
                raise StatePoolError(f"free: slot {s} is {what}")
        for s in vals:
            self._used.remove(s)
            self._free.append(s)

    def reset(self, ids) -> None:
        """Zero the states of allocated slots."""
        vals = self._ids(ids)
        for s in vals:
            if s not in self._used:
                raise StatePoolError(f"reset: slot {s} is not allocated")
        if vals:
            self.tensor[torch.tensor(vals, dtype=torch.long, device=self.tensor.device)] = 0

    @staticmethod
    def _ids(ids) -> list[int]:
        """Slot ids as ints: an integer CPU tensor or an iterable of ints (a float is refused,
        never truncated to another slot)."""
        if torch.is_tensor(ids):
            if ids.device.type != "cpu":
                raise ValueError("ids: expected CPU ids (the pool's bookkeeping is host-side)")
            check_dtype("ids", ids, (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8))
            return ids.reshape(-1).tolist()
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids: expected slot ids (ints), got {type(ids).__name__}")
        try:
            vals = list(ids)
        except TypeError:
            raise TypeError(f"ids: expected slot ids (an int tensor or a list of ints), got "
                            f"{type(ids).__name__}") from None
        out = []
        for x in vals:
            n = as_index(x)
            if n is None:
                raise TypeError(f"ids: expected ints, got {x!r} ({type(x).__name__})")
            out.append(n)
        return out
