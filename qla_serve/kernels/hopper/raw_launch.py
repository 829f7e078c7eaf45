"""The raw launch function of a compiled TileLang kernel (tvm_ffi execution backend).

``JITKernel.__call__`` / ``torch_function`` run a Python loop per launch (argument count,
output allocation, dynamic-shape bookkeeping, a per-device executable lookup) before calling
the kernel's host function; qla_serve's kernels allocate nothing and take every argument
positionally, so calling the host function directly is the same launch without 2.5-3.5 µs of
Python per launch (H200 host, benchmarks/launch_host.py; benchmarks/prefill.md v20). The host
function itself still checks every argument's dtype, shape, strides and device, and takes the
CUDA stream from torch's current stream, exactly as through the adapter.
"""

import warnings

from . import host_cache


def raw_function(kernel, name: str):
    """``kernel``'s host function (a tvm_ffi Function) for positional launches.

    A kernel TileLang loaded from its disk cache holds a loaded module (``adapter.executable``);
    a fresh compile holds an executable to link first (``jit()``). These are tilelang 0.1.12
    internals: where they are missing, the adapter's own callable (the same kernel, more host
    time per launch) with a RuntimeWarning naming the kernel, never an error. The TMA descriptor
    memo (host_cache.py) is installed first, before this kernel can launch.
    """
    host_cache.install()
    try:
        exe = kernel.adapter.get_exportable_executable()
        mod = exe.jit() if hasattr(type(exe), "jit") else exe
        return mod.main
    except AttributeError:
        warnings.warn(f"qla_serve {name}: TileLang's host function not found; using the adapter "
                      "callable (correct, but ~3 µs more host time per launch)", RuntimeWarning)
        return kernel.torch_function
