"""What the daemon unpickles from a worker: plain data, numpy arrays, and the few inferd
types a reply carries, named one by one; no other global.

A worker runs native code that a client's input reaches (onnxruntime, OpenVINO, custom
ops, OpenCV on a client's image, the user's processor files). A worker taken over by a
hostile input sends what its attacker wants, and a pickle names any global and calls it
while it is read (``os.system`` with a command): :func:`pickle.loads` on a worker's
bytes would run the attacker's code in the daemon. So every pickle the daemon reads from
a worker (a channel message's header, a processor step's values), and from the zygote
(which runs no such code, but is another process all the same), goes through
:class:`Unpickler`, whose ``find_class`` gives only the globals of :data:`ALLOWED`:

- numpy's array, dtype and scalar reconstruction, which refuse to make an array of
  Python objects from raw bytes (object arrays are rebuilt from a list of objects, each
  read under the same rule);
- :class:`~inferd.libbackends.contract.TensorSpec` and
  :class:`~inferd.libbackends.contract.BatchSizes` (a load's reply).

Dicts, lists, tuples, sets, strings, bytes, ints, floats, booleans and None need no
global at protocol 5 (the channel's): they are opcodes; a complex number is
``builtins.complex``, allowed. A refused global raises :class:`Refused`
naming it. What a worker reads from the daemon is read with :mod:`pickle` as before: the
daemon is trusted, and its headers carry types this list leaves out (a load's options).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from inferd.libbackends.contract import BatchSizes, TensorSpec


class Refused(pickle.UnpicklingError):
    """A pickle from a worker named a global the daemon does not take."""


def _numpy(attr: str) -> Any:
    """numpy's own object for ``numpy._core.multiarray.<attr>`` / ``numeric``, whichever
    module this numpy pickles it under (numpy 1 says ``numpy.core``)."""
    for module in ("numpy._core.multiarray", "numpy._core.numeric", "numpy.core.multiarray",
                   "numpy.core.numeric"):
        try:
            found = getattr(__import__(module, fromlist=[attr]), attr)
        except (ImportError, AttributeError):
            continue
        return found
    raise ImportError(f"numpy has no {attr}")


def _allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("builtins", "complex"): complex,  # the one plain number with no opcode of its own
    }
    for attr in ("_reconstruct", "scalar", "_frombuffer"):
        found = _numpy(attr)
        for module in ("numpy._core.multiarray", "numpy._core.numeric",
                       "numpy.core.multiarray", "numpy.core.numeric"):
            # the name it is pickled under is the module that defines it (numpy 1:
            # numpy.core; 2: numpy._core), the same function whichever is named
            allowed[(module, attr)] = found
    for cls in (TensorSpec, BatchSizes):
        allowed[(cls.__module__, cls.__qualname__)] = cls
    return allowed


ALLOWED: dict[tuple[str, str], Any] = _allowed()
"""(module, name) -> the object ``find_class`` gives for it: everything else is refused."""


def allowed_global(module: str, name: str) -> Any:
    """The object of global ``module.name`` if the daemon takes it from a worker.

    Raises:
        Refused: it is not in :data:`ALLOWED`.
    """
    found = ALLOWED.get((module, name))
    if found is None:
        raise Refused(f"global {module}.{name} is not allowed")
    return found


class Unpickler(pickle.Unpickler):
    """:class:`pickle.Unpickler` that resolves only the globals of :data:`ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        return allowed_global(module, name)


def loads(data: Any) -> Any:
    """:func:`pickle.loads` under the allow-list (``data``: bytes or a buffer).

    Raises:
        Refused: a global not in :data:`ALLOWED`.
        pickle.UnpicklingError, and what a malformed pickle raises (EOFError,
            ValueError, TypeError...): ``data`` is no pickle the daemon can read.
    """
    return Unpickler(io.BytesIO(data)).load()
