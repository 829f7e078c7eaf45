"""vLLM's Qwen GDN layer on qla_serve: the out-of-tree layer, its custom op, and the per-step plan.

Hook points (vLLM 0.32/0.33 internals, checked by tests/backends/vllm/test_hooks.py):

* ``PluggableLayer.register_oot`` on ``QwenGatedDeltaNetAttention``: our subclass is built
  wherever vLLM builds the GDN layer (Qwen3-Next, Qwen3.5/3.6). With the default backend it is
  the stock layer unchanged; with flashqla its ``_forward_method`` is ours.
* ``get_attn_backend``: with flashqla the layer's KV-cache group gets a metadata builder
  subclass whose ``build`` (once per step per group) turns vLLM's metadata and CPU-side lengths
  into a :class:`qla_serve.backends.gdn_layer.StepPlan`, attached to the metadata object that
  every GDN layer of the group reads. Groups built in the same step (and consecutive steps with
  the same prefill lengths) share one PrefillPlan.
* One custom op, ``torch.ops.vllm.qla_serve_gdn_core`` (``direct_register_custom_op``), holds
  the layer's work between the projections (conv, gating, recurrence, state updates), so
  torch.compile treats it as opaque; it is added to ``CompilationConfig._attention_ops`` (the
  default splitting ops of piecewise CUDA graphs) and wrapped in ``eager_break_during_capture``,
  exactly like vLLM's own ``qwen_gdn_attention_core``.

The state cache is vLLM's, used in place: ``kv_cache[1]`` [blocks, Hv/TP, V, K] (page stride
> slot) and ``kv_cache[0]`` the conv state in either layout; null block 0 is padding.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.config.compilation import CompilationConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

import qla_serve
from qla_serve.backends import gdn_layer
from qla_serve.backends.vllm import _stats
from qla_serve.backends.vllm.plugin import resolve_backend
from qla_serve.plan import cp_from_env

log = logging.getLogger("vllm.qla_serve")  # under vLLM's logger: its handlers and format

OP_NAME = "qla_serve_gdn_core"
LAYER_NAME = "QwenGatedDeltaNetAttention"
SUPPORTED_STATE_DTYPES = (torch.float32, torch.bfloat16)
# Prefill checkpoints land on 64-token chunk boundaries (gdn_prefill's checkpoints; the stock
# layer's FlashInfer alignment is the same 64): docs/vllm_checkpoints.md.
CHECKPOINT_ALIGNMENT = 64


def writes_checkpoints(vllm_config) -> bool:
    """Whether flashqla writes vLLM's align-mode prefill checkpoints here: prefix caching in
    'align' mode, and a prefill path that writes them: the TileLang kernels or the reference
    path, not a forced FLA path (docs/vllm_checkpoints.md)."""
    if getattr(vllm_config.cache_config, "mamba_cache_mode", "none") != "align":
        return False
    device = "cpu" if current_platform.is_cpu() else torch.device("cuda", torch.cuda.current_device())
    try:
        path, _ = qla_serve.explain_path("prefill", device, vllm_config.model_config.dtype)
    except Exception:  # a forced path that cannot run: unsupported_reason reports it
        return False
    return path in ("tilelang", "reference")


# ---------------------------------------------------------------------------------------------
# Start-up checks
# ---------------------------------------------------------------------------------------------

def unsupported_reason(layer, vllm_config) -> str | None:
    """Why flashqla cannot serve this layer in this configuration, or None."""
    if layer.head_k_dim != 128 or layer.head_v_dim != 128:
        return (f"qla_serve kernels need linear key/value head dim 128, the model has "
                f"{layer.head_k_dim}/{layer.head_v_dim}")
    hk, hv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
    if layer.num_k_heads % layer.tp_size or layer.num_v_heads % layer.tp_size or hv % hk:
        return f"GDN heads {layer.num_k_heads}/{layer.num_v_heads} do not split evenly over TP={layer.tp_size}"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA on GDN layers is not supported by flashqla (vLLM builds separate in_proj_qkv/in_proj_z)"
    cache = vllm_config.cache_config
    if getattr(cache, "mamba_cache_mode", "none") not in ("none", "align"):
        return f"mamba_cache_mode={cache.mamba_cache_mode!r} is not supported (only 'none' and 'align')"
    if getattr(cache, "use_replayssm", False):
        return "ReplaySSM (use_replayssm) keeps no per-draft states; flashqla supports vLLM's slot-per-draft layout only"
    state_dtype = layer.get_state_dtype()[1]
    if state_dtype not in SUPPORTED_STATE_DTYPES:
        return f"SSM state dtype {state_dtype} is not supported (float32 or bfloat16; see --mamba-ssm-cache-dtype)"
    dtype = vllm_config.model_config.dtype
    if current_platform.is_cpu():
        return None
    if not current_platform.is_cuda():
        return f"platform {current_platform.device_name!r} is not supported (CUDA GPUs and CPU only)"
    device = torch.device("cuda", torch.cuda.current_device())
    ops = ("prefill", "decode") + (("verify",) if layer.num_spec else ())
    forced = os.environ.get("QLA_SERVE_OP_PATH")
    for op in ops:
        try:
            path, why = qla_serve.explain_path(op, device, dtype)
        except Exception as exc:  # a forced path that cannot run, a bad env value
            return f"{op}: {exc}"
        if path != "tilelang" and not forced:
            return (f"no qla_serve TileLang {op} kernel can run here ({why}); set "
                    f"QLA_SERVE_OP_PATH=fla|reference to run a slower path on purpose")
    return None


# ---------------------------------------------------------------------------------------------
# Metadata -> StepPlan (once per step per KV-cache group)
# ---------------------------------------------------------------------------------------------

class QlaGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN builder plus a :class:`StepPlan` on each metadata object (``.qla_step``)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        text = vllm_config.model_config.hf_text_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.qla_num_v_heads = text.linear_num_value_heads // tp
        self.qla_num_k_heads = text.linear_num_key_heads // tp
        self.qla_conv_width = text.linear_conv_kernel_dim
        self.qla_cp = cp_from_env()  # once per process: a bad $QLA_SERVE_CP fails start-up

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        md.qla_step = self._qla_step(md, common_attn_metadata)
        return md

    def _qla_step(self, md: GDNAttentionMetadata, m) -> gdn_layer.StepPlan:
        qlens = m.query_start_loc_cpu[: m.num_reqs + 1].diff().tolist()
        mask, spec_rows = md.spec_sequence_masks_cpu, []
        if mask is not None:
            spec_rows = mask[: len(qlens)].tolist()
            ns_lens = [n for n, s in zip(qlens, spec_rows) if not s]
        else:
            ns_lens = qlens
        Td = md.num_decodes
        prefill_lens, resumed = (), 0
        if md.num_prefills > 0:
            rows = md.prefill_state_indices.shape[0]
            prefill_lens = tuple(ns_lens[Td:Td + rows])
            if len(prefill_lens) != rows:
                raise RuntimeError(f"qla_serve flashqla: {rows} prefill state indices but "
                                   f"{len(prefill_lens)} prefill lengths in vLLM's metadata")
            seq_cpu = getattr(m, "seq_lens_cpu_upper_bound", None)
            if seq_cpu is not None and mask is None:  # for counters/logs only
                seq = seq_cpu[: m.num_reqs].tolist()[Td:Td + rows]
                resumed = sum(1 for s, n in zip(seq, prefill_lens) if n > 0 and s > n)
        ck_chunks, ck_slots = _prefill_checkpoints(md, Td, len(prefill_lens))
        Ns = md.num_spec_decodes
        mixed_spec = Ns > 0 and (md.num_prefills > 0 or md.num_decodes > 0)
        # vLLM 0.33 orders a step's requests decodes first (model runner V1:
        # v1/attention/backends/utils.py reorder_batch_to_split_decodes_and_prefills; V2:
        # v1/worker/gpu/model_runner.py sort_batch_req_ids, drafted requests first): then its
        # token indices are [0, Ts) and [Ts, T), and the layer takes the rows as views instead of
        # gathering them (gdn_layer._leading_spec_rows). A non-spec request among the spec ones
        # (V1: a decode scheduled with other than its drafts + 1 tokens; V2: a decode without
        # drafts behind a chunk of drafts + 1 tokens; either, with the reorder off under decode
        # context parallelism) interleaves the two kinds: the indices are passed then.
        indexed = mixed_spec and not _spec_rows_lead(spec_rows, Ns)
        # GDN layers may sit in several KV-cache groups (one builder each) that all build in the
        # same step with the same lengths: they share one PrefillPlan through _LAST_STEP.
        key = (prefill_lens, self.qla_num_v_heads, self.qla_num_k_heads, self.qla_conv_width, str(self.device))
        last = _LAST_STEP.get("step") if _LAST_STEP.get("key") == key else None
        step = gdn_layer.make_step_plan(
            num_actual_tokens=md.num_actual_tokens, num_v_heads=self.qla_num_v_heads,
            num_k_heads=self.qla_num_k_heads, conv_width=self.qla_conv_width, device=self.device,
            decode_slots=md.non_spec_state_indices_tensor[:Td] if Td else None,
            prefill_lens=prefill_lens,
            prefill_slots=md.prefill_state_indices if md.num_prefills > 0 else None,
            prefill_has_initial_state=md.prefill_has_initial_state if md.num_prefills > 0 else None,
            spec_slots=md.spec_state_indices_tensor[:Ns] if Ns else None,
            spec_cu_seqlens=md.spec_query_start_loc[: Ns + 1] if Ns else None,
            num_accepted=md.num_accepted_tokens[:Ns] if Ns else None,
            num_spec_tokens=md.num_spec_decode_tokens,
            spec_token_idx=md.spec_token_indx if indexed else None,
            non_spec_token_idx=md.non_spec_token_indx if indexed else None,
            null_slot=NULL_BLOCK_ID,
            cp=self.qla_cp, reuse=last, prefill_checkpoint_chunks=ck_chunks, prefill_checkpoint_slots=ck_slots)
        step.info["resumed_prefills"] = resumed
        if step.prefill_plan is not None:
            if _stats.enabled() and (last is None or last.prefill_plan is not step.prefill_plan):
                _stats.hit("qla:prefill_plans")
            _LAST_STEP.update(key=key, step=step)
        return step


def _spec_rows_lead(spec_rows: list, num_spec: int) -> bool:
    """Whether the step's ``num_spec`` spec requests are its first requests (``spec_rows``: vLLM's
    host mask ``spec_sequence_masks_cpu`` over the step's requests, as bools), so that its spec
    tokens lead the batch."""
    return len(spec_rows) >= num_spec and all(spec_rows[:num_spec]) and not any(spec_rows[num_spec:])


def _prefill_checkpoints(md, num_decodes: int, num_prefill_rows: int):
    """vLLM's prefill checkpoints for the step's prefill rows: (chunks: host ints, slots:
    device block ids), or (None, None). ``md.checkpoint`` has one row per non-spec request,
    decodes first (vllm/v1/attention/backends/gdn_attn.py ~524-529 in 0.32, ~578-583 in
    0.33); each row's offset into its query is a multiple of the declared alignment
    (kv_cache_interface.is_mamba_prefill_checkpoint_valid), its slot the null block where
    vLLM keeps none."""
    ck = getattr(md, "checkpoint", None)
    if ck is None or not num_prefill_rows:
        return None, None
    offsets = ck.offsets if ck.offsets is not None else ck.checkpoint_offsets.tolist()
    rows = list(offsets[num_decodes:num_decodes + num_prefill_rows])
    if not any(rows):
        return None, None
    if any(o % CHECKPOINT_ALIGNMENT for o in rows):
        raise RuntimeError(f"qla_serve flashqla: prefill checkpoint offsets {rows} are not multiples of "
                           f"{CHECKPOINT_ALIGNMENT} tokens (the alignment the layer declared)")
    if _stats.enabled():
        _stats.hit("qla:prefill_checkpoints", sum(1 for o in rows if o))
    return [o // CHECKPOINT_ALIGNMENT for o in rows], ck.state_indices[num_decodes:num_decodes + num_prefill_rows]


_LAST_STEP: dict = {}  # the last step's host-built prefill parts, shared across KV-cache groups


class QlaGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return QlaGDNMetadataBuilder


# ---------------------------------------------------------------------------------------------
# The layer and its custom op
# ---------------------------------------------------------------------------------------------

class QlaQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's Qwen GDN layer; with ``linear_attn_backend=flashqla`` its core runs on qla_serve."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        self.qla_backend = resolve_backend(vllm_config.additional_config)
        if self.qla_backend != "flashqla":
            return
        reason = unsupported_reason(self, vllm_config)
        if reason is not None:
            raise RuntimeError(f"linear_attn_backend=flashqla cannot run layer {self.prefix}: {reason}")
        self._forward_method = self.forward_qla
        # Align-mode prefix caching (vLLM's default for hybrid models): flashqla writes the
        # prefill checkpoints vLLM asks for (docs/vllm_checkpoints.md) where its prefill path
        # can. vLLM 0.33 reads the layer's alignment (qwen_gdn_linear_attn.py ~689-760: the stock
        # layer sets it with its FlashInfer backend only); 0.32 reads the KV-cache spec
        # (get_kv_cache_spec below). Without them the scheduler cuts prefills at block boundaries
        # instead (model_executor/layers/mamba/abstract.py ~98-113).
        self.qla_checkpoints = writes_checkpoints(vllm_config)
        if hasattr(self, "_checkpoint_alignment"):
            self._checkpoint_alignment = CHECKPOINT_ALIGNMENT if self.qla_checkpoints else None
        if not _logged:   # once per process: the paths logged, every kernel built before serving
            _logged.append(True)
            dev = "cpu" if current_platform.is_cpu() else torch.device("cuda", torch.cuda.current_device())
            gdn_layer.ensure_kernels(dev, self.num_v_heads // self.tp_size, self.num_k_heads // self.tp_size,
                                     vllm_config.model_config.dtype, self.get_state_dtype()[1])
            paths = {op: qla_serve.explain_path(op, dev, vllm_config.model_config.dtype)
                     for op in ("prefill", "decode", "verify")}
            level = logging.WARNING if current_platform.is_cpu() else logging.INFO
            log.log(level, "qla_serve flashqla GDN backend active (%s): %s%s", dev,
                    "; ".join(f"{op}: {p} ({why})" for op, (p, why) in paths.items()),
                    " — CPU runs qla_serve's torch reference path, for testing" if current_platform.is_cpu() else "")

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if getattr(self, "qla_backend", None) != "flashqla":
            return spec
        if self.qla_checkpoints and not hasattr(self, "_checkpoint_alignment") \
                and getattr(spec, "num_prefill_checkpoint_blocks", None) == 0:
            # vLLM 0.32: the spec asks the scheduler for one checkpoint block per request
            # (as its Mamba2 and KDA layers do: mamba_mixer2.py ~1107).
            spec = dataclasses.replace(spec, num_prefill_checkpoint_blocks=1,
                                       prefill_checkpoint_alignment=CHECKPOINT_ALIGNMENT)
        elif getattr(spec, "num_prefill_checkpoint_blocks", 0) and not self.qla_checkpoints:
            raise RuntimeError(f"linear_attn_backend=flashqla cannot run layer {self.prefix}: this "
                               "configuration asks GDN layers for mid-prefill state checkpoints, which "
                               "flashqla's prefill path here does not write")
        return spec

    def get_attn_backend(self):
        if getattr(self, "qla_backend", None) == "flashqla":
            return QlaGDNAttentionBackend
        return super().get_attn_backend()

    def forward_qla(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Projections as vLLM's forward_cuda, the core in our custom op, vLLM's output part."""
        num_tokens = hidden_states.size(0)
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:  # Qwen3-Next: interleaved per key-head group
            q, k, v, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            mixed_qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=-1)
        else:  # Qwen3.5: [q, k, v, z] and [b, a]
            qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
            z = z.reshape(num_tokens, -1, self.head_v_dim)
            b, a = self.split_ba(ba)
        core_attn_out = torch.zeros((num_tokens, self.num_v_heads // self.tp_size, self.head_v_dim),
                                    dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.vllm.qla_serve_gdn_core(mixed_qkv, b.contiguous(), a.contiguous(), core_attn_out,
                                          _encode_layer_name(self.prefix))
        return self._output_projection(core_attn_out, z)

    def qla_core(self, mixed_qkv, b, a, core_attn_out) -> None:
        raw = get_forward_context().attn_metadata
        md = raw.get(self.prefix) if isinstance(raw, dict) else None
        if md is None:  # profiling / dummy run: vLLM's layer does no GDN work either
            return
        step = getattr(md, "qla_step", None)
        if step is None:
            raise RuntimeError(f"qla_serve flashqla: layer {self.prefix} got GDN metadata without a "
                               "qla_serve step plan (built by a builder other than QlaGDNMetadataBuilder)")
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        weight = getattr(self.conv1d, "_cpu_unpacked_conv_weight", None)  # CPU packs bf16 weights
        if weight is None:
            weight = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        counting = _stats.enabled()
        gdn_layer.gdn_layer_forward(
            step, mixed_qkv, a, b, conv_weight=weight, conv_bias=self.conv1d.bias,
            activation=self.activation, conv_state=conv_state, ssm_state=self.kv_cache[1],
            A_log=self.A_log, dt_bias=self.dt_bias, num_k_heads=self.num_k_heads // self.tp_size,
            out=core_attn_out, scale=self.head_k_dim ** -0.5,
            on_call=(lambda kind, n: _stats.hit(f"qla:{kind}", n)) if counting else None)
        if counting:
            _stats.hit("qla:calls")
            if step.num_prefills:
                _stats.hit("qla:prefill_layer_calls")
                _stats.hit("qla:resumed_prefill", step.info.get("resumed_prefills", 0))
            if step.num_spec_decodes and step.num_prefills:
                _stats.hit("qla:spec_with_prefill_calls")   # spec and prefill tokens in one step
                if step.spec_token_idx is None:             # the spec requests first: row views
                    _stats.hit("qla:spec_rows_as_views")
            if step.num_spec_decodes and step.num_accepted.device.type == "cpu":
                # Tokens accepted in the previous step (> rows when drafts were accepted).
                _stats.hit("qla:spec_accepted", int(step.num_accepted[: step.num_spec_decodes].sum()))
            _stats.flush()


_logged: list = []


@eager_break_during_capture
def qla_serve_gdn_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       core_attn_out: torch.Tensor, layer_name: LayerNameType) -> None:
    """The custom op: conv + gating + recurrence + state updates of one GDN layer, in place."""
    layer = get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]
    layer.qla_core(mixed_qkv, b, a, core_attn_out)


def install() -> None:
    """Register the layer subclass and the custom op (idempotent; refuses a foreign override)."""
    current = op_registry_oot.get(LAYER_NAME)
    if current is None:
        QwenGatedDeltaNetAttention.register_oot(QlaQwenGatedDeltaNetAttention)
    elif current is not QlaQwenGatedDeltaNetAttention:
        raise RuntimeError(f"qla_serve: {LAYER_NAME} is already replaced by {current.__module__}."
                           f"{current.__qualname__}; two plugins cannot both own the GDN layer")
    if not hasattr(torch.ops.vllm, OP_NAME):
        direct_register_custom_op(op_name=OP_NAME, op_func=qla_serve_gdn_core,
                                  mutates_args=["core_attn_out"])
    # Like vLLM's own GDN core op: a graph split point, so piecewise CUDA graphs never capture
    # the op's host-side logic (prefill planning, index building) and run it eagerly.
    if f"vllm::{OP_NAME}" not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(f"vllm::{OP_NAME}")
