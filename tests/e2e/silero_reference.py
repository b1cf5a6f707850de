"""silero-vad's own answers, for tests/e2e/test_vad_stream.py: run by an interpreter that
has torch (the RKNN simulator's venv), with the silero_vad package of the wheel and the
daemon's onnxruntime put first on its path, so that both sides run the same engine.

    python silero_reference.py SILERO_DIR ORT_DIR WAV OUT_DIR

Writes to OUT_DIR: probs.npy (float32, one per 512-sample chunk: OnnxWrapper called chunk
by chunk as silero's get_speech_timestamps calls it, the last chunk zero-padded);
segments.json ({"from_probs": get_speech_timestamps_from_probs on those probabilities,
"from_audio": get_speech_timestamps on the audio, "random": [[probs, length, kwargs,
segments], ...]} for random probability sequences); about.json (onnxruntime's version and
OnnxWrapper's session options, for the report).
"""

from __future__ import annotations

import json
import random
import sys
import wave
from pathlib import Path

silero_dir, ort_dir, wav_path, out_dir = sys.argv[1:5]
sys.path[:0] = [ort_dir, silero_dir]

import numpy as np  # noqa: E402
import onnxruntime  # noqa: E402
import torch  # noqa: E402
from silero_vad.utils_vad import (  # noqa: E402
    OnnxWrapper, get_speech_timestamps, get_speech_timestamps_from_probs,
)

out = Path(out_dir)
with wave.open(wav_path, "rb") as w:
    pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
audio = torch.from_numpy(pcm.astype(np.float32) / 32768.0)  # what silero's read_audio gives
model = OnnxWrapper(str(Path(silero_dir) / "silero_vad" / "data" / "silero_vad.onnx"),
                    force_onnx_cpu=True)
probs = []
for at in range(0, len(audio), 512):  # get_speech_timestamps' own loop
    chunk = audio[at:at + 512]
    if len(chunk) < 512:
        chunk = torch.nn.functional.pad(chunk, (0, 512 - len(chunk)))
    probs.append(model(chunk, 16000).numpy().reshape(-1)[0])
np.save(out / "probs.npy", np.array(probs, np.float32))

rng = random.Random(5)
randoms = []
for _ in range(300):
    n = rng.randrange(1, 120)
    level, seq = rng.random(), []
    for _ in range(n):
        if rng.random() < 0.15:
            level = rng.random()
        seq.append(min(1.0, max(0.0, level + rng.uniform(-0.2, 0.2))))
    length = n * 512 - rng.randrange(512)
    kwargs = rng.choice([{}, {"speech_pad_ms": 300, "min_silence_duration_ms": 0},
                         {"threshold": 0.3, "min_speech_duration_ms": 0}])
    randoms.append([seq, length, kwargs,
                    get_speech_timestamps_from_probs(seq, audio_length_samples=length,
                                                     **kwargs)])
segments = {
    "from_probs": get_speech_timestamps_from_probs([float(p) for p in probs],
                                                   audio_length_samples=len(audio)),
    "from_audio": get_speech_timestamps(audio, model),
    "random": randoms,
}
(out / "segments.json").write_text(json.dumps(segments))
session = model.session.get_session_options()
(out / "about.json").write_text(json.dumps({
    "onnxruntime": onnxruntime.__version__, "onnxruntime_file": onnxruntime.__file__,
    "intra_op_num_threads": session.intra_op_num_threads,
    "inter_op_num_threads": session.inter_op_num_threads}))
