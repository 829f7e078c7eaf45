"""Host time per launch: TileLang's TMA descriptors encoded once per argument list, not per launch.

TileLang's generated host function encodes each of a TMA kernel's tensor maps on every launch
(the global tvm-ffi function ``__tvm_tensormap_create_tiled``, i.e. cuTensorMapEncodeTiled): the
prefill's stage 1 and stage 2 take 4-6 each. A tensor map is a pure function of the encoder's
arguments, and within a serving step every GDN layer's prefill hands the kernels the same step
buffers, so after the step's first layer each encode repeats one made before.
``csrc/tensormap_cache.cc`` wraps the encoder with a memo keyed by its full argument list (a miss
runs TileLang's own checks and encode; see that file for why the copy is exact).

The wrapper is a small C++ library compiled on first use with the host's C++ compiler (``CXX``,
default ``c++``) against the apache-tvm-ffi headers, and kept beside TileLang's kernel cache
(``$TILELANG_CACHE_DIR/qla_serve/``; ``qla-serve precompile`` builds it too). It must be
installed before a kernel's first launch: each compiled kernel looks the encoder up once and
keeps it. ``install()`` runs from ``raw_launch.raw_function``, i.e. before any qla_serve kernel
launches.

``QLA_SERVE_TENSORMAP_CACHE=0`` leaves TileLang's encoder alone. Without a C++ compiler the
wrapper is not built: a RuntimeWarning says so once and the kernels encode per launch, as
TileLang does (correct; only host time is lost).
"""

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

ENCODER = "__tvm_tensormap_create_tiled"
ENV = "QLA_SERVE_TENSORMAP_CACHE"
SOURCE = Path(__file__).with_name("csrc") / "tensormap_cache.cc"

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_STATE: str | None = None      # None until install() ran: "installed", "off" or "unavailable"


def enabled_by_env() -> bool:
    """QLA_SERVE_TENSORMAP_CACHE: 1 (default) or 0; anything else is an error naming it."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 or 1, got {value!r}")
    return value == "1"


def library_path() -> Path:
    """Where the compiled wrapper lives: keyed by its source and the tvm-ffi version."""
    import tvm_ffi
    from tilelang import env

    digest = hashlib.sha256(SOURCE.read_bytes() + tvm_ffi.__version__.encode()).hexdigest()[:16]
    root = Path(os.path.expanduser(str(env.TILELANG_CACHE_DIR)))
    return root / "qla_serve" / f"tensormap_cache-{digest}.so"


def build(path: Path | None = None) -> Path:
    """Compile the wrapper to ``path`` (default ``library_path()``) unless it is there already.
    Raises RuntimeError with the compiler's output when the build fails, FileNotFoundError when
    there is no compiler."""
    from tvm_ffi import libinfo

    path = path or library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lib = Path(libinfo.find_libtvm_ffi())
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-I{libinfo.find_include_path()}", f"-I{libinfo.find_dlpack_include_path()}",
               str(SOURCE), "-o", str(out), f"-L{lib.parent}", "-ltvm_ffi", f"-Wl,-rpath,{lib.parent}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"qla_serve: building {SOURCE.name} failed ({' '.join(cmd)}):\n"
                               f"{proc.stdout}{proc.stderr}")
        os.replace(out, path)    # atomic: concurrent builders (precompile -j) all end with one file
    return path


def _load(path: Path) -> ctypes.CDLL:
    import tvm_ffi  # noqa: F401  (libtvm_ffi loaded first, so the wrapper binds to that copy)

    lib = ctypes.CDLL(str(path))
    lib.qla_tensormap_cache_install.argtypes = [ctypes.c_char_p]
    lib.qla_tensormap_cache_install.restype = ctypes.c_int
    lib.qla_tensormap_cache_stats.argtypes = [ctypes.c_char_p] + [ctypes.POINTER(ctypes.c_int64)] * 3
    lib.qla_tensormap_cache_stats.restype = ctypes.c_int
    lib.qla_tensormap_cache_enable.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.qla_tensormap_cache_enable.restype = ctypes.c_int
    return lib


def wrap(name: str, path: Path | None = None) -> ctypes.CDLL:
    """Wrap the global tvm-ffi function ``name`` with the memo (idempotent); the loaded library.
    ``install()`` wraps TileLang's encoder; tests wrap a stand-in."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            _LIB = _load(build(path))
        rc = _LIB.qla_tensormap_cache_install(name.encode())
    if rc < 0:
        raise RuntimeError(f"qla_serve: cannot wrap the tvm-ffi global {name!r} "
                           f"({'not registered' if rc == -1 else 'tvm-ffi refused the wrapper'})")
    return _LIB


def install() -> str:
    """Put the memo in front of TileLang's TMA encoder, once per process. Returns "installed",
    "off" (QLA_SERVE_TENSORMAP_CACHE=0) or "unavailable" (no C++ compiler or a failed build:
    warned once; kernels then encode per launch)."""
    global _STATE
    if _STATE is not None:
        return _STATE
    if not enabled_by_env():
        _STATE = "off"
        return _STATE
    import tilelang  # noqa: F401  (registers the encoder)

    try:
        wrap(ENCODER)
        _STATE = "installed"
    except (OSError, RuntimeError) as e:
        warnings.warn(f"qla_serve: TMA descriptor memo not available, TileLang encodes them on every "
                      f"launch (more host time per prefill launch, results unchanged): {e}. Set {ENV}=0 "
                      "to skip this attempt.", RuntimeWarning, stacklevel=2)
        _STATE = "unavailable"
    return _STATE


def stats(name: str = ENCODER) -> dict | None:
    """{"hits", "misses", "entries"} of the memo on ``name``; None when it is not wrapped."""
    if _LIB is None:
        return None
    vals = [ctypes.c_int64() for _ in range(3)]
    if _LIB.qla_tensormap_cache_stats(name.encode(), *[ctypes.byref(v) for v in vals]) != 0:
        return None
    return dict(zip(("hits", "misses", "entries"), (v.value for v in vals)))


def set_enabled(on: bool, name: str = ENCODER) -> None:
    """Turn the installed memo off (every launch encodes; also empties it) or on: A/B runs, tests."""
    if _LIB is None or _LIB.qla_tensormap_cache_enable(name.encode(), int(on)) != 0:
        raise RuntimeError(f"qla_serve: no TMA descriptor memo on {name!r} to switch")
