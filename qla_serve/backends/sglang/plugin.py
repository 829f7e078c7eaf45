"""SGLang plugin: ``--linear-attn-backend flashqla`` through SGLang's own plugin hooks.

Entry point (group ``sglang.srt.plugins``): :func:`register`. SGLang runs it in every process
that calls ``sglang.srt.plugins.load_plugins()`` (server, scheduler/TP workers, detokenizer),
before arguments are parsed. It

1. adds ``flashqla`` to ``--linear-attn-backend``, ``--linear-attn-prefill-backend``,
   ``--linear-attn-decode-backend`` (SGLang's ``add_linear_attn_kernel_backend_choices``) and
   to ``--linear-attn-verify-backend`` (whose choice list SGLang copies when its field
   annotations are first evaluated: :func:`_add_verify_choice` extends that copy too);
2. registers :class:`~sglang.srt.plugins.hook_registry.HookRegistry` hooks (no SGLang file is
   edited):

   * AROUND ``GDNAttnBackend.__init__``: start-up checks (:func:`startup_problems`) — any
     problem is a ``ValueError`` with the reason, before a kernel exists; never a fallback.
   * AROUND ``GDNKernelDispatcher.__init__``: SGLang maps an unknown backend name to
     ``LinearAttnKernelBackend.CUSTOM`` and its dispatcher raises on it, so the hook runs the
     stock constructor with ``triton`` in place of ``flashqla`` and then points
     ``decode_kernel`` / ``extend_kernel`` / ``verify_kernel`` at one
     :class:`~.kernel.FlashQLAGDNKernel` for the phases that asked for flashqla.
   * AROUND ``GDNAttnBackend.init_forward_metadata``: after SGLang builds its per-batch
     metadata, plan the extend batch once from host lengths (``extend_seq_lens_cpu``, and under
     the extra_buffer radix cache the per-request snapshot chunks from SGLang's own host track
     plan), attach it to the metadata (``forward_metadata.qla_extend``) and bind it to the kernel.
   * AROUND ``GDNAttnBackend.forward_decode``: with flashqla's decode, a step whose ``mixed_qkv``
     is one tensor runs its conv too on qla_serve's layer (:mod:`.decode_layer`: the conv and
     the decode as the vLLM adapter runs them, measured 2-3x faster per layer call at small
     batches than SGLang's conv before flashqla's decode); Qwen3.5's fused-projection tuple goes
     to SGLang's own forward_decode (its fused split + conv, then the kernel class's decode with
     the batch's slot ids derived once), ReplaySSM steps untouched
     (``QLA_SERVE_SGLANG_DECODE_CONV=0``: every step SGLang's conv).
   * AROUND ``GDNAttnBackend.forward_extend``: with flashqla's extend, a plain extend step (planned
     from host lengths, ``mixed_qkv`` one tensor, no extra_buffer tracking, contiguous pools) runs
     its conv, split and gating on qla_serve's layer too (:mod:`.extend_layer`: measured
     0.64-0.78x the GPU time of SGLang's conv, split and gating before flashqla's kernel); other
     extends (target verify, multi-item scoring, tracked batches) go to SGLang's forward_extend
     (``QLA_SERVE_SGLANG_EXTEND_CONV=0``: every extend SGLang's conv). With flashqla's verify,
     a linear-chain target verify runs its conv on qla_serve's too (:mod:`.verify_layer`: the
     conv's per-draft windows into SGLang's intermediate conv cache, then gdn_verify;
     ``QLA_SERVE_SGLANG_VERIFY_CONV=0``: SGLang's conv).

Phase selection follows SGLang's flags: ``--linear-attn-decode-backend`` /
``--linear-attn-prefill-backend`` override ``--linear-attn-backend``. Verify: an explicit
``--linear-attn-verify-backend`` wins; unset, verify follows a flashqla decode (SGLang's own rule
sends unset verify to triton except for flashinfer; flashqla asks for flashqla everywhere).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("qla_serve.sglang")

BACKEND = "flashqla"
SUPPORTED_SGLANG = "0.5.23"

GDN_BACKEND = "sglang.srt.layers.attention.linear.gdn_backend"
TARGET_BACKEND_INIT = f"{GDN_BACKEND}.GDNAttnBackend.__init__"
TARGET_DISPATCHER_INIT = f"{GDN_BACKEND}.GDNKernelDispatcher.__init__"
TARGET_METADATA = f"{GDN_BACKEND}.GDNAttnBackend.init_forward_metadata"
TARGET_FORWARD_DECODE = f"{GDN_BACKEND}.GDNAttnBackend.forward_decode"
TARGET_FORWARD_EXTEND = f"{GDN_BACKEND}.GDNAttnBackend.forward_extend"
ENV_DECODE_CONV = "QLA_SERVE_SGLANG_DECODE_CONV"
ENV_EXTEND_CONV = "QLA_SERVE_SGLANG_EXTEND_CONV"
ENV_VERIFY_CONV = "QLA_SERVE_SGLANG_VERIFY_CONV"
CONV_ENV = {"decode": ENV_DECODE_CONV, "extend": ENV_EXTEND_CONV, "verify": ENV_VERIFY_CONV}
# Whether flashqla's decode / extend / verify takes SGLang's conv over (decode_layer.py,
# extend_layer.py, verify_layer.py), per step: its CONV_ENV variable, 1 (default) or 0 (SGLang's
# conv, then flashqla's kernel: the route before, for A/B, benchmarks/layer.md, or as a way back).
# Read once per process (a step missing: not yet read); the start-up checks refuse another value.
TAKE_OVER_CONV: dict[str, bool] = {}

_registered = False


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Idempotent."""
    global _registered
    if _registered:
        return
    import sglang
    from sglang.srt.arg_groups.choices import add_linear_attn_kernel_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SUPPORTED_SGLANG:
        # Private internals are hooked; an unknown version may break them in silence.
        log.warning("qla_serve's SGLang plugin supports sglang==%s, found %s: the start-up checks "
                    "still run, but the hooked internals may have moved", SUPPORTED_SGLANG,
                    sglang.__version__)
    add_linear_attn_kernel_backend_choices([BACKEND])
    _add_verify_choice()
    HookRegistry.register(TARGET_BACKEND_INIT, _backend_init_hook, HookType.AROUND)
    HookRegistry.register(TARGET_DISPATCHER_INIT, _dispatcher_init_hook, HookType.AROUND)
    HookRegistry.register(TARGET_METADATA, _init_forward_metadata_hook, HookType.AROUND)
    HookRegistry.register(TARGET_FORWARD_DECODE, _forward_decode_hook, HookType.AROUND)
    HookRegistry.register(TARGET_FORWARD_EXTEND, _forward_extend_hook, HookType.AROUND)
    _registered = True


