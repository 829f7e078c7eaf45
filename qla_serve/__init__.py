"""qla_serve: Gated DeltaNet linear attention for LLM serving.

Public API (DESIGN.md)::

    plan = qla_serve.plan_prefill(seq_lens, num_v_heads, num_k_heads, device=..., cp="auto")
    q, k, g, beta = qla_serve.gdn_prefill_inputs(q_raw, k_raw, a, b, A_log, dt_bias,
                                                 qk_dtype=qla_serve.prefill_qk_dtype(q_raw))
    o = qla_serve.gdn_prefill(q, k, v, g, beta, pool, slot_ids, plan, has_initial_state=...)
    o = qla_serve.gdn_decode(q, k, v, pool, slot_ids, a=..., b=..., A_log=..., dt_bias=...)
    o = qla_serve.gdn_verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, ...)
    qla_serve.commit_verified(pool, slot_ids, intermediate, intermediate_ids, num_accepted)
"""

from qla_serve.ops import (commit_verified, explain_path, gdn_decode, gdn_prefill, gdn_prefill_inputs, gdn_verify,
                           prefill_qk_dtype)
from qla_serve.plan import PrefillPlan, plan_prefill
from qla_serve.state import PoolView, StatePool, StatePoolError

__version__ = "0.1.0"

__all__ = [
    "PoolView", "PrefillPlan", "StatePool", "StatePoolError", "commit_verified", "explain_path",
    "gdn_decode", "gdn_prefill", "gdn_prefill_inputs", "gdn_verify", "plan_prefill", "prefill_qk_dtype",
    "__version__",
]
