"""Shared-memory tensors through a real daemon (issue 19, item 7): a 4.9 MB input read
in place and its output written into the client's region, bit for bit; a 1920x1080
frame through the OCR graph gives what it gives by socket."""

from __future__ import annotations

import numpy as np
import pytest

from inferd.ipc import Region

from tests.e2e.test_wire_bits import reduce_sum_model


@pytest.mark.slow
def test_big_tensor_in_and_out_through_shared_memory(start_daemon, short_tmp) -> None:
    repo = short_tmp / "repo"
    reduce_sum_model(repo)
    d = start_daemon("--models", str(repo), "--preload", "sum")
    x = np.random.default_rng(3).standard_normal((3, 257)).astype(np.float32)
    with d.client() as c:
        by_socket = c.infer("sum", {"x": x})["y"]
        region = c.register(Region(1 << 20))
        shared = region.ndarray(x.shape, np.float32)
        shared[...] = x
        out = c.infer("sum", {"x": shared}, outputs_into=region)["y"]
        assert region.locate(out) is not None  # the reply's bytes are in the region
        assert out.tobytes() == by_socket.tobytes()
        status = c.status()
    assert status["requests"] >= 2


@pytest.mark.slow
def test_a_camera_frame_through_the_ocr_graph(start_daemon, models_dir) -> None:
    d = start_daemon("--models", str(models_dir))
    frame = np.full((1080, 1920, 3), 255, np.uint8)
    frame[500:560, 800:1100] = 0  # one dark bar: a box, perhaps a text
    with d.client(timeout=300) as c:
        want = c.infer("ocr", {"image": frame})
        region = c.register(Region(frame.nbytes))
        shared = region.ndarray(frame.shape, np.uint8)
        shared[...] = frame
        got = c.infer("ocr", {"image": shared})
    assert got["texts"].tolist() == want["texts"].tolist()
    np.testing.assert_array_equal(got["boxes"], want["boxes"])