def _add_verify_choice() -> None:
    """``--linear-attn-verify-backend`` takes ``CHOICES + ["nv_cutedsl"]``, a new list made when
    ``ExecMamba``'s annotations are evaluated; if that already happened, extend that list."""
    import typing

    from sglang.srt.arg_groups.fields.exec_ import ExecMamba

    hint = typing.get_type_hints(ExecMamba, include_extras=True)["linear_attn_verify_backend"]
    for meta in getattr(hint, "__metadata__", ()):
        choices = getattr(meta, "choices", None)
        if isinstance(choices, list) and BACKEND not in choices:
            choices.append(BACKEND)


# ---------------------------------------------------------------------------------------------
# Which phases asked for flashqla
# ---------------------------------------------------------------------------------------------

def requested_phases(mamba=None) -> dict[str, bool]:
    """{"decode", "prefill", "verify"} -> whether that phase asked for flashqla.

    ``mamba`` is SGLang's ``get_exec().mamba`` view (raw flag strings: an unknown name is
    ``CUSTOM`` in SGLang's enum, so the enum cannot tell flashqla apart).
    """
    if mamba is None:
        from sglang.srt.runtime_context import get_exec
        mamba = get_exec().mamba
    base = mamba.linear_attn_backend
    decode = mamba.linear_attn_decode_backend or base
    prefill = mamba.linear_attn_prefill_backend or base
    verify = mamba.linear_attn_verify_backend
    if verify is None:
        verify = decode if decode == BACKEND else None
    return {"decode": decode == BACKEND, "prefill": prefill == BACKEND, "verify": verify == BACKEND}


# ---------------------------------------------------------------------------------------------
# Start-up checks
# ---------------------------------------------------------------------------------------------

