"""How the requests of one batch become one run of the model and its outputs theirs
again (daemon/model_threads.py runs every batch through one of these): plain requests
stacked on axis 0 (:class:`PlainBatch`), or chunks of different streams with their
states stacked along their own batch axes (:class:`ChunkBatch`, over
:func:`inferd.daemon.streams.merge` and :func:`~inferd.daemon.streams.split`).

Each has the same four parts: ``kind`` (for the log), ``signature`` (what requests must
share to run together), ``rows`` (a request's rows, against ``max_batch``), ``merge``
and ``split``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from inferd.daemon import streams as stream_batch
from inferd.daemon.streams import StreamModel
from inferd.ipc.errors import ModelError
from inferd.libbackends.contract import LoadedModel


class PlainBatch:
    """Requests without a stream as one run: every tensor stacked on axis 0 and cut
    back along it; no constants."""

    kind = "requests"

    def __init__(self, model: str) -> None:
        self.model = model

    @staticmethod
    def signature(values: dict[str, Any]) -> tuple[Any, ...]:
        """What requests must share to run together: dtypes and shapes but axis 0."""
        return tuple(sorted((k, v.dtype, v.shape[1:]) for k, v in values.items()))

    @staticmethod
    def rows(values: dict[str, Any]) -> int:
        first = next(iter(values.values()), None)
        return int(first.shape[0]) if isinstance(first, np.ndarray) and first.ndim else 1

    @staticmethod
    def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def split(self, outputs: dict[str, Any], counts: list[int]) -> list[dict[str, Any]]:
        """Raises ModelError: an output that does not keep the batch on axis 0."""
        total = sum(counts)
        if any(v.ndim == 0 or v.shape[0] != total for v in outputs.values()):
            raise ModelError(f"model {self.model}: outputs do not keep the batch axis")
        out, start = [], 0
        for n in counts:
            out.append({k: v[start:start + n] for k, v in outputs.items()})
            start += n
        return out


class ChunkBatch:
    """Chunks of different streams as one run (daemon/streams.py): chunk inputs on axis
    0, states stacked along their own batch axes, constants once."""

    kind = "stream chunks"

    def __init__(self, bound: StreamModel) -> None:
        self.bound = bound

    def signature(self, values: dict[str, Any]) -> tuple[Any, ...]:
        return stream_batch.signature(self.bound, values)

    def rows(self, values: dict[str, Any]) -> int:
        return stream_batch.rows(self.bound, values)

    def merge(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return stream_batch.merge(self.bound, parts)

    def split(self, outputs: dict[str, Any], counts: list[int]) -> list[dict[str, Any]]:
        return stream_batch.split(self.bound, outputs, counts)


def batchable(model: LoadedModel) -> bool:
    """Whether plain requests to ``model`` can run as one batch: every input's first
    dimension is free (a batch axis)."""
    return bool(model.inputs) and all(
        s.shape and not (isinstance(s.shape[0], int) and s.shape[0] >= 0) for s in model.inputs)



def plain_batch_inputs(model: LoadedModel, sizes: list[int],
                       shapes: dict[str, list[int]] | None = None
                       ) -> dict[int, dict[str, np.ndarray]]:
    """Zero inputs of a plain batch of each of ``sizes`` rows, for sizing each batch's
    working memory before requests come (:meth:`ModelThreads.warm_up`). Empty unless
    every input is a float tensor whose dimensions past the batch axis are all known,
    from the model or from ``shapes`` (model.toml's ``warmup_shapes``, whose first
    dimension is replaced by each size): a free one could take any size, and an integer
    input's value may choose a branch of the graph (a shape, an index), so zeros would
    size the wrong run."""
    from inferd.ipc.dtypes import numpy_dtype

    if not batchable(model):
        return {}
    rows: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for spec in model.inputs:
        given = (shapes or {}).get(spec.name)
        rest = tuple(given[1:]) if given and len(given) == len(spec.shape) \
            else spec.shape[1:]
        if not all(isinstance(d, int) and d >= 0 for d in rest):
            return {}
        try:
            dtype = numpy_dtype(spec.dtype)
        except Exception:  # noqa: BLE001  a type numpy cannot make zeros of
            return {}
        if dtype.kind != "f":
            return {}
        rows[spec.name] = (tuple(int(d) for d in rest), dtype)
    return {n: {name: np.zeros((n, *rest), dtype) for name, (rest, dtype) in rows.items()}
            for n in sizes}
