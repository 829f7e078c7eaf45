"""State slots: the standalone StatePool and views over engine-owned (paged) pools."""

import pytest
import torch

from qla_serve import PoolView, StatePool, StatePoolError


def test_allocate_zeroes_and_free_reuses():
    pool = StatePool(3, 2)
    pool.tensor.fill_(7)
    ids = pool.allocate(2)
    assert ids.dtype == torch.int32 and ids.tolist() == [0, 1]
    assert torch.equal(pool.tensor[:2], torch.zeros_like(pool.tensor[:2]))
    assert (pool.tensor[2] == 7).all()                   # an unallocated slot is not touched
    pool.free(ids[:1])
    assert pool.num_free == 2
    assert pool.allocate(1).tolist() == [0]


def test_exhaustion_double_free_foreign_ids():
    pool = StatePool(2, 1, dtype=torch.bfloat16)
    ids = pool.allocate(2)
    with pytest.raises(StatePoolError, match="2 slots requested|1 slots requested"):
        pool.allocate(1)
    pool.free(ids)
    with pytest.raises(StatePoolError, match="double free"):
        pool.free([0])
    with pytest.raises(StatePoolError, match="not a slot of this pool"):
        pool.free([5])
    with pytest.raises(StatePoolError, match="repeated"):
        pool.free([1, 1])
    with pytest.raises(StatePoolError, match="not allocated"):
        pool.reset([0])


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_slots"):
        StatePool(0, 2)
    with pytest.raises(ValueError, match="num_v_heads"):
        StatePool(2, -1)
    with pytest.raises(TypeError, match="dtype"):
        StatePool(2, 2, dtype=torch.float16)


def test_pool_view_checks_layout():
    ok = torch.zeros(4, 2, 128, 128)
    assert PoolView(ok, 2).num_slots == 4
    with pytest.raises(ValueError, match="pool"):
        PoolView(ok, 4)                                       # wrong head count
    with pytest.raises(TypeError, match="pool"):
        PoolView(ok.half(), 2)                                # fp16 pools are not a contract dtype
    with pytest.raises(ValueError, match="inner dims"):
        PoolView(ok.transpose(2, 3), 2)                       # K-first is not the layout


def test_pool_view_from_paged_cache_keeps_the_page_stride():
    """vLLM-like pages: each block holds one slot followed by other data."""
    slot = 2 * 128 * 128
    cache = torch.arange(5 * (slot + 100), dtype=torch.float32).view(5, slot + 100)
    view = PoolView.from_paged_cache(cache, 2)
    assert view.tensor.stride(0) == slot + 100
    view.tensor[3].fill_(-1)
    assert (cache[3, :slot] == -1).all() and (cache[3, slot:] != -1).all()
    assert (cache[2] != -1).all()
