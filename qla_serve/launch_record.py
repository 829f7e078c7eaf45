"""A record of the raw kernel launches (and op dispatches) made while host code runs.

The GDN layer's launch replay (backends/launch_replay.py) records what a later layer call of a
step launches, so that the step's remaining layers can make the same launches on their own
tensors without running the ops' host code again. Two hooks feed the record:

* :func:`recordable` wraps every raw TileLang launch function (kernels/hopper/common.py and
  prefill_launch.py wrap what raw_launch.raw_function returns): ``("launch", fn, args)``;
* :func:`note_dispatch` is called by ops._run / layer_ops._run with the path an op took:
  ``("dispatch", op, path)`` (a replay needs every op on the TileLang path: the reference and
  FLA paths launch through torch and Triton, which no raw launch records).

While nothing records, each hook costs one global read. A record belongs to the thread that
started it (the engines run a step's layers on one thread); launches from other threads are not
recorded. :func:`in_raw_launch` tells a torch-op watcher (launch_replay's) that the torch calls
it sees come from inside a raw launch (tvm-ffi's argument conversion), not from the host code.
"""

from __future__ import annotations

import threading

_events: list | None = None   # the active record
_owner: int | None = None     # the thread that records
_inside = 0                   # > 0 while a recorded raw launch or an exempt callback runs


def recordable(fn):
    """``fn`` (a raw launch function) recorded when called during :func:`record`."""
    def launch(*args):
        if _events is not None and _owner == threading.get_ident():
            _events.append(("launch", fn, args))
            global _inside
            _inside += 1
            try:
                return fn(*args)
            finally:
                _inside -= 1
        return fn(*args)
    launch.raw = fn
    return launch


def note_dispatch(op: str, path: str) -> None:
    """An op of qla_serve dispatched to ``path`` ("tilelang", "fla", "reference")."""
    if _events is not None and _owner == threading.get_ident():
        _events.append(("dispatch", op, path))


def note(event: tuple) -> None:
    """Any other event for the active record (the layer's part boundaries)."""
    if _events is not None and _owner == threading.get_ident():
        _events.append(event)


def in_raw_launch() -> bool:
    return _inside > 0


class exempt:
    """A stretch of code inside a record whose torch calls are not the host code's (an engine's
    instrumentation callback): the watcher ignores them, as it does a raw launch's own."""

    def __enter__(self):
        global _inside
        _inside += 1

    def __exit__(self, *exc):
        global _inside
        _inside -= 1


class record:
    """``with record() as events:`` collects this thread's launches, dispatches and notes in
    ``events`` (a list); records do not nest."""

    def __enter__(self) -> list:
        global _events, _owner
        if _events is not None:
            raise RuntimeError("launch_record.record: a record is already active")
        _events, _owner = [], threading.get_ident()
        return _events

    def __exit__(self, *exc):
        global _events, _owner
        _events = _owner = None
