"""Speech segments of a WAV file, or of the microphone through ``arecord``, from the demo
``vad`` model (Silero VAD) run as a stream: the daemon keeps the model's state and the
last 64 samples between chunks, so each request carries only 512 new samples.

    python3 vad_stream.py speech.wav        # a mono 16-bit PCM WAV at 16 kHz
    python3 vad_stream.py --arecord         # the default microphone, until Ctrl-C

Each segment is printed as soon as it is final (silero-vad's rules:
inferd.ipc.speech). $INFERD_SOCKET (or --socket) names the daemon.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import wave
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from inferd.ipc import Client
from inferd.ipc.speech import Segment, SpeechSegmenter

RATE = 16000
CHUNK = 512  # Silero VAD at 16 kHz: 32 ms


def pcm_chunks(raw: BinaryIO) -> Iterator[tuple[np.ndarray, int]]:
    """([1, CHUNK] float32 zero-padded, real samples) from 16-bit little-endian PCM."""
    while True:
        data = raw.read(2 * CHUNK)
        if not data:
            return
        pcm = np.frombuffer(data[:len(data) // 2 * 2], "<i2")
        x = np.zeros((1, CHUNK), np.float32)
        x[0, :pcm.size] = pcm / np.float32(32768)
        yield x, pcm.size


def wav_pcm(path: str) -> BinaryIO:
    """The samples of a mono 16-bit PCM WAV at RATE, as a file of raw PCM."""
    with wave.open(path, "rb") as w:
        if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, RATE):
            sys.exit(f"{path}: need mono 16-bit PCM at {RATE} Hz, got {w.getnchannels()} "
                     f"channels, {8 * w.getsampwidth()}-bit, {w.getframerate()} Hz "
                     f"(convert: sox {path} -r {RATE} -c 1 -b 16 out.wav)")
        return io.BytesIO(w.readframes(w.getnframes()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wav", nargs="?", help="a mono 16-bit PCM WAV file at 16 kHz")
    p.add_argument("--arecord", action="store_true", help="read the microphone")
    p.add_argument("--socket", default=None, help="the daemon's endpoint")
    args = p.parse_args()
    if bool(args.wav) == args.arecord:
        p.error("give a WAV file or --arecord")
    rec = None
    if args.arecord:
        rec = subprocess.Popen(["arecord", "-q", "-f", "S16_LE", "-r", str(RATE), "-c", "1",
                                "-t", "raw"], stdout=subprocess.PIPE)
        raw: BinaryIO = rec.stdout  # type: ignore[assignment]
    else:
        raw = wav_pcm(args.wav)
    segmenter = SpeechSegmenter()
    samples = 0

    def show(segments: list[Segment]) -> None:
        for s in segments:
            start, end = s.seconds(RATE)
            print(f"speech {start:7.2f} s - {end:7.2f} s", flush=True)

    try:
        with Client(args.socket) as client, client.stream("vad", sr=RATE) as stream:
            for x, n in pcm_chunks(raw):
                probability = stream.infer({"input": x})["output"].item()
                samples += n
                show(segmenter.push(probability))
    except KeyboardInterrupt:
        pass
    finally:
        if rec is not None:
            rec.terminate()
            rec.wait()
    show(segmenter.finish(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
