"""The demo vad model as a stream (issue 32, "against the model's own reference"): a WAV
of speech and silence made here with espeak-ng and sox goes through a real daemon's
stream by ``inferctl stream``, and each chunk's speech probability equals bit for bit
the one silero-vad's own ``OnnxWrapper`` gives chunk by chunk on the same engine (the
daemon's onnxruntime, put first on the path of the RKNN simulator's venv, which has the
torch that silero-vad needs); the speech segments equal silero's
``get_speech_timestamps_from_probs`` and ``get_speech_timestamps``; the example
examples/vad-stream/ prints the same segments.

Skipped without espeak-ng and sox (failed under CI, which sets INFERD_TEST_AUDIO=1) or
without the simulator's venv (failed when INFERD_TEST_RKNN=1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from tests.conftest import ROOT
from tests.libbackends.rknn_kit import simulator_python
from tests.links import link_tree

from inferd.ipc.speech import SpeechRules, speech_segments

pytestmark = [pytest.mark.slow, pytest.mark.rknn]

REQUIRE_AUDIO = "INFERD_TEST_AUDIO"
SENTENCES = ["Hello there. This is a test of the voice activity detector.",
             "Streams keep their state in the daemon."]


def audio_tools() -> None:
    """espeak-ng and sox, or skip (fail when $INFERD_TEST_AUDIO=1)."""
    missing = [t for t in ("espeak-ng", "sox") if shutil.which(t) is None]
    if missing:
        reason = f"{' and '.join(missing)} missing (apt-get install espeak-ng sox)"
        if os.environ.get(REQUIRE_AUDIO) == "1":
            pytest.fail(f"{REQUIRE_AUDIO}=1 but {reason}")
        pytest.skip(reason)


def make_speech_wav(folder: Path) -> Path:
    """Two spoken sentences with silence before, between and after, as a mono 16-bit
    PCM WAV at 16 kHz whose length is no multiple of 512 (the last chunk is padded)."""
    parts = []
    for i, (text, before, after) in enumerate(zip(SENTENCES, ("0.8", "0"), ("1.2", "0.7"))):
        raw, part = folder / f"s{i}.wav", folder / f"p{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(raw), text], check=True, capture_output=True)
        # -R -D: no random dither, the same file every run
        subprocess.run(["sox", "-R", "-D", str(raw), "-r", "16000", "-c", "1", "-b", "16",
                        str(part), "pad", before, after], check=True, capture_output=True)
        parts.append(str(part))
    out = folder / "speech.wav"
    subprocess.run(["sox", "-R", "-D", *parts, str(out)], check=True, capture_output=True)
    return out


def silero_wheel() -> Path:
    """The silero-vad wheel `make setup` fetched (beside the models it made)."""
    for cache in (ROOT / ".cache" / "wheels", (ROOT / "models").resolve().parent / ".cache"
                  / "wheels"):
        found = sorted(cache.glob("silero_vad-*.whl"))
        if found:
            return found[-1]
    pytest.fail("no silero_vad wheel in .cache/wheels: run `make setup`")


def reference(python: str, wav: Path, work: Path) -> tuple[np.ndarray, dict, dict]:
    """silero-vad's own probabilities and segments (tests/e2e/silero_reference.py)."""
    silero = work / "silero"
    shutil.unpack_archive(silero_wheel(), silero, "zip")
    ort = work / "ort"
    ort.mkdir()
    (ort / "onnxruntime").symlink_to(Path(onnxruntime.__file__).parent)
    out = work / "ref"
    out.mkdir()
    r = subprocess.run([python, str(Path(__file__).with_name("silero_reference.py")),
                        str(silero), str(ort), str(wav), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return (np.load(out / "probs.npy"), json.loads((out / "segments.json").read_text()),
            json.loads((out / "about.json").read_text()))


def spans(segments: list) -> list[tuple[int, int]]:
    return [(s["start"], s["end"]) if isinstance(s, dict) else (s.start, s.end)
            for s in segments]


def test_probabilities_and_segments_equal_silero_vads_own(start_daemon, short_tmp,
                                                          models_dir):
    audio_tools()
    python = simulator_python()
    wav = make_speech_wav(short_tmp)
    probs, segments, about = reference(python, wav, short_tmp)
    # the same engine on both sides, and the wrapper's one thread (the backend's default)
    assert about["onnxruntime"] == onnxruntime.__version__, about
    assert (about["intra_op_num_threads"], about["inter_op_num_threads"]) == (1, 1)

    repo = short_tmp / "repo"
    link_tree(models_dir / "vad" / "1", repo / "vad" / "1")
    shutil.copyfile(ROOT / "examples" / "models" / "vad" / "model.toml",
                    repo / "vad" / "model.toml")
    config = short_tmp / "inferd.toml"
    config.write_text('[placement]\nmode = "first"\n')
    d = start_daemon("--config", str(config), "--models", str(repo))
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", d.endpoint,
                        "--json", "stream", "vad", "-i", f"input={wav}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    got = np.array([x["outputs"]["output"] for x in lines if "chunk" in x], np.float32)
    assert got.size == probs.size and probs.size > 200
    assert got.tobytes() == probs.tobytes()  # bit for bit
    assert float(probs.max()) > 0.9 and float(probs.min()) < 0.05  # speech and silence
    summary = lines[-1]["summary"]
    samples = summary["samples"]
    assert summary["zero_padded"] == probs.size * 512 - samples > 0

    want = spans(segments["from_probs"])
    assert len(want) >= 2
    assert spans(segments["from_audio"]) == want
    assert spans([x["segment"] for x in lines if "segment" in x]) == want
    assert spans(speech_segments([float(p) for p in probs], samples)) == want
    for seq, length, kwargs, theirs in segments["random"]:
        rules = SpeechRules(threshold=kwargs.get("threshold", 0.5),
                            min_speech_ms=kwargs.get("min_speech_duration_ms", 250),
                            min_silence_ms=kwargs.get("min_silence_duration_ms", 100),
                            speech_pad_ms=kwargs.get("speech_pad_ms", 30))
        assert spans(speech_segments(seq, length, rules)) == spans(theirs), (seq, kwargs)

    example = ROOT / "examples" / "vad-stream" / "vad_stream.py"
    r = subprocess.run([sys.executable, str(example), "--socket", d.endpoint, str(wav)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    printed = [line.split() for line in r.stdout.splitlines()]
    assert [(w[1], w[4]) for w in printed] == [(f"{a / 16000:.2f}", f"{b / 16000:.2f}")
                                               for a, b in want], r.stdout
