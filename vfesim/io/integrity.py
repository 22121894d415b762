"""Chunk checksums and their verification (SPEC §5, issue 9).

Every array vfesim writes ends its codec chain with Zarr v3's ``crc32c`` codec (after zstd), so a
flipped or truncated chunk fails to decode instead of decoding to wrong numbers. Every chunk is
also written when it equals the fill value (``write_empty_chunks``), so a chunk that should exist
and does not is damage, not a block of fill values (NaN).

Stores written before checksums existed still verify: their chunks are decoded (which catches
truncation and most zstd damage) and missing chunks of NaN-filled arrays are reported, but a
flipped bit that still decodes cannot be seen; :attr:`ArrayReport.checksummed` says which.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["compressors", "Damage", "ArrayReport", "GroupReport", "check_array", "checksummed_encoding"]


def compressors() -> tuple:
    """The bytes-to-bytes codecs of every array vfesim writes: zstd, then a CRC-32C of the compressed chunk.
    (zarr is imported on first use throughout :mod:`vfesim.io`: a process that only computes does not pay
    its import.)"""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return (ZstdCodec(level=0), Crc32cCodec())


def checksummed_encoding(names) -> dict:
    """xarray ``to_zarr`` encoding giving the variables ``names`` the checksummed codecs."""
    codecs = compressors()
    return {k: {"compressors": codecs} for k in names}


@dataclass(frozen=True)
class Damage:
    """One damaged thing: ``node`` (array or group path inside the store, "" for the root), ``key``
    (a chunk key such as ``c/0/0``, or ``zarr.json``) and why."""

    node: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.node or '/'} {self.key}: {self.reason}"


@dataclass(frozen=True)
class ArrayReport:
    """The verification of one array: chunks read, whether they carry checksums, the damage found."""

    node: str
    chunks: int
    checksummed: bool
    damage: tuple[Damage, ...]


def _has_checksum(codecs: list) -> bool:
    for c in codecs:
        name = c.get("name") if isinstance(c, dict) else c
        conf = c.get("configuration", {}) if isinstance(c, dict) else {}
        if name == "crc32c" or (name == "zstd" and conf.get("checksum")):
            return True
    return False


def _reason(e: Exception) -> str:
    text = str(e)
    if "checksum" in text.lower():
        return f"checksum mismatch ({text})"
    return f"cannot be decoded ({type(e).__name__}: {text})"


def check_array(root: Path, node: str, frames_written: int | None = None) -> ArrayReport:
    """Read every stored chunk of the array ``root/node`` through its codecs (the crc32c codec checks
    each chunk) and look for chunks that should exist and do not.

    frames_written: for an array whose first dimension is ``time`` (trajectory), only the chunks
    holding frames below it must exist (the rest are not written yet); None: every chunk must exist.
    """
    import zarr

    where = Path(root) / node
    meta_file = where / "zarr.json"
    try:
        meta = json.loads(meta_file.read_bytes())
        if meta.get("node_type") != "array":
            raise ValueError(f"node_type is {meta.get('node_type')!r}, not 'array'")
        a = zarr.open_array(where, mode="r", zarr_format=3)
    except FileNotFoundError:
        return ArrayReport(node, 0, False, (Damage(node, "zarr.json", "missing (the array is gone)"),))
    except Exception as e:  # any parse or metadata error: the array cannot be read at all
        return ArrayReport(node, 0, False, (Damage(node, "zarr.json", f"unreadable metadata ({e})"),))
    checksummed = _has_checksum(meta.get("codecs", []))
    fill = a.fill_value
    nan_fill = isinstance(fill, float | np.floating) and bool(np.isnan(fill))
    dims = meta.get("dimension_names") or []
    by_time = frames_written is not None and bool(dims) and dims[0] == "time"
    damage, n = [], 0
    for coords in itertools.product(*(range(c) for c in a.cdata_shape)):
        key = a.metadata.encode_chunk_key(coords)
        if not (where / key).is_file():
            required = not by_time or coords[0] * a.chunks[0] < frames_written
            # Without checksums (older stores) empty chunks were not written: only a missing chunk
            # of a NaN-filled array is surely damage.
            if required and (checksummed or nan_fill):
                damage.append(Damage(node, key, "missing (it was written, now it is gone)"))
            continue
        n += 1
        try:
            a.get_block_selection(coords)
        except Exception as e:  # the codecs' own errors: checksum mismatch, zstd errors, short data
            damage.append(Damage(node, key, _reason(e)))
    return ArrayReport(node, n, checksummed, tuple(damage))


@dataclass(frozen=True)
class GroupReport:
    """The verification of one part of a store (the trajectory, or one checkpoint)."""

    name: str
    arrays: tuple[ArrayReport, ...]
    damage: tuple[Damage, ...]  # every damage found, the arrays' included

    @property
    def intact(self) -> bool:
        return not self.damage

    @property
    def unchecksummed(self) -> tuple[str, ...]:
        """Arrays whose chunks carry no checksum (written by an older vfesim)."""
        return tuple(a.node for a in self.arrays if a.chunks and not a.checksummed)

    def summary(self, limit: int = 3) -> str:
        """The first ``limit`` damages, one string (for warnings and errors)."""
        more = len(self.damage) - limit
        return "; ".join(map(str, self.damage[:limit])) + (f"; and {more} more" if more > 0 else "")
