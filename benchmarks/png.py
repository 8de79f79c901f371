"""A tiny RGB canvas that writes itself as a PNG (zlib only, no plotting library)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from benchmarks.font import HEIGHT, WIDTH, glyph

Color = tuple[int, int, int]


class Canvas:
    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fills [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x1 <= x0:
            return
        span = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            self.rows[y][3 * x0 : 3 * x1] = span

    def text(self, x: int, y: int, value: str, color: Color = (0, 0, 0), scale: int = 2) -> int:
        """Draws `value` with its top-left corner at (x, y); returns the width used."""
        cursor = x
        for char in value:
            for row, bits in enumerate(glyph(char)):
                for col, bit in enumerate(bits):
                    if bit == "#":
                        top, left = y + row * scale, cursor + col * scale
                        self.rect(left, top, left + scale, top + scale, color)
            cursor += (WIDTH + 1) * scale
        return cursor - x

    @staticmethod
    def text_width(value: str, scale: int = 2) -> int:
        return len(value) * (WIDTH + 1) * scale

    @staticmethod
    def text_height(scale: int = 2) -> int:
        return HEIGHT * scale

    def save(self, path: Path) -> None:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        path.write_bytes(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )
