"""Row sketches: what a capture keeps of a record outside its full window.

A capture of a real model cannot keep every boundary's full tensor for every
token (24 layers x 20 boundaries x 4,096 tokens x 4 KiB is gigabytes per
sequence). It keeps full tensors only inside a bounded ``Window`` (by default
the first layers, the embeddings, the final norm, the logits and the
log-softmax) and, for every other record, one *sketch* per row:

* a 64-bit digest: two independent 32-bit sums (mod 2^32) over the row's
  elements of a hash of the element's raw bits and its *logical* column
  (``fmix32x2``: murmur3's 32-bit finalizer, two seeds). Equal rows have equal
  digests; a change to any one element changes both halves (the hash is a
  bijection of the bits for each column), several changes collide with a chance
  near 2^-64. Because it is a sum over logical columns, a rank that holds a
  column slice hashes its slice alone, and the logical row's digest is the sum of
  the ranks' (no gathering while the model runs). Bundles written before (no
  ``sketch_digest`` in a rank's metadata) hold ``splitmix64`` digests (one 64-bit
  sum of splitmix64's finalizer), which are read as such; the 32-bit one is
  three times cheaper on a CPU, whose SIMD units multiply 32-bit lanes natively,
  and a capture computes it inside the step (``sketch_device.py``);
* the row's largest magnitude and its sum of squares, also combinable across
  ranks (max, sum). Two rows' ``|max_a - max_b|`` and ``|norm_a - norm_b| /
  sqrt(width)`` are lower bounds of their largest element difference.

A sketch row is five float64 values, ``[digest_hi, digest_lo, absmax, sumsq,
elements]`` (each 32-bit half of the digest is exact in float64), so the scan's
row stores keep it like any record. ``compare`` reads a boundary that either side only
sketched from the sketches: bitwise equality per row exactly, the size of a
difference as a lower bound, and no replay.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from logdiff.records.layout import Placement

WIDTH = 5  # digest_hi, digest_lo, absmax, sumsq, elements
SUFFIX = "#sketch"  # a sketch's record name in the scan's stores: ``name + SUFFIX``
DIGEST, LEGACY = "fmix32x2", "splitmix64"  # the digest a capture writes; the one bundles without a name hold
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
#: fmix32x2: murmur3's fmix32 multipliers, and the seed of each 32-bit half (hi, lo)
FMIX1, FMIX2 = 0x85EBCA6B, 0xC2B2AE35
SEEDS = (0x9E3779B9, 0x7F4A7C15)


@dataclass(frozen=True)
class Window:
    """Which records a capture keeps whole: those of the first ``layers`` decoder layers and those of no layer
    (embeddings, final norm, logits, log-softmax); every record when ``layers`` is None."""

    layers: int | None = 2

    def full(self, layer: int | None) -> bool:
        return self.layers is None or layer is None or layer < self.layers

    @classmethod
    def parse(cls, text: str | int | None) -> Window:
        """``all`` (or None) keeps every record whole; an integer N the first N layers."""
        if text is None or text == "all":
            return cls(None)
        try:
            layers = int(text)
        except (TypeError, ValueError):
            raise ValueError(f"window {text!r}: expected 'all' or a number of layers") from None
        if layers < 0:
            raise ValueError(f"window {layers}: a number of layers >= 0")
        return cls(layers)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        return x ^ (x >> np.uint64(31))


def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer (a bijection), element-wise on uint32, in place where ``x`` allows."""
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(FMIX1)
        x ^= x >> np.uint32(13)
        x *= np.uint32(FMIX2)
        x ^= x >> np.uint32(16)
    return x


def _splitmix_digest(raw: np.ndarray, cols: np.ndarray) -> np.ndarray:
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[raw.dtype.itemsize]
    bits = raw.view(unsigned).astype(np.uint64)
    with np.errstate(over="ignore"):
        return _mix(bits ^ _mix(cols.astype(np.uint64))[None, :]).sum(axis=1, dtype=np.uint64)


DIGESTS = (DIGEST, LEGACY)
#: elements of the block of rows the host sketch works on at a time, so that its temporaries stay in cache
BLOCK_ELEMENTS = 1 << 14


