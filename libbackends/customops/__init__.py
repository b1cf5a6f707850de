"""Custom operators: ONNX nodes that no engine knows, run by inferd itself.

RKNN's contract: an op is a Python class (``op_type``, optional ``domain``,
``shape_infer`` and ``compute``) or a native library ``libinferdcst_<name>.so``
(``include/inferd_customop.h``, CPU or OpenCL target). A model that holds such nodes, or
nodes its backend lacks, is cut into sub-graphs and run as one plan
(:mod:`inferd.libbackends.customops.partition`). See docs/customops.md.

Modules: :mod:`.contract` (the op contract, ``get_attr``, the op registry),
:mod:`.pyops` (Python op files), :mod:`.native` (the C ABI), :mod:`.opencl` (the
OpenCL context given to GPU ops), :mod:`.cpufeatures` (kernel variants),
:mod:`.window` (ACL's window split), :mod:`.discovery` (where ops are looked for),
:mod:`.partition` (the plan) and :mod:`.plan` (running it).
"""

from __future__ import annotations

from inferd.libbackends.customops.contract import get_attr

__all__ = ["get_attr"]
