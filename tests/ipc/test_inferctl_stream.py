"""``inferctl stream`` (ipc/inferctl_stream.py): the WAV files it refuses, each with one
line saying why, before it connects; the chunks it makes (the last zero-padded); and,
against a real daemon, a WAV from a file and from stdin through the vad model's stream,
each chunk's output equal to the Python client's stream's, ``models -v`` showing an open
stream, and a model without ``[stream]`` refused. The reference against silero-vad itself is
tests/e2e/test_vad_stream.py."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import ROOT
from tests.links import link_tree

from inferd.ipc.inferctl import main as inferctl_main
from inferd.ipc.inferctl_stream import chunks, open_wav


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000, channels: int = 1,
              width: int = 2) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path


def float_wav(path: Path) -> Path:
    """A WAV of IEEE float samples (format 3), which Python's wave does not read."""
    data = np.zeros(100, np.float32).tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
                     + b"fmt " + struct.pack("<I", len(fmt)) + fmt
                     + b"data" + struct.pack("<I", len(data)) + data)
    return path


def speechlike(n: int) -> np.ndarray:
    """N int16 samples of tone bursts in noise (the probabilities vary)."""
    t = np.arange(n) / 16000
    x = (np.sin(2 * np.pi * 0.7 * t) > 0.3) * 0.3 * np.sin(2 * np.pi * 180 * t)
    x = x + 0.01 * np.random.default_rng(2).standard_normal(n)
    return (x * 32767).astype("<i2")


@pytest.mark.parametrize("make,why", [
    (lambda p: write_wav(p, np.zeros(10, "<i2"), rate=22050), "22050 Hz, not 16000 Hz (--sr)"),
    (lambda p: write_wav(p, np.zeros(20, "<i2"), channels=2), "2 channels, not 1 (mono)"),
    (lambda p: write_wav(p, np.zeros(10, np.uint8), width=1), "8-bit samples, not 16-bit"),
    (float_wav, "not 16-bit integer PCM"),
    (lambda p: p.write_bytes(b"\x93NUMPY not audio") and p, "not a WAV file"),
])
def test_refused_wav_files_say_why(short_tmp, capsys, make, why) -> None:
    path = make(short_tmp / "x.wav")
    # refused before connecting: the socket does not exist
    with pytest.raises(SystemExit) as e:
        inferctl_main(["--socket", f"ipc://{short_tmp}/none.sock", "stream", "vad", "-i",
                       f"input={path}"])
    assert str(e.value).startswith(f"inferctl: {path}: ") and why in str(e.value)
    with pytest.raises(SystemExit) as e:
        inferctl_main(["stream", "vad", "-i", "input"])
    assert "expects NAME=FILE.wav" in str(e.value)
    with pytest.raises(SystemExit) as e:
        inferctl_main(["stream", "vad", "-i", f"input={short_tmp}/missing.wav"])
    assert "cannot read" in str(e.value) and "No such file" in str(e.value)


def test_chunks_are_scaled_and_the_last_zero_padded(short_tmp) -> None:
    pcm = np.array([-32768, -1, 0, 1, 16384, 32767, 5], "<i2")
    w, f = open_wav(str(write_wav(short_tmp / "x.wav", pcm)), 16000)
    got = list(chunks(w, 4))
    w.close()
    f.close()
    assert [n for _, n in got] == [4, 3]
    assert got[0][0].dtype == np.float32 and got[0][0].shape == (1, 4)
    assert got[0][0].tolist() == [[-1.0, -1 / 32768, 0.0, 1 / 32768]]
    assert got[1][0].tolist() == [[0.5, 32767 / 32768, 5 / 32768, 0.0]]


@pytest.mark.slow
def test_a_wav_through_the_vad_stream_equals_the_python_client(start_daemon, short_tmp,
                                                               models_dir) -> None:
    repo = short_tmp / "repo"
    link_tree(models_dir / "vad" / "1", repo / "vad" / "1")
    shutil.copyfile(ROOT / "examples" / "models" / "vad" / "model.toml",
                    repo / "vad" / "model.toml")
    link_tree(models_dir / "ocr-cls" / "1", repo / "ocr-cls" / "1")
    config = short_tmp / "inferd.toml"
    config.write_text('[placement]\nmode = "first"\n')
    d = start_daemon("--config", str(config), "--models", str(repo))
    pcm = speechlike(40 * 512 + 100)
    wav = write_wav(short_tmp / "speech.wav", pcm)

    def inferctl(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                               d.endpoint, *args], capture_output=True, timeout=120,
                              input=stdin)

    r = inferctl("--json", "stream", "vad", "-i", f"input={wav}")
    assert r.returncode == 0, r.stderr.decode()
    lines = [json.loads(x) for x in r.stdout.decode().splitlines()]
    got = np.array([x["outputs"]["output"] for x in lines if "chunk" in x], np.float32)
    assert lines[-1]["summary"] == {"samples": pcm.size, "sample_rate": 16000, "chunks": 41,
                                    "chunk": 512, "zero_padded": 412,
                                    "segments": len([x for x in lines if "segment" in x])}
    x = np.zeros((41, 512), np.float32)
    x.reshape(-1)[:pcm.size] = pcm / np.float32(32768)
    with d.client() as c, c.stream("vad", sr=16000) as s:
        ref = np.array([s.infer({"input": row[None]})["output"].item() for row in x],
                       np.float32)
        # models -v shows the open stream (this one) and its state's bytes
        verbose = inferctl("models", "-v").stdout.decode()
        block = next(b for b in verbose.split("\n\n") if b.startswith("vad\n"))
        assert "\n  streams: 1 open (" in block and "0 freed idle, 0 lost" in block, block
    assert got.tobytes() == ref.tobytes()

    # from stdin (arecord's way), text: a line per chunk, the summary last
    r = inferctl("stream", "vad", "-i", "input=-", stdin=wav.read_bytes())
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode().splitlines()
    assert out[0].split() == ["CHUNK", "TIME_S", "OUTPUTS"]
    rows = [line.split() for line in out[1:42]]
    assert [float(row[3]) for row in rows] == [round(float(p), 4) for p in ref]
    assert out[-1].startswith(f"{pcm.size} samples at 16000 Hz (1.29 s) in 41 chunks of 512; "
                              "the last chunk's 412 missing samples zero-padded")

    # a model without [stream]: the daemon's INVALID_ARGUMENT, exit 1
    r = inferctl("stream", "ocr-cls", "-i", f"x={wav}", "--no-chunks")
    assert r.returncode == 1 and r.stderr.decode().startswith("inferctl: INVALID_ARGUMENT: ")
