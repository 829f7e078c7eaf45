"""A step's later GDN layers replay the launches that its earlier ones recorded.

Every GDN layer of an engine step makes the same launches: the same kernels, the step's own
tensors (slot ids, plan tables, scratch buffers) and the layer's tensors (its inputs, its
weights, its state caches, and row views of them) in the same argument positions. Past the
checks (gdn_layer's layer key), what the ops' host code still does per layer call (path
dispatch, variant lookups, tile picks, alignment checks, argument lists: ~17-36 us of a later
layer call's ~35-80 on the CPU machine, benchmarks/layer.md) gives the same answer every time.
So, per step and layer key:

1. the key's first call runs the ops and records what they launch (qla_serve.launch_record);
   on a step's first layer, gdn_layer runs the checks and makes the step's slot ids and
   buffers before the record, so that it holds the launches alone, as a later layer's does;
2. the next call records again, on other layer tensors (not the same objects: a caller that
   runs one layer over and over waits, and gives up after a few tries), under a torch-call
   watcher unless the watcher already found that launch sequence clean in this process. The
   recording holds if the ops dispatched every op to the TileLang path, ran no torch op other
   than metadata reads and views, launched the same functions both times, and each launch
   argument is, in both calls alike, one of the call's *sources* (its tensor arguments and the
   row views the layer made of them, by identity), or the same object or a view of the same
   memory sharing no storage with the call's layer tensors (the step's own tensors), or the
   same scalar. Otherwise (an op off the TileLang path, a torch op a replay would skip, a view
   of a layer tensor made inside the ops, an object that differs between the calls) this key
   is never replayed in this step;
3. every later call with the same key replays: the recorded functions on its own sources.

Nothing of a layer call outlives it but the step's own tensors and weak references (a step
must not hold a layer's activations: the engines budget their memory without it).

The key is the layer key: dtypes, shapes, strides, devices, addresses modulo 16 and scalars,
what every check and every host decision of the ops reads. What a replay skips is host code only;
the launches are those the ops would make (tests/kernels/test_layer_replay.py compares them
argument by argument, for every kind of step).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import weakref

import torch
from torch.overrides import TorchFunctionMode

from qla_serve import launch_record

log = logging.getLogger("qla_serve")

# torch calls the ops' host code may make inside a recorded call: metadata reads and views
# (their results are arguments, classified like any other)
_HOST_METADATA = frozenset({"__get__", "stride", "size", "dim", "data_ptr", "element_size", "storage_offset",
                            "is_contiguous", "numel", "view"})
_SOURCE, _CONST = 0, 1
_REFUSED = "refused"
_MAX_TRIES = 3          # second recordings whose layer tensors repeat the first's before giving up
_logged: set = set()
# Launch sequences (_shape) whose recording the torch-call watcher found clean in this process:
# later steps record them without it (the watcher costs ~80-130 us a step on the CPU machine).
# The shape holds the launch functions themselves, so none of them is freed and its id reused.
_CLEAN: set = set()
_CLEAN_MAX = 4096


class _TorchCalls(TorchFunctionMode):
    """Names of the torch calls made by the host code (not by a raw launch's argument conversion
    or an engine's callback) beyond metadata reads and views."""

    def __init__(self):
        super().__init__()
        self.others: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not launch_record.in_raw_launch():
            name = getattr(func, "__name__", None)
            if name not in _HOST_METADATA:
                self.others.append(name or repr(func))
        return func(*args, **(kwargs or {}))


def _location(t: torch.Tensor) -> tuple:
    """Where a tensor's elements start: its storage (the C++ object, which every view of it
    shares; ``_base`` is not set for every view: ``view(dtype)`` of a bool tensor) and address."""
    return t.untyped_storage()._cdata, t.data_ptr()


def _view(t: torch.Tensor) -> tuple:
    return (*_location(t), t.shape, t.stride(), t.dtype, t.device)


def _template(events: list, sources: tuple, layer_tensors: tuple):
    """A record as [("launch", fn, ((_SOURCE, j) | (_CONST, arg), ...)) | ("part", kind, count)],
    or a string saying why it cannot be replayed."""
    where = {}
    for j, t in enumerate(sources):
        if t is not None:
            where.setdefault(id(t), j)
    layer_storages = {t.untyped_storage()._cdata for t in layer_tensors if t is not None}
    out = []
    for ev in events:
        if ev[0] == "dispatch":
            if ev[2] != "tilelang":
                return f"{ev[1]} ran on the {ev[2]} path"
        elif ev[0] == "launch":
            args = tuple((_SOURCE, where[id(a)]) if id(a) in where else (_CONST, a) for a in ev[2])
            for i, (kind, a) in enumerate(args):
                if kind == _CONST and isinstance(a, torch.Tensor) and a.untyped_storage()._cdata in layer_storages:
                    return f"argument {i} of a launch is a view of a layer tensor that the layer did not make"
            out.append(("launch", ev[1], args))
        else:
            out.append(ev)
    return out


def _shape(template: list) -> tuple:
    """What a record's host code did, as far as its launches show: the launch functions (the
    kernel variants: the code path that picked them) with their argument kinds, and the parts."""
    return tuple((ev[1], tuple(kind if kind == _SOURCE else type(a) for kind, a in ev[2])) if ev[0] == "launch"
                 else ev for ev in template)


def _same_const(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _view(a) == _view(b)
    return type(a) is type(b) and a == b


def _merge(first: list, second: list):
    """The replay of two templates of one key, or a string saying where they differ."""
    if len(first) != len(second):
        return f"{len(first)} against {len(second)} launches"
    out = []
    for e1, e2 in zip(first, second):
        if e1[0] != e2[0] or (e1[0] == "part" and e1 != e2):
            return f"{e1[:1]} against {e2[:1]}"
        if e1[0] == "part":
            out.append(e1)
            continue
        if e1[1] is not e2[1] or len(e1[2]) != len(e2[2]):
            return "different launch functions"
        args = []
        for i, ((k1, v1), (k2, v2)) in enumerate(zip(e1[2], e2[2])):
            if k1 == k2 == _SOURCE and v1 == v2:
                args.append((True, v1))
            elif k1 == k2 == _CONST and _same_const(v1, v2):
                args.append((False, v1))
            else:
                return f"argument {i} of a launch is neither a source nor the step's own"
        out.append(("launch", e1[1], tuple(args)))
    return out


class _Replay:
    """A merged record made ready to replay: the launches' constant arguments in one tuple, and
    per launch a getter of its argument tuple from (constants + the call's sources), so that a
    replayed launch builds its arguments in one C-level call instead of a Python loop over its
    (source, value) pairs (4 launches of 20 arguments, a mixed call's: 7.6 -> 3.2 us on the CPU
    machine)."""

    __slots__ = ("consts", "events")

    def __init__(self, merged: list):
        launches = [ev for ev in merged if ev[0] == "launch"]
        self.consts = tuple(v for ev in launches for is_source, v in ev[2] if not is_source)
        n, c = len(self.consts), 0   # the sources follow the constants
        self.events = []
        for ev in merged:
            if ev[0] != "launch":
                self.events.append(ev)
                continue
            positions = []
            for is_source, v in ev[2]:
                positions.append(n + v if is_source else c)
                c += not is_source
            self.events.append(("launch", ev[1], _getter(positions)))


def _getter(positions: list):
    """positions' items of a tuple, as a tuple (operator.itemgetter's, whatever their count)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda ext: (ext[i],)
    return lambda ext: ()


class _First:
    """A key's first recording, waiting for a second on other layer tensors (weak references:
    whether the second call's are the same objects)."""

    def __init__(self, template: list, layer_tensors: tuple):
        self.template, self.tries = template, 0
        self.layer_tensors = tuple(None if t is None else weakref.ref(t) for t in layer_tensors)

    def repeated_by(self, layer_tensors: tuple) -> bool:
        return any(r is not None and r() is t for r, t in zip(self.layer_tensors, layer_tensors))


class LaunchReplays:
    """One step's recordings and replays (StepPlan keeps one). ``replayed``: layer calls
    replayed; ``refused``: key -> why a key's calls are not replayed."""

    def __init__(self):
        self._entries: dict = {}
        self.replayed = 0
        self.refused: dict = {}

    def run(self, key: tuple, layer_tensors: tuple, sources: tuple, build, on_call=None) -> None:
        """One layer call whose ops' checks have passed for ``key``: replayed, recorded or run.

        layer_tensors: the call's tensor arguments (None for an absent one); sources: those and
        the views the layer made of them, as the ops take them; build(): the call's launch parts
        [(kind, count, launch)] (launches nothing itself); on_call: as :func:`launch_parts`'.
        """
        entry = self._entries.get(key)
        if entry.__class__ is _Replay:
            _replay(entry, sources, on_call)
            self.replayed += 1
            return
        if entry is _REFUSED:
            launch_parts(build(), on_call)
            return
        if entry is None:
            with launch_record.record() as events:
                launch_parts(build(), on_call)
            template = _template(events, sources, layer_tensors)
            if isinstance(template, str):
                return self._refuse(key, template)
            self._entries[key] = _First(template, layer_tensors)
            return
        shape = _shape(entry.template)
        watcher = None if shape in _CLEAN else _TorchCalls()
        with launch_record.record() as events, (contextlib.nullcontext() if watcher is None else watcher):
            launch_parts(build(), on_call)
        if watcher is not None and watcher.others:
            return self._refuse(key, f"torch calls {sorted(set(watcher.others))} in the ops' host code")
        if entry.repeated_by(layer_tensors):
            entry.tries += 1
            if entry.tries >= _MAX_TRIES:
                self._refuse(key, "the layer calls repeat the same tensors")
            return
        template = _template(events, sources, layer_tensors)
        merged = template if isinstance(template, str) else _merge(entry.template, template)
        if isinstance(merged, str):
            return self._refuse(key, merged)
        if watcher is not None:
            if len(_CLEAN) >= _CLEAN_MAX:
                _CLEAN.clear()
            _CLEAN.add(shape)
        self._entries[key] = _Replay(merged)

    def _refuse(self, key: tuple, why: str) -> None:
        self._entries[key] = _REFUSED
        self.refused[key] = why
        if why not in _logged:
            _logged.add(why)
            log.info("qla_serve: a step's later GDN layers run their ops' host code instead of a launch replay (%s)",
                     why)


def launch_parts(parts, on_call=None) -> None:
    """Launch a layer call's parts [(kind, count, launch)] in order, each followed by
    ``on_call(kind, count)`` where given (an engine's instrumentation) and by a note of the part
    in an active record (where a replay calls on_call)."""
    for kind, count, launch in parts:
        launch()
        launch_record.note(("part", kind, count))
        if on_call:
            with launch_record.exempt():
                on_call(kind, count)


def _replay(replay: _Replay, sources: tuple, on_call) -> None:
    ext = replay.consts + sources
    for ev in replay.events:
        if ev[0] == "launch":
            ev[1](*ev[2](ext))
        elif on_call:
            on_call(ev[1], ev[2])