def sketch(raw: np.ndarray, dtype: str, columns: np.ndarray, digest: str = DIGEST) -> np.ndarray:
    """``[rows, WIDTH]`` float64 sketches of ``raw [rows, width]`` (the record as stored: bfloat16 as raw int16
    bits), whose column ``j`` is the logical row's column ``columns[j]``; a column < 0 is padding, left out.
    ``digest``: the bundle's (``DIGEST`` unless it is an older one, ``LEGACY``).

    Each block of rows is hashed and measured through a few preallocated buffers, in place, so a record costs
    no temporaries its size (a capture's writer sketches gigabytes per step). The values are those of the
    whole-array expressions: ``sum_j fmix32(e_j ^ fmix32(c_j ^ seed))`` mod 2^32 per seed (``e_j``: the
    element's bits, an 8-byte element's low half xor its mixed high half), and the float32 value's largest
    magnitude and float64 sum of squares, each row reduced by numpy as a whole row."""
    raw = np.ascontiguousarray(raw).reshape(raw.shape[0], -1)
    keep = np.asarray(columns) >= 0
    cols = np.asarray(columns, dtype=np.int64)[keep]
    if not keep.all():
        raw = np.ascontiguousarray(raw[:, keep])
    out = np.empty((raw.shape[0], WIDTH), dtype=np.float64)
    out[:, 4] = raw.shape[1]
    if digest == LEGACY:
        _put_digest(out, _splitmix_digest(raw, cols))
    blocks = _Blocks(raw, dtype, cols, fmix=digest == DIGEST)
    for start in range(0, raw.shape[0], blocks.rows):
        blocks.sketch(raw[start : start + blocks.rows], out[start : start + blocks.rows])
    return out


class _Blocks:
    """``sketch``'s buffers for blocks of ``rows`` rows of one record, and the work on one block."""

    def __init__(self, raw: np.ndarray, dtype: str, cols: np.ndarray, fmix: bool):
        width = raw.shape[1]
        self.rows = max(1, BLOCK_ELEMENTS // max(width, 1))
        self.dtype = dtype
        shape = (min(self.rows, raw.shape[0]), width)
        self.bits, self.hash, self.tmp = (np.empty(shape, np.uint32) for _ in range(3))
        self.values = np.empty(shape, np.float64)
        self.mixed = _mixed_columns(cols) if fmix else []

    def sketch(self, block: np.ndarray, out: np.ndarray) -> None:
        n, size = block.shape[0], block.dtype.itemsize
        bits, h, tmp = self.bits[:n], self.hash[:n], self.tmp[:n]
        if size < 8:  # the element's bits, zero-extended
            np.copyto(bits, block.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]), casting="unsafe")
        with np.errstate(over="ignore"):
            for column, (seed, mixed) in enumerate(zip(SEEDS, self.mixed)):
                if size == 8:
                    pair = block.view(np.uint32).reshape(n, -1, 2)  # little-endian: [low, high]
                    np.bitwise_xor(pair[..., 1], np.uint32(seed), out=h)
                    np.bitwise_xor(_fmix32_inplace(h, tmp), pair[..., 0], out=h)
                else:
                    np.copyto(h, bits)
                np.bitwise_xor(h, mixed, out=h)
                out[:, column] = _fmix32_inplace(h, tmp).sum(axis=1, dtype=np.uint32)  # mod 2^32
        values = self.values[:n]
        if self.dtype == "bfloat16":
            np.left_shift(bits, 16, out=tmp)
            np.copyto(values, tmp.view(np.float32))
        else:
            np.copyto(values, block.astype(np.float32), casting="unsafe")  # as ``unshard.to_float32`` reads it
        out[:, 2] = np.abs(values, out=values).max(axis=1, initial=0.0)
        out[:, 3] = np.square(values, out=values).sum(axis=1)


def _mixed_columns(cols: np.ndarray) -> list[np.ndarray]:
    """``fmix32(column ^ seed)`` per seed: a record's logical columns, mixed; those of a whole row (``0..width``,
    every record of a scan's window) made once per width (a decode step sketches a few rows per call)."""
    if np.array_equal(cols, np.arange(len(cols))):
        return list(_mixed_range(len(cols)))
    return [fmix32(cols.astype(np.uint32) ^ np.uint32(seed)) for seed in SEEDS]


@functools.lru_cache(maxsize=64)
def _mixed_range(width: int) -> tuple[np.ndarray, ...]:
    out = tuple(fmix32(np.arange(width, dtype=np.uint32) ^ np.uint32(seed)) for seed in SEEDS)
    for a in out:
        a.flags.writeable = False
    return out