def startup_problems(phases: dict[str, bool], *, ssm_shape, ssm_dtype, device) -> list[str]:
    """Reasons flashqla cannot run as requested (empty: fine). Host metadata only.

    ssm_shape: the mamba pool's temporal state shape [layers, size+1, Hv, V, K].
    """
    from sglang.srt.runtime_context import get_spec

    import qla_serve.ops as ops

    spec = get_spec()
    # Verify runs only under speculative decoding: without it, a flashqla verify (implied by a
    # flashqla decode) is never called and must not block start-up.
    wanted = [p for p, on in phases.items() if on and (p != "verify" or spec.speculative_algorithm)]
    if not wanted:
        return []
    problems = []
    flag = "--linear-attn-backend flashqla"
    for phase, name in (("decode", ENV_DECODE_CONV), ("prefill", ENV_EXTEND_CONV), ("verify", ENV_VERIFY_CONV)):
        if phase in wanted:   # (the prefill phase's steps are SGLang's extends)
            try:
                conv_takeover_from_env(name)
            except ValueError as exc:
                problems.append(str(exc))
    if len(ssm_shape) != 5 or tuple(ssm_shape[-2:]) != (128, 128):
        problems.append(f"{flag}: qla_serve's GDN kernels need key/value head dim 128; this model's "
                        f"state pool is {list(ssm_shape)} ([layers, slots, Hv, V, K])")
    if ssm_dtype not in (torch.float32, torch.bfloat16):
        problems.append(f"{flag}: --mamba-ssm-dtype must be float32 or bfloat16, got {ssm_dtype}")
    topk = spec.speculative_eagle_topk or 0
    if "verify" in wanted and topk > 1:
        problems.append(f"--linear-attn-verify-backend flashqla: tree drafts (--speculative-eagle-topk "
                        f"{topk}) are not supported (SGLang would run them on Triton); use topk 1 or "
                        "--linear-attn-verify-backend triton")
    if "prefill" in wanted and _full_prefill_graph():
        problems.append("--cuda-graph-backend-prefill full: SGLang would replay a whole-forward prefill graph "
                        "captured with one batch's flashqla prefill plan (grid, segments) for other batches; "
                        "use --cuda-graph-backend-prefill breakable (SGLang's default on CUDA: GDN layers run "
                        "eagerly between graph segments, planned per batch) or disabled, or "
                        "--linear-attn-prefill-backend triton")
    device = torch.device(device)
    op_of = {"decode": "decode", "prefill": "prefill", "verify": "verify"}
    for phase in wanted:
        try:
            path, why = ops.explain_path(op_of[phase], device)
        except (RuntimeError, ValueError) as exc:  # a forced QLA_SERVE_OP_PATH that cannot run
            problems.append(f"flashqla {phase}: {exc}")
            continue
        # On a GPU only qla_serve's TileLang kernels count; the FLA / reference paths run only
        # when the operator forces them with QLA_SERVE_OP_PATH (then it is their choice).
        if device.type == "cuda" and path != "tilelang" and os.environ.get("QLA_SERVE_OP_PATH", "auto") == "auto":
            tl_why = _tilelang_reason(ops, op_of[phase], device)
            problems.append(f"flashqla {phase}: no qla_serve TileLang kernel on {device} ({tl_why}); "
                            "pick another --linear-attn-*-backend for this phase, or set "
                            "QLA_SERVE_OP_PATH=fla|reference to run qla_serve's slower paths on purpose")
    return problems


def conv_takeover_from_env(name: str, environ=None) -> bool:
    """``$QLA_SERVE_SGLANG_DECODE_CONV`` / ``_EXTEND_CONV`` / ``_VERIFY_CONV`` (``name``): 1 (the
    default) or 0; another value is a ValueError naming the variable, never a silent default."""
    value = (os.environ if environ is None else environ).get(name, "1").strip()
    if value not in ("0", "1"):
        step = next(k for k, v in CONV_ENV.items() if v == name)
        raise ValueError(f"{name}: expected 1 (flashqla's {step} runs SGLang's {step} conv too) "
                         f"or 0 (SGLang's conv, then flashqla's {step}), got {value!r}")
    return value == "1"


def _take_over_conv(step: str) -> bool:
    """TAKE_OVER_CONV[step] ("decode", "extend", "verify"), read from CONV_ENV[step] on first use."""
    hit = TAKE_OVER_CONV.get(step)
    if hit is None:
        hit = TAKE_OVER_CONV[step] = conv_takeover_from_env(CONV_ENV[step])
    return hit


def _full_prefill_graph() -> bool:
    """Whether SGLang's published CUDA-graph config captures prefill as one whole-forward graph
    (``--cuda-graph-backend-prefill full``). Its default, breakable, breaks out of the graph at
    each GDN layer (GDNAttnBackend keeps SGLang's ``supports_prefill_graph_extend() -> False``)
    and re-runs ``init_forward_metadata`` per replay, which the metadata hook plans from."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

    return check_cuda_graph_backend(Phase.PREFILL, Backend.FULL)


def _tilelang_reason(ops, op: str, device) -> str:
    """Why qla_serve's TileLang path does not run ``op`` on this CUDA device."""
    mod = ops.kernel_module(ops.device_arch(device))
    if isinstance(mod, str):
        return mod
    if not hasattr(mod, op):
        return f"{mod.__name__} has no {op} kernel"
    return f"{mod.__name__}.{op} exists but another path was chosen"


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------

