"""The OCR graph served by a real daemon against rapidocr-onnxruntime 1.4.4 (default
settings) on generated images: different fonts, sizes, a tilted and an upside-down one.
Same texts, boxes within a few pixels; both executors agree; inferctl prints the texts
of a PNG."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inferd.ipc import RequestError
from inferd.ipc.errors import ErrorCode
from tests.links import link_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ocr_images import CASES, fonts_available, rapidocr_reads, render  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not fonts_available(),
                                 reason="DejaVu fonts missing (Debian fonts-dejavu-core)")]

BOX_TOLERANCE_PX = 3.0


@pytest.fixture(scope="module")
def rapid() -> None:
    pytest.importorskip("rapidocr_onnxruntime")


@pytest.fixture(scope="module")
def daemon(module_daemon: Any, models_dir: Path) -> Any:
    """One daemon for the module over :func:`ocr_repo`'s repository: the tests send it
    requests, and the one that unloads the graph loads it again."""
    return module_daemon("--models", str(ocr_repo(module_daemon.workdir, models_dir)))


def ocr_repo(workdir: Path, models_dir: Path) -> Path:
    """A repository with the three OCR models, the ocr graph and a task-parallel copy."""
    repo = workdir / "repo"
    repo.mkdir()
    for name in ("ocr-det", "ocr-cls", "ocr-rec"):
        (repo / name).mkdir()
        link_tree(models_dir / name / "1", repo / name / "1")
        if (models_dir / name / "model.toml").exists():
            shutil.copy(models_dir / name / "model.toml", repo / name)
    graph = (models_dir / "ocr" / "graph.toml").read_text()
    core = sorted(os.sched_getaffinity(0))[-1]
    for name, executor in (("ocr", "pipeline"), ("ocr-task", "task")):
        (repo / name).mkdir()
        (repo / name / "graph.toml").write_text(
            graph.replace('executor = "pipeline"',
                          f'executor = "{executor}"\ncpu_affinity = [{core}]'))
    return repo


def test_ocr_graph_matches_rapidocr_on_generated_images(daemon: Any, rapid: None) -> None:
    with daemon.client(timeout=120) as c:
        for k, (lines, font, size, rotation) in enumerate(CASES):
            image = render(lines, font, size, rotation)
            want_texts, want_boxes = rapidocr_reads(k)
            assert want_texts, f"RapidOCR read nothing in {lines}"
            got = c.infer("ocr", {"image": image})
            case = f"{lines} {font} {size}px rotated {rotation}"
            assert sorted(got) == ["boxes", "scores", "texts"]
            assert got["texts"].tolist() == want_texts, case
            assert all(isinstance(t, str) for t in got["texts"].tolist())
            assert got["boxes"].dtype == np.float32 and got["boxes"].shape == (
                len(want_texts), 4, 2)
            assert got["scores"].dtype == np.float32 and got["scores"].shape == (
                len(want_texts),)
            assert np.all(got["scores"] >= 0.5)
            worst = float(np.abs(got["boxes"] - want_boxes).max())
            assert worst <= BOX_TOLERANCE_PX, f"{case}: boxes differ by {worst} px"
        blank = np.full((200, 400, 3), 255, np.uint8)
        empty = c.infer("ocr", {"image": blank})
        assert empty["texts"].shape == (0,) and empty["boxes"].shape == (0, 4, 2)


def test_both_executors_agree_on_the_ocr_graph(daemon: Any) -> None:
    with daemon.client(timeout=120) as c:
        images = [render(*case) for case in CASES[:3]]
        pending = [(c.submit("infer", "ocr", inputs={"image": im}),
                    c.submit("infer", "ocr-task", inputs={"image": im})) for im in images]
        first = None
        for p, t in pending:
            a, b = p.result(), t.result()
            first = first or a["texts"].tolist()
            assert a["texts"].tolist() == b["texts"].tolist()
            np.testing.assert_array_equal(a["boxes"], b["boxes"])
            np.testing.assert_array_equal(a["scores"], b["scores"])
        models = {m["name"]: m for m in c.models(verbose=True)}
        assert models["ocr"]["kind"] == "graph" and models["ocr"]["executor"] == "pipeline"
        assert models["ocr-task"]["executor"] == "task"
        assert "inferd-ocr-det" in models["ocr"]["threads"]
        for graph in ("ocr", "ocr-task"):
            placed = models[graph]["placement"]
            assert placed and all(p["native_id"] for p in placed), placed
            core = str(sorted(os.sched_getaffinity(0))[-1])
            for p in placed:
                status = Path(f"/proc/{daemon.proc.pid}/task/{p['native_id']}/status")
                assert f"Cpus_allowed_list:\t{core}\n" in status.read_text(), p
        assert c.unload("ocr")["state"] == "unloaded"
        assert c.load("ocr")["state"] == "ready"
        again = c.infer("ocr", {"image": images[0]})
        assert again["texts"].tolist() == first
        with pytest.raises(RequestError) as e:
            c.infer("ocr", {"image": np.zeros((4, 4), np.float32)})
        assert e.value.code is ErrorCode.INVALID_ARGUMENT and "uint8" in e.value.message


def test_inferctl_infer_ocr_prints_the_texts_of_a_png(daemon: Any, short_tmp: Path) -> None:
    from PIL import Image

    png = short_tmp / "photo.png"
    Image.fromarray(render(["Hello world 123"], "DejaVuSans.ttf", 32)[:, :, ::-1]).save(png)
    out = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                          daemon.endpoint, "infer", "ocr", "-i", f"image={png}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "texts:\n  Hello world 123" in out.stdout, out.stdout


def test_a_preloaded_graph_is_loaded_with_its_models_before_ready(
        start_daemon: Any, short_tmp: Path, models_dir: Path, rapid: None) -> None:
    """``--preload`` naming a graph: the graph (its steps built in the processors worker)
    and the models its nodes call are loaded before the daemon reports ready, so its
    first request pays neither; a preloaded graph that cannot load is logged and shown
    in the status line, and the daemon starts anyway (as for a model)."""
    repo = ocr_repo(short_tmp, models_dir)
    (repo / "broken").mkdir()
    (repo / "broken" / "graph.toml").write_text(
        'inputs = ["x"]\n[[nodes]]\nname = "n"\nmodel = "no-such-model"\n'
        'inputs = { x = "x" }\n[outputs]\ny = "n.y"\n')
    d = start_daemon("--models", str(repo), "--preload", "ocr", "--preload", "broken")
    log = d.log()
    ready = log.index("INFO inferd.daemon.runtime: ready;")
    loaded = log.index("INFO inferd.daemon.runtime: graph ocr preloaded; loading its "
                       "models: ocr-det, ocr-cls, ocr-rec")
    assert loaded < ready and log.index("worker processors started") < ready
    assert "ERROR inferd.daemon.runtime: preloaded graph broken failed to load: " in log
    assert "preload failed: broken" in log[ready:].splitlines()[0]
    with d.client(timeout=120) as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert {k: states[k] for k in ("ocr", "ocr-det", "ocr-cls", "ocr-rec", "ocr-task")} \
            == {"ocr": "ready", "ocr-det": "ready", "ocr-cls": "ready", "ocr-rec": "ready",
                "ocr-task": "unloaded"}
        lines, font, size, rotation = CASES[0]
        want_texts, _ = rapidocr_reads(0)
        got = c.infer("ocr", {"image": render(lines, font, size, rotation)})
    assert list(got["texts"]) == want_texts
    # nothing was loaded by that request: the graph and its models were there already
    after = d.log()[len(log):]
    assert "graph ocr loaded" not in after and " loaded on " not in after, after