def _fmix32_inplace(x: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """``fmix32(x)`` computed in ``x`` (``tmp``: a buffer of its shape)."""
    for shift, multiplier in ((16, FMIX1), (13, FMIX2)):
        np.bitwise_xor(x, np.right_shift(x, shift, out=tmp), out=x)
        np.multiply(x, np.uint32(multiplier), out=x)
    return np.bitwise_xor(x, np.right_shift(x, 16, out=tmp), out=x)


def _put_digest(sketches: np.ndarray, digest: np.ndarray) -> None:
    """Write uint64 digests into the sketches' first two columns, 32 bits each (exact in float64)."""
    sketches[:, 0] = (digest >> np.uint64(32)).astype(np.float64)
    sketches[:, 1] = (digest & np.uint64(0xFFFFFFFF)).astype(np.float64)


def digest_of(sketches: np.ndarray) -> np.ndarray:
    """The uint64 digests of ``[rows, WIDTH]`` sketches."""
    return (sketches[:, 0].astype(np.uint64) << np.uint64(32)) | sketches[:, 1].astype(np.uint64)


def combine(pieces: list[np.ndarray], digest: str = DIGEST) -> np.ndarray:
    """The logical rows' sketches from the sketches of column slices that partition them (the ranks of a
    ``tp`` group holding shards): digests summed (each 32-bit half mod 2^32; a ``LEGACY`` digest mod 2^64),
    largest magnitudes maxed, sums of squares summed."""
    out = np.empty_like(pieces[0])
    if digest == LEGACY:
        with np.errstate(over="ignore"):
            _put_digest(out, np.sum([digest_of(p) for p in pieces], axis=0, dtype=np.uint64))
    else:
        for column in (0, 1):
            out[:, column] = np.sum([p[:, column] for p in pieces], axis=0) % 2.0**32  # exact: < 2^53
    for column, fold in ((2, np.max), (3, np.sum), (4, np.sum)):
        out[:, column] = fold([p[:, column] for p in pieces], axis=0)
    return out


def local_columns(placement: Placement, index: int, world: int, width: int) -> np.ndarray | None:
    """The logical column of each of a rank's ``width`` local columns (-1: padding past ``size``), for the rank
    at ``index`` of a ``tp`` group of ``world``; None where a sketch cannot be combined (a partial sum, a split
    on another dimension): such a record is kept whole."""
    if placement.kind == "replicate" or world == 1:
        return np.arange(width, dtype=np.int64)
    if placement.kind != "shard" or placement.dim not in (-1, 1):
        return None
    if placement.parts:
        if sum(placement.parts) != width:
            return None
        cols, offset = [], 0
        for part in placement.parts:
            cols.append(offset + index * part + np.arange(part, dtype=np.int64))
            offset += world * part
        return np.concatenate(cols)
    cols = index * width + np.arange(width, dtype=np.int64)
    if placement.size is not None:
        cols[cols >= placement.size] = -1
    return cols


def lower_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, a lower bound of the largest element difference of the two rows two sketches describe
    (``|max|a| - max|b||`` and ``|‖a‖ - ‖b‖| / sqrt(elements)``, both at most ``max|a - b|``)."""
    norms = np.abs(np.sqrt(a[:, 3]) - np.sqrt(b[:, 3])) / np.sqrt(np.maximum(a[:, 4], 1.0))
    return np.maximum(np.abs(a[:, 2] - b[:, 2]), norms)


def unshard_sketches(pieces: list[tuple[Any, np.ndarray]], placement: Placement,
                     digest: str = DIGEST) -> dict[tuple[int, ...], Any]:
    """The logical rows' sketches of one record, one per ``tp`` group (as ``unshard.unshard`` keys them): a
    replicated record's replicas compared by digest and one kept; a sharded one's slices combined (``digest``:
    the bundle's)."""
    from logdiff.records.unshard import Logical

    groups: dict[tuple[int, ...], list[tuple[Any, np.ndarray]]] = {}
    for layout, array in pieces:
        groups.setdefault(layout.group("tp"), []).append((layout, array))
    out = {}
    for key, members in groups.items():
        members.sort(key=lambda m: m[0].index_in("tp"))
        arrays = [a for _, a in members]
        if placement.kind == "replicate" or len(arrays) == 1:
            same = all(np.array_equal(digest_of(a), digest_of(arrays[0])) for a in arrays[1:])
            out[key] = Logical(arrays[0], key, replicas_equal=same if len(arrays) > 1 else None)
        else:
            out[key] = Logical(combine(arrays, digest), key)
    return out
