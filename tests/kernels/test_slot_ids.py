"""layer_ops.slot_ids: an engine step's slot tensors -> the ops' int32 ids (-1 = padding).

The reference form (kernels/reference_conv.slot_ids, CPU) against ids written out by hand; the
TileLang kernel (kernels/hopper/slot_ids.py) compiled for both targets (marker compile) and, on
the lent H200 (marker gpu), against the reference on fresh random engine ids of both dtypes,
strided views of larger buffers included, eagerly and replayed from a CUDA graph (the kernel
module called directly: layer_ops takes it only where layer_ops.SLOT_IDS_KERNEL).
"""

import importlib

import pytest
import torch

from qla_serve import layer_ops
from qla_serve.kernels import reference_conv

S = importlib.import_module("qla_serve.kernels.hopper.slot_ids")
NULL = 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reference_ids_by_hand(dtype):
    rows = torch.tensor([3, 0, 7, 0, 9], dtype=dtype)
    assert layer_ops.slot_ids(rows, NULL).tolist() == [3, -1, 7, -1, 9]
    cu = torch.tensor([0, 5, 5, 9, 12, 12], dtype=torch.int32)    # sequences 1 and 4 empty
    got = layer_ops.slot_ids(rows, NULL, cu_seqlens=cu)
    assert got.dtype == torch.int32 and got.tolist() == [3, -1, 7, -1, -1]
    spec = torch.tensor([[4, 5, 6], [0, 8, 9], [10, 0, 12]], dtype=dtype)
    assert layer_ops.slot_ids(spec, NULL).tolist() == [[4, 5, 6], [-1, -1, -1], [10, -1, 12]]


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="slots"):
        layer_ops.slot_ids(torch.zeros(3), NULL)
    with pytest.raises(ValueError, match="slots"):
        layer_ops.slot_ids(torch.zeros(2, 2, dtype=torch.int32), NULL, cu_seqlens=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer_ops.slot_ids(torch.zeros(3, dtype=torch.int32), NULL, cu_seqlens=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="null_slot"):
        layer_ops.slot_ids(torch.zeros(3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="slot ids kind"):
        S.variant("ragged", "int32")


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", S.kernel_variants(8, 2), ids=lambda v: v["name"])
def test_slot_ids_compiles(variant, target):
    src = S.build(variant, target).get_kernel_source()
    assert "int N" in src                                   # one compile for every batch
    assert ("int64_t null" if variant["slot_dtype"] == "int64" else "int null") in src
    assert ("Cu[" in src) == (variant["kind"] == "seqs")


def _random_case(gen, dtype, kind):
    """Engine ids with padding, as views of larger persistent buffers (strides > 1)."""
    N, D = 300, 4
    if kind == "spec":
        buf = torch.randint(1, 5000, (N + 7, 2 * D), generator=gen).to(dtype)
        buf[torch.rand(N + 7, 2 * D, generator=gen) < 0.1] = NULL
        buf[::9, 0] = NULL                                  # padded rows
        return buf[:N, ::2], None
    buf = torch.randint(1, 5000, (3 * N,), generator=gen).to(dtype)
    buf[torch.rand(3 * N, generator=gen) < 0.2] = NULL
    slots = buf[: 2 * N : 2]
    if kind == "rows":
        return slots, None
    lens = torch.randint(0, 3, (N,), generator=gen)
    lens[torch.rand(N, generator=gen) < 0.3] = 0
    return slots, torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", ["rows", "seqs", "spec"])
def test_kernel_matches_reference(dtype, kind):
    gen = torch.Generator().manual_seed(hash((kind, str(dtype))) % 1000)
    slots, cu = _random_case(gen, dtype, kind)
    want = reference_conv.slot_ids(slots, NULL, cu)
    slots, cu = slots.cuda(), None if cu is None else cu.cuda()
    got = S.slot_ids(slots, NULL, cu)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    assert S.slot_ids(slots[:0], NULL, None if cu is None else cu[:1]).numel() == 0
    # In a graph: replays re-read the engine's (persistent) id buffer.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = S.slot_ids(slots, NULL, cu)
    slots.copy_(torch.flip(slots, [0]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference_conv.slot_ids(slots.cpu(), NULL, None if cu is None else cu.cpu()))
