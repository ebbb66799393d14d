"""Row sketches computed where the tensor lives: the capture's ``sketch.sketch`` in torch, on the device.

A capture inside a training step cannot afford to copy every record to the host
and hash it there with numpy: on a GPU that is a synchronous device-to-host copy
per boundary, and on any device it is the step's critical path. ``sketch_rows``
computes the same ``[rows, WIDTH]`` sketch (``sketch.py``) with torch ops on the
tensor's own device, so only five float64 values per row ever leave it, and the
copy can wait for the bundle's writer thread (``bundle_writer.py``).

The digest is bit for bit the numpy one (``sketch.DIGEST``, ``fmix32x2``), which the
sketches ``feed.py`` makes of whole records rely on. torch has no uint32 arithmetic,
so it runs on int32, whose multiplication and xor wrap exactly as uint32's do in two's
complement; only the right shift differs (arithmetic, not logical), so each shift is
masked to its logical result, and the sums are taken in int64 over the unsigned
values. The largest magnitude is exact too; the sum of squares is a float64 sum like
numpy's, in torch's order, so it may differ from numpy's in its last bits: it only
feeds the lower bound of a difference that the digests already proved
(``lower_bound``), never the equality.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from logdiff.records.sketch import FMIX1, FMIX2, SEEDS, WIDTH, fmix32


def _fmix32(x: Any) -> Any:
    """``sketch.fmix32`` on an int32 tensor holding uint32 bits (the same bits)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _signed(FMIX1)
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _signed(FMIX2)
    return x ^ ((x >> 16) & 0xFFFF)


def _signed(value: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _element_bits(rows: Any, seed: int) -> Any:
    """Each element's 32-bit key for the half seeded ``seed``: its bits, zero-extended (an 8-byte element: the
    low half xor the mixed high half), as int32."""
    import torch

    size = rows.element_size()
    if size == 8:
        pair = rows.view(torch.int32).reshape(rows.shape[0], -1, 2)  # little-endian: [low, high]
        return pair[..., 0] ^ _fmix32(pair[..., 1] ^ _signed(seed))
    if size == 4:
        return rows.view(torch.int32)
    narrow = {1: torch.int8, 2: torch.int16}[size]
    return rows.view(narrow).to(torch.int32) & ((1 << (8 * size)) - 1)


def sketch_rows(rows: Any, columns: np.ndarray) -> Any:
    """``[rows, WIDTH]`` float64 sketches of the torch tensor ``rows [rows, width]`` on its own device, equal to
    ``sketch.sketch`` of the same values (the digest and the largest magnitude bit for bit); column ``j`` is the
    logical row's column ``columns[j]``, and a column < 0 is padding, left out."""
    import torch

    rows = rows.detach().reshape(rows.shape[0], -1)
    columns = np.asarray(columns, dtype=np.int64)
    keep = columns >= 0
    if not keep.all():
        rows = rows[:, torch.as_tensor(np.nonzero(keep)[0], device=rows.device)]
    device, rows = rows.device, rows.contiguous()
    cols = columns[keep].astype(np.uint32)
    halves = []
    for seed in SEEDS:
        mixed_columns = torch.from_numpy(fmix32(cols ^ np.uint32(seed)).view(np.int32)).to(device)
        h = _fmix32(_element_bits(rows, seed) ^ mixed_columns[None, :])
        halves.append((h.to(torch.int64) & 0xFFFFFFFF).sum(dim=1) & 0xFFFFFFFF)
    values = rows.to(torch.float32).to(torch.float64)  # as numpy reads the record: through float32
    out = torch.empty((rows.shape[0], WIDTH), dtype=torch.float64, device=device)
    out[:, 0], out[:, 1] = halves[0].to(torch.float64), halves[1].to(torch.float64)
    width = values.shape[1]
    out[:, 2] = values.abs().amax(dim=1) if width else 0.0
    out[:, 3] = values.square().sum(dim=1)
    out[:, 4] = float(width)
    return out
