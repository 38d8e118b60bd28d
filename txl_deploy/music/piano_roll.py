"""A piano roll of placed notes as a PNG picture: pitch up, time to the right, bars marked.

Drawn with numpy and written with zlib (PNG is a zlib stream of filtered rows in CRC-checked chunks, per the PNG
specification), so the picture needs no plotting library. Scale: a 16th note (120 ticks) is 4 pixels wide, a
semitone 4 pixels high; the picture spans whole bars up to the last note's end (at least one) and the pitches from the lowest note to the
highest (an octave from middle C when there are none).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path
from txl_deploy.music.events_to_midi import TICKS_PER_BAR
from txl_deploy.music.midi_file import Note

TICKS_PER_PIXEL = 30
PIXELS_PER_PITCH = 4
MAX_PIXELS = 1 << 26  # 64 Mpx: some thousand bars; a picture larger than that is refused, not allocated

BACKGROUND = (250, 250, 250)
C_ROW = (232, 236, 242)  # the rows of the Cs, to read octaves by
BEAT = (222, 222, 222)
BAR = (90, 90, 90)
NOTE_QUIET, NOTE_LOUD = np.array((150, 190, 240)), np.array((10, 60, 160))  # velocity 0 and 127


def piano_roll_size(notes: list[Note]) -> tuple[int, int]:
    """(width, height) in pixels of the picture of `notes`."""
    end = max((note.end for note in notes), default=0)
    bars = max(1, -(-end // TICKS_PER_BAR))
    low, high = _pitch_span(notes)
    return bars * TICKS_PER_BAR // TICKS_PER_PIXEL, (high - low + 1) * PIXELS_PER_PITCH


def piano_roll(notes: list[Note]) -> np.ndarray:
    """The picture of `notes` (ticks at 480 a beat, 4/4), as RGB pixels [height, width, 3] uint8."""
    width, height = piano_roll_size(notes)
    if width * height > MAX_PIXELS:
        raise InputError(f"a piano roll of {width} x {height} pixels is too large (at most {MAX_PIXELS:,})")
    low, high = _pitch_span(notes)
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for pitch in range(low, high + 1):
        if pitch % 12 == 0:
            top = (high - pitch) * PIXELS_PER_PITCH
            image[top:top + PIXELS_PER_PITCH] = C_ROW
    beat = TICKS_PER_BAR // 4 // TICKS_PER_PIXEL
    image[:, ::beat] = BEAT
    image[:, ::TICKS_PER_BAR // TICKS_PER_PIXEL] = BAR
    for note in notes:
        left = note.start // TICKS_PER_PIXEL
        right = max(left + 1, note.end // TICKS_PER_PIXEL - 1)  # a pixel's gap between repeated notes
        top = (high - note.pitch) * PIXELS_PER_PITCH
        shade = NOTE_QUIET + (NOTE_LOUD - NOTE_QUIET) * min(note.velocity, 127) / 127
        image[top:top + PIXELS_PER_PITCH - 1, left:right] = shade.round().astype(np.uint8)
    return image


def png_bytes(image: np.ndarray) -> bytes:
    """`image` (RGB uint8 [height, width, 3]) as a PNG file: 8-bit truecolour, no filter, one zlib stream."""
    height, width, _ = image.shape
    rows = np.concatenate([np.zeros((height, 1), dtype=np.uint8), image.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, deflate, no filter, none
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
            + chunk(b"IEND", b""))


def write_piano_roll(notes: list[Note], path, force: bool = False) -> tuple[int, int]:
    """Write the piano roll of `notes` to `path` as a PNG, atomically (an existing file only with `force`); its
    (width, height)."""
    image = piano_roll(notes)
    with atomic_path(Path(path), force=force) as tmp:
        tmp.write_bytes(png_bytes(image))
    return image.shape[1], image.shape[0]


def _pitch_span(notes: list[Note]) -> tuple[int, int]:
    if not notes:
        return 60, 71
    return min(note.pitch for note in notes), max(note.pitch for note in notes)


__all__ = ["piano_roll", "piano_roll_size", "png_bytes", "write_piano_roll"]