def _verify_flag():
    from sglang.srt.runtime_context import get_exec
    return get_exec().mamba.linear_attn_verify_backend


def _backend_init_hook(original, self, model_runner, *args, **kwargs):
    phases = requested_phases()
    if any(phases.values()):
        temporal = model_runner.req_to_token_pool.mamba_pool.mamba_cache.temporal
        problems = startup_problems(phases, ssm_shape=tuple(temporal.shape), ssm_dtype=temporal.dtype,
                                    device=model_runner.device)
        if problems:
            raise ValueError("qla_serve (SGLang --linear-attn-backend flashqla) cannot start:\n  - "
                             + "\n  - ".join(problems))
        _ensure_kernels(model_runner, temporal)
    return original(self, model_runner, *args, **kwargs)


def _ensure_kernels(model_runner, temporal) -> None:
    """Every TileLang kernel flashqla can run here, built before serving (on a GPU): the TP-local
    heads from the state pool (Hv) and the model config (Hk over SGLang's linear-attention TP
    group), the model dtype and the pool's (backends/gdn_layer.ensure_kernels)."""
    if torch.device(model_runner.device).type != "cuda":
        return
    from sglang.srt.runtime_context import linear_attn_tp_size

    from qla_serve.backends import gdn_layer
    hk = model_runner.model_config.hf_text_config.linear_num_key_heads // linear_attn_tp_size()
    gdn_layer.ensure_kernels(model_runner.device, int(temporal.shape[2]), hk, model_runner.model_config.dtype,
                             temporal.dtype)


def _dispatcher_init_hook(original, self, decode_backend, prefill_backend, verify_backend=None):
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    requested = requested_phases()
    # A phase is ours when its flag says flashqla and SGLang's enum could not place the name
    # (CUSTOM); an unset verify flag follows a flashqla decode (resolve_linear_attn_backends
    # turned it into triton by then).
    phases = {
        "decode": requested["decode"] and decode_backend.is_custom(),
        "prefill": requested["prefill"] and prefill_backend.is_custom(),
        "verify": requested["verify"] and (verify_backend is None or verify_backend.is_custom()
                                           or _verify_flag() is None),
    }
    if not any(phases.values()):
        return original(self, decode_backend, prefill_backend, verify_backend)
    triton = LinearAttnKernelBackend.TRITON
    # The stock constructor builds the Triton kernel (tree verify always uses it) and every
    # other flag; flashqla phases are handed triton there and replaced right after.
    original(self, triton if phases["decode"] else decode_backend,
             triton if phases["prefill"] else prefill_backend,
             triton if phases["verify"] else verify_backend)
    from .kernel import FlashQLAGDNKernel

    kernel = FlashQLAGDNKernel(tuple(p for p, on in phases.items() if on))
    if phases["decode"]:
        self.decode_kernel = kernel
        self.supports_packed_decode = False
    if phases["prefill"]:
        self.extend_kernel = kernel
    if phases["verify"]:
        self.verify_kernel = kernel
        self.verify_kernel_is_flashinfer = False
    self.qla_kernel = kernel
    log.info("qla_serve flashqla GDN kernels: decode=%s extend=%s verify=%s",
             type(self.decode_kernel).__name__, type(self.extend_kernel).__name__,
             type(self.verify_kernel).__name__)


def _init_forward_metadata_hook(original, self, forward_batch, *args, **kwargs):
    result = original(self, forward_batch, *args, **kwargs)
    kernel = getattr(self.kernel_dispatcher, "qla_kernel", None)
    if kernel is not None and self.kernel_dispatcher.extend_kernel is kernel:
        batch = plan_extend_batch(self, forward_batch)
        self.forward_metadata.qla_extend = batch
        kernel.bind_batch(batch)
    return result


