"""Speech segments from a voice activity detector's per-chunk speech probabilities, by the
rules of silero-vad's ``get_speech_timestamps`` (6.x; its ``get_speech_timestamps_from_probs``
does the same from the probabilities), computed as the chunks arrive.

The rules, silero's defaults: a segment starts at the first chunk whose probability is
at least ``threshold`` (0.5); once in speech, a chunk below ``neg_threshold`` (threshold -
0.15, at least 0.01) begins a silence, which ends the segment at its first chunk when it
lasts ``min_silence_ms`` (100 ms) while no chunk reaches ``threshold`` again; a segment of
at most ``min_speech_ms`` (250 ms) is dropped; one still open at the end of the audio ends
there if it is long enough. Each segment is then widened by ``speech_pad_ms`` (30 ms) on
both sides, or, where two segments are closer than twice that, they share the gap half and
half. silero's ``max_speech_duration_s`` (default: none) is not offered.

Unlike silero's function, which sees every probability first, :class:`SpeechSegmenter`
gives each segment as soon as it is final: when the next one is kept, or when so much
silence followed that no later segment can change its padding (with the defaults, at
once: the 100 ms of silence that end a segment are more than its two pads). Its segments equal
silero's for the same probabilities (tests/e2e/test_vad_stream.py checks them against the
wheel's own function).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeechRules:
    """The thresholds of silero-vad's ``get_speech_timestamps``, its defaults.

    Args:
        sample_rate: samples per second of the audio.
        window: samples per probability (a chunk: 512 at 16 kHz, 256 at 8 kHz).
        threshold: a chunk at or above it is speech.
        neg_threshold: in speech, a chunk below it is silence; None: ``threshold - 0.15``
            (at least 0.01), as silero.
        min_speech_ms: shorter segments (or as long) are dropped.
        min_silence_ms: the silence that ends a segment.
        speech_pad_ms: the padding on each side of a segment.
    """

    sample_rate: int = 16000
    window: int = 512
    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_ms: float = 250
    min_silence_ms: float = 100
    speech_pad_ms: float = 30

    @property
    def exit_threshold(self) -> float:
        if self.neg_threshold is not None:
            return self.neg_threshold
        return max(self.threshold - 0.15, 0.01)

    def samples(self, ms: float) -> float:
        """``ms`` milliseconds in samples, unrounded (silero compares with these)."""
        return self.sample_rate * ms / 1000


@dataclass(frozen=True)
class Segment:
    """Speech from sample ``start`` to sample ``end`` (exclusive), padded."""

    start: int
    end: int

    def seconds(self, sample_rate: int) -> tuple[float, float]:
        return self.start / sample_rate, self.end / sample_rate


class SpeechSegmenter:
    """Speech segments from probabilities pushed one chunk at a time.

    ``push(p)`` for each chunk's probability, in order, each chunk ``rules.window``
    samples long (the last may be shorter: say so with ``finish``); it returns the
    segments that became final. ``finish(audio_samples)`` ends the audio (its length in
    samples, as silero's ``audio_length_samples``) and returns the rest.
    """

    def __init__(self, rules: SpeechRules | None = None) -> None:
        self.rules = rules or SpeechRules()
        r = self.rules
        self._pad = r.samples(r.speech_pad_ms)
        self._min_speech = r.samples(r.min_speech_ms)
        self._min_silence = r.samples(r.min_silence_ms)
        self._index = 0                     # chunks pushed
        self._start: int | None = None      # the open segment's first sample
        self._silence_from: int | None = None
        self._closed: list[tuple[int, int]] = []  # unpadded, not given yet (at most one)
        self._last_end: int | None = None   # unpadded end of the last segment given
        self._done = False

    def push(self, probability: float) -> list[Segment]:
        """One chunk's probability; returns the segments that are final now."""
        if self._done:
            raise ValueError("push after finish")
        r = self.rules
        at = r.window * self._index
        self._index += 1
        if probability >= r.threshold:
            self._silence_from = None
            if self._start is None:
                self._start = at
        elif self._start is not None and probability < r.exit_threshold:
            if self._silence_from is None:
                self._silence_from = at
            if at - self._silence_from >= self._min_silence:
                if self._silence_from - self._start > self._min_speech:
                    self._closed.append((self._start, self._silence_from))
                self._start = self._silence_from = None
        return self._final()

    def finish(self, audio_samples: int) -> list[Segment]:
        """The end of the audio, ``audio_samples`` long; returns the last segments."""
        if self._done:
            return []
        self._done = True
        if self._start is not None and audio_samples - self._start > self._min_speech:
            self._closed.append((self._start, audio_samples))
        self._start = None
        out = []
        while self._closed:
            start, end = self._closed.pop(0)
            if self._closed:  # the next one's start is known
                out.append(self._padded(start, end, self._closed[0][0], audio_samples))
            else:
                out.append(self._padded(start, end, None, audio_samples))
        return out

    def _final(self) -> list[Segment]:
        """The closed segments whose padding can no longer change: one followed by
        another closed one, or one after which any later segment starts 2 pads away
        (the open one's start, else the next chunk's) and the audio is known to reach a
        pad past it. An open segment may yet be dropped (too short): it fixes nothing."""
        out = []
        while len(self._closed) >= 2:
            start, end = self._closed.pop(0)
            out.append(self._padded(start, end, self._closed[0][0], None))
        if self._closed:
            start, end = self._closed[0]
            r = self.rules
            earliest = self._start if self._start is not None else r.window * self._index
            known = r.window * (self._index - 1) + 1  # samples there surely are
            if earliest - end >= 2 * self._pad and known >= end + self._pad:
                self._closed.pop(0)
                out.append(self._padded(start, end, None, None))
        return out

    def _padded(self, start: int, end: int, next_start: int | None,
                audio_samples: int | None) -> Segment:
        pad = self._pad
        if self._last_end is None:
            first = int(max(0, start - pad))
        else:
            gap = start - self._last_end
            first = int(max(0, start - gap // 2)) if gap < 2 * pad else int(max(0, start - pad))
        self._last_end = end
        if next_start is not None and next_start - end < 2 * pad:
            last = end + int((next_start - end) // 2)
        elif audio_samples is not None:
            last = int(min(audio_samples, end + pad))
        else:
            last = int(end + pad)
        return Segment(first, last)


def speech_segments(probabilities: list[float], audio_samples: int | None = None,
                    rules: SpeechRules | None = None) -> list[Segment]:
    """Every segment of ``probabilities`` (one per chunk) at once, as silero's
    ``get_speech_timestamps_from_probs``; ``audio_samples`` default: chunks x window."""
    seg = SpeechSegmenter(rules)
    out = [s for p in probabilities for s in seg.push(p)]
    if audio_samples is None:
        audio_samples = len(probabilities) * seg.rules.window
    return out + seg.finish(audio_samples)
