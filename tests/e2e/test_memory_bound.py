"""Working memory bounded before a run (issue 21, part 2), on a real daemon with the real
demo models: a first request too large for the budget is refused with the figures before
it runs, the daemon's peak stays within (budget + idle) x 1.1, and the estimate a run is
admitted on is within 30 % of what it then measures once its model has a factor of its
own."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.daemon.memory import FACTORS
from inferd.ipc import RequestError
from tests.e2e.ocr_images import fonts_available, render
from tests.links import link_tree

pytestmark = pytest.mark.slow  # each test runs a daemon or a child process: seconds

MiB = 2**20
# room for the small image's detector (443 MiB estimated) beside what is always counted:
# the onnxruntime engine (61 MiB) and the processors worker (90-95 MiB after the 2560
# image's steps, heap trimmed; with the steps in the daemon it was not counted)
BUDGET = 640 * MiB


def _repo(short_tmp: Path, models_dir: Path, graph: bool) -> Path:
    repo = short_tmp / "repo"
    repo.mkdir()
    for name in ("ocr-det", "ocr-cls", "ocr-rec", "vad"):
        (repo / name).mkdir()
        link_tree(models_dir / name / "1", repo / name / "1")
        if (models_dir / name / "model.toml").exists():
            shutil.copy(models_dir / name / "model.toml", repo / name)
    if graph:
        (repo / "ocr").mkdir()
        shutil.copy(models_dir / "ocr" / "graph.toml", repo / "ocr")
    return repo


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


@pytest.fixture
def bounded(start_daemon: Any, short_tmp: Path, models_dir: Path) -> Any:
    config = short_tmp / "budget.toml"
    config.write_text(f'[cache]\nmax_memory = "{BUDGET // MiB}MiB"\n'
                      '[metrics]\ntextfile = ""\n')
    d = start_daemon("--models", str(_repo(short_tmp, models_dir, graph=True)),
                     env={"INFERD_CONFIG": str(config)})
    d.idle = _status(d.proc.pid)["VmRSS"]  # ready, no model loaded
    d.limit = (BUDGET + d.idle) * 1.1
    return d


def test_a_first_2560_detector_request_is_refused_with_the_figures(bounded: Any) -> None:
    x = np.random.default_rng(1).random((1, 3, 2560, 2560), np.float32)
    with bounded.client(timeout=300) as c:
        with pytest.raises(RequestError) as e:
            c.infer("ocr-det", {"x": x})
        det = {m["name"]: m for m in c.models()}["ocr-det"]
    peak = _status(bounded.proc.pid)["VmHWM"]
    assert e.value.code == "RESOURCE_EXHAUSTED"
    message = e.value.message
    assert "model ocr-det version 1: inputs of this size need" in message, message
    assert "of working memory (estimated from its graph:" in message
    assert f"over the cache budget of {BUDGET / MiB:.1f} MiB" in message
    assert det["working_memory"] == []  # it never ran: nothing measured, nothing counted
    assert peak <= bounded.limit, (peak / MiB, bounded.idle / MiB)


@pytest.mark.skipif(not fonts_available(), reason="the DejaVu fonts render the test image")
def test_the_2560_ocr_graph_is_refused_and_a_small_image_served_within_the_bound(
        bounded: Any) -> None:
    page = render(["WORKING MEMORY", "BOUNDED 2560"], "DejaVuSans.ttf", 96, width=2560)
    big = np.full((2560, 2560, 3), 255, np.uint8)
    big[:page.shape[0]] = page
    small = render(["SMALL IMAGE", "SERVED"], "DejaVuSans.ttf", 40)
    with bounded.client(timeout=300) as c:
        with pytest.raises(RequestError) as e:
            c.infer("ocr", {"image": big})
        served = c.infer("ocr", {"image": small})
        status = c.status()
    peak = _status(bounded.proc.pid)["VmHWM"]
    assert e.value.code == "RESOURCE_EXHAUSTED", e.value.message
    assert "ocr-det" in e.value.message and f"over the cache budget of {BUDGET / MiB:.1f} MiB" \
        in e.value.message, e.value.message
    assert len(served["texts"]) >= 1
    assert status["cache"]["used_bytes"] <= BUDGET
    assert peak <= bounded.limit, (peak / MiB, bounded.idle / MiB)


# Three sizes per demo model, each the first run of its size in a fresh daemon after one
# tiny run (the load's first run pays the engine's one-off set-up, ~0.3-1.3 MiB: not a
# size's working memory), so that what is measured is the size's own: in a daemon that
# ran a smaller size before, a run reuses some of the memory that one left (ocr-cls
# 32x3x48x192 measured 25 MiB after 6 and 16, against 41-47 fresh). A first run is
# admitted on the backend's factor (the prior), every later one on the model's own: the
# largest ratio of measured working memory to activations among its runs.
WARM = {"ocr-det": {"x": (1, 3, 64, 64)}, "ocr-rec": {"x": (1, 3, 48, 64)},
        "ocr-cls": {"x": (1, 3, 48, 64)}, "vad": {"input": (1, 512), "state": (2, 1, 128)}}
SIZES = {
    "ocr-det": [{"x": (1, 3, 640, 640)}, {"x": (1, 3, 736, 1280)}, {"x": (1, 3, 1280, 1280)}],
    "ocr-rec": [{"x": (1, 3, 48, 320)}, {"x": (6, 3, 48, 320)}, {"x": (6, 3, 48, 640)}],
    "ocr-cls": [{"x": (6, 3, 48, 192)}, {"x": (16, 3, 48, 192)}, {"x": (32, 3, 48, 192)}],
    # from 256 rows: below 1 MiB of activations a run gives no factor (CALIBRATE_FROM)
    "vad": [{"input": (256, 512), "state": (2, 256, 128)},
            {"input": (512, 512), "state": (2, 512, 128)},
            {"input": (1024, 512), "state": (2, 1024, 128)}],
}


def _inputs(model: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {name: rng.random(shape, np.float32) for name, shape in shapes.items()}
    if model == "vad":
        out["sr"] = np.array(16000, np.int64)
    return out


def _class(model: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    dims = {**shapes, **({"sr": ()} if model == "vad" else {})}
    return {n: [1 << max(0, d - 1).bit_length() for d in s] for n, s in dims.items()}


def test_the_estimate_is_within_30_percent_of_the_measured_peak(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    repo = _repo(short_tmp, models_dir, graph=False)
    config = short_tmp / "first.toml"  # no rival engines loaded and run beside it
    # The factors were calibrated on runs in the daemon's own heap. In a worker
    # (isolation = "backend") ocr-rec's first size measured 0.82x its activations where
    # the daemon measures 2.6x (its later sizes 2.42-2.57x): not yet calibrated there.
    config.write_text('[placement]\nmode = "first"\n[metrics]\ntextfile = ""\n'
                      '[workers]\nisolation = "in-process"\n')

    def measure(model: str) -> tuple[Any, Any, list[Any]]:
        """The model's sizes one after another, each in a fresh daemon of the model's
        own directory: its factors, its first size's row, its later sizes' rows."""
        sizes = SIZES[model]
        workdir = short_tmp / model
        workdir.mkdir()
        runs, after = [], None
        for k, shapes in enumerate(sizes):
            d = start_daemon("--models", str(repo), env={"INFERD_CONFIG": str(config)},
                             workdir=workdir)
            with d.client(timeout=300) as c:
                c.infer(model, _inputs(model, WARM[model]))
                c.infer(model, _inputs(model, shapes))
                if k == 0:  # the next size, on the factor this run gave the model
                    c.infer(model, _inputs(model, sizes[1]))
                rows = {m["name"]: m for m in c.models()}[model]["working_memory"]
            d.stop()
            by_class = {json.dumps(r["shapes"], sort_keys=True): r for r in rows}
            runs.append(by_class[json.dumps(_class(model, shapes), sort_keys=True)])
            if k == 0:
                after = by_class[json.dumps(_class(model, sizes[1]), sort_keys=True)]
        assert after is not None
        # each row a fresh class: its activations were sized at that very run
        prior = [r["admitted_bytes"] / r["activations_bytes"] for r in runs]
        ratios = [r["bytes"] / r["activations_bytes"] for r in runs]
        own = after["admitted_bytes"] / after["activations_bytes"]
        factors = (model, [round(f, 2) for f in ratios], round(own, 2))
        assert prior == pytest.approx([FACTORS["onnxruntime"]] * 3, abs=0.01), prior
        assert own == pytest.approx(ratios[0], abs=0.01), factors
        return (factors, (model, sizes[0], round(runs[0]["bytes"] / MiB, 2),
                          round(runs[0]["admitted_bytes"] / MiB, 2)),
                [(model, s, round(r["bytes"] / MiB, 2),
                  round(ratios[0] * r["activations_bytes"] / MiB, 2))
                 for s, r in zip(sizes[1:], runs[1:])])

    # Two models at a time, each size still the first run of a fresh daemon (what is
    # measured is each daemon's own heap): a daemon's start is mostly one thread's work.
    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(measure, SIZES))
    factors = [m[0] for m in measured]
    first = [m[1] for m in measured]
    report = [row for m in measured for row in m[2]]
    # measured / activations with the shipped settings ([cache] malloc_arenas = 2):
    # ocr-det 1.93, ocr-rec 2.6-2.62, ocr-cls 2.76-3.21, vad 1.65-2.0 (256 rows: 1.65-1.71
    # or 1.98 by the heap's layout). On its own factor each model is within 16 %; on the
    # prior, before anything of it is measured, no one factor can be within 30 % of both
    # ocr-cls 6x3x48x192 and vad 256x512 (3.21 / 1.65 = 1.95x): 2.1 is -35 % to +27 %,
    # checked within -40 % / +30 % (more would refuse the graph test's small image above)
    off = [r for r in report if abs(r[3] - r[2]) > 0.3 * r[2]]
    assert not off, f"estimate off (model, shapes, measured MiB, estimated MiB): {off}; " \
        f"all: {report}; measured ratios and the factor after the first: {factors}"
    prior_off = [r for r in first if not 0.6 * r[2] <= r[3] <= 1.3 * r[2]]
    assert not prior_off, f"first size off on the prior: {prior_off}; all: {first}"


def _mapped(pid: int) -> set[str]:
    return {line.rsplit("/", 1)[-1] for line in Path(f"/proc/{pid}/maps").read_text()
            .splitlines() if ".so" in line}


def _config(short_tmp: Path, isolation: str) -> str:
    path = short_tmp / "isolation.toml"
    # placement "first": the one worker of the backend, no measuring workers beside it
    path.write_text(f'[workers]\nisolation = "{isolation}"\n[placement]\nmode = "first"\n')
    return str(path)


def test_an_idle_daemon_holds_no_engine_until_a_model_loads_on_it(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    d = start_daemon("--config", _config(short_tmp, "in-process"),
                     "--models", str(_repo(short_tmp, models_dir, graph=False)))
    with d.client(timeout=120) as c:
        backends = {b["id"]: b["status"] for b in c.backends()["backends"]}
        idle = _mapped(d.proc.pid)
        row = c.load("ocr-cls")  # onnxruntime: the first backend of its plan
        loaded = _mapped(d.proc.pid)
        cache = c.status()["cache"]
    # probed in child processes: registered, but not in the daemon
    assert backends["onnxruntime"] == "registered"
    engines = ("onnxruntime_pybind11_state", "libopenvino.so", "onnx_cpp2py_export")
    assert not [so for so in idle if so.startswith(engines)], sorted(idle)
    assert any(so.startswith("onnxruntime_pybind11_state") for so in loaded)
    assert not any(so.startswith("libopenvino.so") for so in loaded)  # not used
    # the engines it brought in count in the budget as theirs, not as ocr-cls's
    assert set(cache["engines_bytes"]) == {"onnx", "onnxruntime"}, cache
    assert cache["engines_bytes"]["onnxruntime"] > 4 * MiB, cache
    assert row["memory_bytes"] < cache["engines_bytes"]["onnxruntime"], (row, cache)
    assert cache["used_bytes"] == row["memory_bytes"] + sum(cache["engines_bytes"].values())


def test_with_workers_the_engine_is_in_the_worker_never_the_daemon(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    import psutil

    d = start_daemon("--config", _config(short_tmp, "backend"),
                     "--models", str(_repo(short_tmp, models_dir, graph=False)))
    with d.client(timeout=120) as c:
        row = c.load("ocr-cls")
        c.infer("ocr-cls", {"x": np.zeros((2, 3, 48, 192), np.float32)})
        cache = c.status()["cache"]
    engines = ("onnxruntime_pybind11_state", "libopenvino.so", "onnx_cpp2py_export")
    assert not [so for so in _mapped(d.proc.pid) if so.startswith(engines)]
    (zygote,) = psutil.Process(d.proc.pid).children()
    (worker,) = zygote.children()
    assert any(so.startswith("onnxruntime_pybind11_state") for so in _mapped(worker.pid))
    # the worker's import counts as the engine's, measured in the worker; no onnx import
    # in the daemon to count
    assert set(cache["engines_bytes"]) == {"onnxruntime"}, cache
    assert cache["engines_bytes"]["onnxruntime"] > 4 * MiB, cache
    assert 0 < row["memory_bytes"] < worker.memory_info().rss, row