def _forward_decode_hook(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """flashqla's decode with SGLang's decode conv taken over (decode_layer.forward_decode) where
    the step is plain: ``mixed_qkv`` one tensor and no ReplaySSM ring (refused with custom backends
    by SGLang itself; checked all the same). Qwen3.5's fused-projection tuple keeps SGLang's fused
    split + conv, its decode taking the batch's slot ids derived once (decode_layer.step_ids)."""
    kernel = getattr(self.kernel_dispatcher, "qla_kernel", None)
    if kernel is None or self.kernel_dispatcher.decode_kernel is not kernel \
            or self.forward_metadata.replayssm_write_pos is not None:
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    from . import decode_layer
    if _take_over_conv("decode") and isinstance(mixed_qkv, torch.Tensor):
        return decode_layer.forward_decode(self, layer, forward_batch, mixed_qkv, a, b)
    kernel.bind_decode_ids(*decode_layer.step_ids(self, layer))
    return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)


def _forward_extend_hook(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """flashqla's extend and target verify with SGLang's conv (and for extend its split and
    gating) taken over where the step is plain; every other step: SGLang's forward_extend.

    Extend (extend_layer.forward_extend): planned from host lengths by the metadata hook (so not
    a verify or multi-item scoring), ``mixed_qkv`` one tensor, no extra_buffer tracking (SGLang
    copies conv windows before its conv and reads the kernel's state snapshot), contiguous pools
    (SGLang gathers a page-major envelope pool into copies). Target verify
    (verify_layer.forward_verify): flashqla's verify kernel, a linear draft chain (no
    ``retrieve_parent_token``), no multi-item scoring, SGLang's per-draft intermediate caches
    (not ReplaySSM's rings)."""
    kernel = getattr(self.kernel_dispatcher, "qla_kernel", None)
    if kernel is None or not isinstance(mixed_qkv, torch.Tensor):
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    meta = self.forward_metadata
    if forward_batch.forward_mode.is_target_verify():
        if self.kernel_dispatcher.verify_kernel is kernel and _take_over_conv("verify") \
                and meta.retrieve_parent_token is None and self.mis_metadata is None:
            cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
            if getattr(cache, "intermediate_ssm", None) is not None \
                    and getattr(cache, "replayssm_rawv", None) is None and getattr(cache, "replayssm_d", None) is None:
                from . import verify_layer
                return verify_layer.forward_verify(self, layer, forward_batch, mixed_qkv, a, b, cache)
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    batch = getattr(meta, "qla_extend", None)
    if self.kernel_dispatcher.extend_kernel is not kernel or batch is None \
            or batch.query_start_loc is not meta.query_start_loc or not _take_over_conv("extend") \
            or meta.has_mamba_track_mask:
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    if not (cache.conv[0].is_contiguous() and cache.temporal.is_contiguous()):
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    from . import extend_layer
    return extend_layer.forward_extend(self, layer, forward_batch, mixed_qkv, a, b, batch, cache,
                                       output=kwargs.get("linear_attn_output"))


def plan_extend_batch(backend, forward_batch):
    """Once per forward batch: the host lengths of a plain extend (None for other modes).

    The PrefillPlan itself is built by the first GDN layer that runs (it needs the TP-local
    head counts, which the layer's tensors carry) and cached on this object, which lives on the
    forward metadata: every later layer of the step reuses it.
    """
    from .kernel import ExtendBatch

    mode = forward_batch.forward_mode
    meta = backend.forward_metadata
    if not mode.is_extend() or mode.is_target_verify() or getattr(backend, "mis_metadata", None) is not None:
        return None
    lens = forward_batch.extend_seq_lens_cpu
    qsl = meta.query_start_loc
    if lens is None or qsl is None or len(lens) != qsl.shape[0] - 1:
        return None  # the kernel plans from query_start_loc itself, with a logged warning
    lens = tuple(int(n) for n in lens)
    batch = ExtendBatch(query_start_loc=qsl, seq_lens=lens, num_tokens=sum(lens), cp=_cp())
    if meta.has_mamba_track_mask and backend._has_cpu_prefill_track_metadata(forward_batch):
        # extra_buffer prefix tracking: the same host plan SGLang builds its track indices from,
        # so the kernel knows where to cut each request without reading track_chunk_idx.
        from sglang.srt.layers.attention.mamba.prefill_track_metadata import build_prefill_track_plan

        tp = build_prefill_track_plan(
            list(forward_batch.mamba_prefill_track_mask_cpu), list(forward_batch.mamba_track_seqlens_cpu),
            list(lens), list(forward_batch.extend_prefix_lens_cpu), backend.mamba_chunk_size, mamba2=False)
        batch.track_chunks = tuple(int(c) for c in tp.chunk_indices)
        batch.chunk_size = backend.mamba_chunk_size
    return batch


_CP = None


def _cp() -> str:
    global _CP
    if _CP is None:
        from qla_serve.plan import cp_from_env
        _CP = cp_from_env()
    return _CP
