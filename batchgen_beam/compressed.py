"""Compressed input files, read whole or not at all.

Beam's reader of compressed files (`CompressedFile`) takes the end of a file for the end of its
data: a `.gz` cut short by an interrupted copy reads as a shorter file, its last records lost
without a word. Here every compressed stream must end where its file does, or reading it raises
a ValueError that names the file; so do bytes that are not the compression the name says.
"""

import bz2
import io
import lzma
import zlib

import zstandard
from apache_beam.io.filesystem import CompressionTypes

# The compressions Beam tells from a file's extension (CompressionTypes.AUTO), each a new
# decompressor for one stream.
_DECOMPRESSORS = {
    CompressionTypes.GZIP: lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    CompressionTypes.DEFLATE: zlib.decompressobj,
    CompressionTypes.BZIP2: bz2.BZ2Decompressor,
    CompressionTypes.LZMA: lzma.LZMADecompressor,
    # Beam's cap on the window a file may ask for (else any memory).
    CompressionTypes.ZSTD: lambda: zstandard.ZstdDecompressor(max_window_size=1 << 31).decompressobj(),
}
_NOT_THE_FORMAT = (zlib.error, OSError, EOFError, lzma.LZMAError, zstandard.ZstdError)
_CHUNK = 1 << 20


def compression_of(path: str) -> str | None:
    """The compression the file's extension names, None for none."""
    kind = CompressionTypes.detect_compression_type(path)
    return None if kind == CompressionTypes.UNCOMPRESSED else kind


def decompressed(raw, path: str) -> io.BufferedReader:
    """The decompressed bytes of `path`, a compressed file that `raw` reads as it is stored."""
    return io.BufferedReader(_Decompressing(raw, path, compression_of(path)), _CHUNK)


class _Decompressing(io.RawIOBase):
    """Streams one after another (concatenated `.gz` files read as one file), the last ending
    where the file does."""

    def __init__(self, raw, path: str, kind: str):
        self._raw, self._path, self._kind = raw, path, kind
        self._new_decompressor = _DECOMPRESSORS[kind]
        self._decompressor = None  # before the first stream
        self._out = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()

    def readinto(self, buffer) -> int:
        while not self._out:
            if self._decompressor is None or self._decompressor.eof:
                # Between streams: the file may end here, or hold another.
                data = (self._decompressor.unused_data if self._decompressor else b"") or self._raw.read(_CHUNK)
                if not data:
                    return 0
                self._decompressor = self._new_decompressor()
            else:
                data = self._raw.read(_CHUNK)
                if not data:
                    raise ValueError(f"{self._path}: its {self._kind} data ends before its stream does "
                                     f"(a file cut short?); the records past the cut would be lost")
            try:
                self._out = memoryview(self._decompressor.decompress(data))
            except _NOT_THE_FORMAT as exc:
                raise ValueError(f"{self._path}: not {self._kind} data, as its name says ({exc})") from None
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n
