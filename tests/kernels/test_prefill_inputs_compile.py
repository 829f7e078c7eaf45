"""Compile-only tests of the prefill-input kernel (kernels/hopper/prefill_inputs.py: L2 norm of
q/k and the gates from raw a, b in one launch), plus its variant bookkeeping (plain CPU).
CI compiles every variant kernel_variants() lists for 2/8 heads, for sm_90a and sm_100a."""

import importlib

import pytest
import torch

# The package exports a function named `prefill_inputs`; the submodule comes from sys.modules.
P = importlib.import_module("qla_serve.kernels.hopper.prefill_inputs")

HV, HK = 8, 2
C_TYPE = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "half_t"}


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", P.kernel_variants(HV, HK), ids=lambda v: v["name"])
def test_variant_compiles(variant, target):
    src = P.build(variant, target).get_kernel_source()
    # q/k rows move in 8-byte vectors (4 x bf16/fp16), the row sums by warp shuffles
    assert "*(uint2*)(Q" in src and "*(uint2*)(Ko" in src and "__shfl_xor_sync" in src
    assert "int ntok" in src  # one compile for every token count
    # the normalised q/k leave in the variant's output dtype (fp16 from bf16: the layers' form)
    out = C_TYPE[variant["out_dtype"]]
    assert f"{out}* __restrict__ Qo" in src and f"{out}* __restrict__ Ko" in src
    assert f"{C_TYPE[variant['io_dtype']]}* __restrict__ Q" in src
    if variant["ab_dtype"] is not None:  # A_log and dt_bias each read in its own dtype
        assert f"{C_TYPE[variant['param_dtype']]}* __restrict__ A_log" in src
        assert f"{C_TYPE[variant['bias_dtype']]}* __restrict__ dt_bias" in src
    else:
        assert "A_log" not in src


def test_variants_are_unique_and_named_by_their_dtypes():
    vs = P.kernel_variants(32, 16)
    names = [v["name"] for v in vs]
    assert len(names) == len(set(names)) == 12
    for io, out in (("bfloat16", "bfloat16"), ("bfloat16", "float16"), ("float16", "float16")):
        assert {(v["param_dtype"], v["bias_dtype"]) for v in vs if (v["io_dtype"], v["out_dtype"]) == (io, out)} == {
            ("float32", "float32"), (io, io), ("float32", io), (None, None)}
    # a name says the output dtype only where it differs from q's (older names, older caches)
    assert P.variant(HV, HK, "bfloat16")["name"] == "gdn_prefill_inputs_hk2_bfloat16_qk-only"
    assert P.variant(HV, HK, "bfloat16", out="float16")["name"] == "gdn_prefill_inputs_hk2_bfloat16_to-float16_qk-only"
    # the hopper package lists them for precompile, and its build dispatches them here
    from qla_serve.kernels import hopper
    assert all(v in hopper.kernel_variants(32, 16) for v in vs)
    with pytest.raises(ValueError, match="q_out dtype"):
        P.variant(HV, HK, "bfloat16", out="float32")
    with pytest.raises(ValueError, match="dt_bias dtype"):
        P.variant(HV, HK, "bfloat16", "bfloat16", "float32", "int8")
    with pytest.raises(ValueError, match="num_v_heads"):
        P.variant(6, 4, "bfloat16")


def test_misaligned_q_rejected_before_any_launch():
    """CPU tensors suffice: the stride check reads host metadata before any variant lookup."""
    fused = torch.zeros(5, 2 * HK * 128 + 2, dtype=torch.bfloat16)
    q = fused[:, 2:2 + HK * 128].view(5, HK, 128)  # token stride 514 elements: not a multiple of 4
    k = torch.zeros(5, HK, 128, dtype=torch.bfloat16)
    out = torch.empty(5, HK, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: the prefill input kernel needs"):
        P.prefill_inputs(q, k, None, None, None, None, q_out=out, k_out=out, g_out=None, beta_out=None)
    with pytest.raises(ValueError, match="k: the prefill input kernel needs"):
        P.prefill_inputs(k, q, None, None, None, None, q_out=out, k_out=out, g_out=None, beta_out=None)
