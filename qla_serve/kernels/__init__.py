"""GDN kernels behind qla_serve.ops, one module per implementation path.

* ``reference.py``     torch reference (CPU and GPU): the per-token recurrence (the truth) and
                       the chunked form the TileLang kernels follow.
* ``hopper/``          TileLang kernels for sm_90a.
* ``blackwell/``       TileLang kernels for sm_100a.
* ``fla_fallback.py``  FLA's Triton ops on other CUDA GPUs.

Every kernel module implements these functions (ops.py validates and allocates first; the FLA
fallback only prefill and decode, ops.FLA_OPS: the others take the reference path there)::

    prefill(q, k, v, g, beta, pool, slot_ids, plan, *, has_initial_state, scale, out)
    prefill_inputs(q, k, a, b, A_log, dt_bias, *, q_out, k_out, g_out, beta_out)
    decode(q, k, v, pool, slot_ids, *, g, beta, a, b, A_log, dt_bias, use_qk_l2norm, scale, out,
           after_conv=False)    # after_conv: see hopper/decode.decode (a launch form only)
    verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, *, g, beta,
           a, b, A_log, dt_bias, use_qk_l2norm, scale, out, after_conv=False)   # (as decode's)

and a TileLang module also ``kernel_variants(num_v_heads, num_k_heads) -> list[dict]`` and
``build(variant, target)`` so deployments can compile every variant ahead of time.
"""
