"""The capture's writer off the step's critical path (logdiff/records/bundle_writer.py, logdiff/records/sketch_device.py, issue 36).

* Sketches computed in torch (on the tensor's device) have the numpy sketch's digest and largest magnitude, bit
  for bit, for every dtype a capture records; a one-ulp change changes both 32-bit halves of the digest.
* The background writer stores what the tensor held when it was recorded (the engine may overwrite it in place
  afterwards), sketches deferred to its thread equal those made in the step, steps are written in order and the
  bundle on disk lists only written steps; a failure in the thread is one error at ``close``. The host copies
  of the steps queued stay within ``hold_bytes`` (``end_step`` waits for the thread), and a failed thread is
  an error there, not a wait.
* An open writer appends each written step's entry to its step log and rewrites the manifest only when the
  metadata changes (not once per step); a writer that never closes leaves a bundle read through the log, a
  line cut short at its end left out, and closing writes today's manifest whole and removes the log.
* Bundles keep the digest they were written with: an older bundle (no ``sketch_digest``) reads its sketches
  as ``splitmix64``, and ``compare`` refuses two bundles whose sketches hold different digests.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from logdiff.records.bundle import Bundle
from logdiff.records.bundle_writer import BundleWriter, host_array
from logdiff.records.layout import REPLICATE, ParallelLayout
from logdiff.records.sketch import DIGEST, LEGACY, combine, digest_of, sketch
from logdiff.records.sketch_device import sketch_rows

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64]


def _values(dtype: torch.dtype, rows: int = 9, width: int = 40) -> torch.Tensor:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)) * 30
    if dtype == torch.int64:
        return x.to(dtype)
    x = x.to(dtype)
    x[0, 0], x[1, 1], x[2, 2], x[3, 3] = float("nan"), float("inf"), -0.0, 0.0
    return x


@pytest.mark.parametrize("shape", [(9, 40), (45, 1000), (5, 20_000)], ids=str)  # one block; 16 rows a block; a row
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_device_sketch_is_the_numpy_sketch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Also across numpy's blocks of rows (``sketch.BLOCK_ELEMENTS``): torch's whole-tensor sketch is the reference."""
    x = _values(dtype, *shape)
    columns = np.arange(shape[1]) + 100
    columns[-3:] = -1  # padding: left out by both
    raw, name = host_array(x)
    expected = sketch(raw, name, columns)
    got = sketch_rows(x, columns).numpy()
    assert np.array_equal(digest_of(got), digest_of(expected))
    assert np.array_equal(got[:, 2], expected[:, 2], equal_nan=True)
    assert np.array_equal(got[:, 4], expected[:, 4])
    finite = np.isfinite(expected[:, 3])
    assert np.allclose(got[finite, 3], expected[finite, 3], rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_a_one_ulp_change_changes_both_halves_of_the_digest(dtype: torch.dtype) -> None:
    x = _values(dtype)
    y = x.clone()
    bits = y.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()])
    bits[5, 7] += 1  # the next representable value: one ulp
    assert not torch.equal(x, y)
    a, b = sketch_rows(x, np.arange(40)).numpy(), sketch_rows(y, np.arange(40)).numpy()
    differs = (a[:, :2] != b[:, :2])
    assert differs[5].all() and not np.delete(differs, 5, axis=0).any()


def test_the_halves_combine_across_slices_and_the_legacy_digest_still_reads() -> None:
    raw, name = host_array(_values(torch.bfloat16))
    for digest in (DIGEST, LEGACY):
        whole = sketch(raw, name, np.arange(40), digest)
        pieces = [sketch(raw[:, k : k + 10], name, np.arange(k, k + 10), digest) for k in range(0, 40, 10)]
        assert np.array_equal(digest_of(combine(pieces, digest)), digest_of(whole))
    # the two digests differ: a bundle must say which it holds
    assert not np.array_equal(digest_of(sketch(raw, name, np.arange(40), DIGEST)),
                              digest_of(sketch(raw, name, np.arange(40), LEGACY)))


def _write(root: Path, steps: list[torch.Tensor], background: bool, hold_bytes: int = 1 << 30,
           sketched: bool = False, overwrite: bool = False) -> Bundle:
    writer = BundleWriter(root, "train", ParallelLayout(), {"note": "test"}, background=background,
                          hold_bytes=hold_bytes)
    for k, x in enumerate(steps):
        n = x.shape[0]
        writer.begin_step(torch.arange(n), torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.ones(n))
        writer.record("h", x, REPLICATE, rows=np.arange(n), sketch_columns=np.arange(x.shape[1]) if sketched else None)
        if overwrite:
            x.add_(1.0)  # what vLLM's fused residual add does to a recorded tensor later in the forward
    writer.close()
    return Bundle(root)


def test_the_background_writer_keeps_what_was_recorded(tmp_path: Path) -> None:
    steps = [_values(torch.bfloat16, rows=4 + k) for k in range(5)]
    originals = [x.clone() for x in steps]
    bundle = _write(tmp_path / "bg", steps, background=True, overwrite=True)
    part = bundle.ranks[0]
    assert [s["file"] for s in part.steps] == [f"step-{k:06d}.safetensors" for k in range(5)]
    assert part.meta["sketch_digest"] == DIGEST and bundle.sketch_digest == DIGEST
    for k, x in enumerate(originals):
        stored = part.load(k, ["h"])["h"]
        assert np.array_equal(stored, host_array(x)[0])  # the value at record time, not the overwritten one
        assert not np.array_equal(stored, host_array(steps[k])[0])  # negative control: the tensor did change


def test_a_private_record_is_kept_without_a_second_copy_and_a_shared_one_is_copied(tmp_path: Path) -> None:
    """``private=True`` (the capture's own gather of a left-padded batch's rows): kept as it is; the default copies,
    so a later write to the engine's tensor does not reach the record (the negative control)."""
    from logdiff.records.bundle_writer import _snapshot

    x = _values(torch.bfloat16, rows=4)
    assert _snapshot(x, REPLICATE, None, 0, private=True).value.data_ptr() == x.data_ptr()  # its storage
    shared = _snapshot(x, REPLICATE, None, 0)
    bits = shared.value.view(torch.int16)  # NaN is not equal to itself: the bits are
    assert shared.value.data_ptr() != x.data_ptr() and torch.equal(bits, x.view(torch.int16))
    x.add_(1)
    assert not torch.equal(bits, x.view(torch.int16))


def test_deferred_sketches_equal_sketches_made_in_the_step(tmp_path: Path) -> None:
    steps = [_values(torch.float32, rows=6) for _ in range(3)]
    deferred = _write(tmp_path / "deferred", [x.clone() for x in steps], True, sketched=True, overwrite=True)
    now = _write(tmp_path / "now", [x.clone() for x in steps], True, hold_bytes=0, sketched=True, overwrite=True)
    for k in range(3):
        a, b = deferred.ranks[0].load(k, ["h"])["h"], now.ranks[0].load(k, ["h"])["h"]
        assert a.shape == (6, 5) and np.array_equal(digest_of(a), digest_of(b))
        assert np.array_equal(digest_of(a), digest_of(sketch(host_array(steps[k])[0], "float32", np.arange(40))))


def test_small_records_sketched_together_are_each_records_own_sketches(tmp_path: Path) -> None:
    """The thread sketches a step's small records in one call per dtype and columns (a decode step's hundreds of
    boundaries): each record still reads back as its own rows' sketches, next to a larger record sketched alone
    and a record of another dtype, and equal to the same step sketched record by record in the step."""
    columns = np.arange(40)
    records = {"a": _values(torch.float32, rows=4), "b": _values(torch.float32, rows=5) * 2,
               "c": _values(torch.bfloat16, rows=4), "d": _values(torch.bfloat16, rows=6) - 1,
               "big": _values(torch.float32, rows=500)}  # 20,000 elements: at least BLOCK_ELEMENTS, alone
    bundles = {}
    for hold in (1 << 30, 0):
        writer = BundleWriter(tmp_path / f"hold-{hold}", "train", ParallelLayout(), background=True, hold_bytes=hold)
        writer.begin_step(torch.arange(500), torch.arange(500))
        for name, x in records.items():
            writer.record(name, x, REPLICATE, rows=np.arange(len(x)), sketch_columns=columns)
        writer.close()
        bundles[hold] = Bundle(tmp_path / f"hold-{hold}").ranks[0].load(0, list(records))
    for name, x in records.items():
        raw, dtype = host_array(x)
        expected = sketch(raw, dtype, columns)
        for got in bundles.values():
            assert np.array_equal(got[name], expected, equal_nan=True), name


def test_the_writer_thread_runs_at_the_lowest_priority_and_the_recording_thread_keeps_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's thread writes at nice 19 (a training step's threads get the cores first); the thread that
    records is left as it was, and the bundle reads back as written."""
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("a thread's own nice value is Linux's")

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen, write = [], BundleWriter._write

    def spying(self: BundleWriter, *args: object) -> None:
        seen.append(nice())
        write(self, *args)

    monkeypatch.setattr(BundleWriter, "_write", spying)
    before = nice()
    writer = BundleWriter(tmp_path / "b", "train", ParallelLayout(), background=True)
    writer.begin_step(torch.arange(9), torch.arange(9))
    writer.record("h", _values(torch.float32), REPLICATE)
    writer.close()
    assert seen == [19] and nice() == before
    assert Bundle(tmp_path / "b").ranks[0].load(0, ["h"])["h"].shape == (9, 40)


def test_a_failing_writer_thread_is_one_error_and_the_bundle_lists_only_written_steps(tmp_path: Path) -> None:
    import time

    writer = BundleWriter(tmp_path / "b", "train", ParallelLayout(), background=True)
    x = _values(torch.float32)
    writer.begin_step(torch.arange(9), torch.arange(9))
    writer.record("h", x, REPLICATE)
    writer.begin_step(torch.arange(9), torch.arange(9))  # step 0 goes to the thread
    deadline = time.monotonic() + 60
    while writer._written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer._written == 1
    blocker = tmp_path / "b" / "rank-00000" / ".step-000001.safetensors.tmp"
    blocker.mkdir()  # the next file cannot be written (a directory where its temporary goes; root ignores modes)
    writer.record("h", x, REPLICATE)
    with pytest.raises(RuntimeError, match="bundle writer failed"):
        writer.close()
    part = Bundle(tmp_path / "b").ranks[0]
    assert [s["file"] for s in part.steps] == ["step-000000.safetensors"]  # only the step on disk
    assert part.load(0, ["h"])["h"].shape == (9, 40)


def _held_at_each_step(tmp_path: Path, hold_bytes: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], int]:
    """The host bytes a background writer holds after each of 6 steps of 4 whole 16 KiB records (its thread slowed
    to 0.2 s a step), and one step's bytes."""
    import time

    slow = BundleWriter._write
    monkeypatch.setattr(BundleWriter, "_write", lambda self, *a: (time.sleep(0.2), slow(self, *a))[1])
    writer = BundleWriter(tmp_path / f"held-{hold_bytes}", "train", ParallelLayout(), background=True,
                          pending=8, hold_bytes=hold_bytes)
    x = torch.zeros(64, 64)
    held = []
    for k in range(6):
        writer.begin_step(torch.arange(64), torch.arange(64))
        for name in "abcd":
            writer.record(name, x + k, REPLICATE)
        writer.end_step()
        held.append(writer._held)
    writer.close()
    assert len(Bundle(tmp_path / f"held-{hold_bytes}").ranks[0].steps) == 6
    return held, 4 * x.numel() * 4


def test_the_writers_host_copies_stay_within_hold_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held, step = _held_at_each_step(tmp_path, 2 * 4 * 64 * 64 * 4, monkeypatch)  # two steps' worth
    assert max(held) <= 2 * step
    held, step = _held_at_each_step(tmp_path, 0, monkeypatch)  # nothing beyond the step being queued
    assert max(held) <= step
    held, step = _held_at_each_step(tmp_path, 1 << 30, monkeypatch)  # negative control: the queue runs ahead
    assert max(held) > 2 * step


def test_a_failed_writer_at_its_byte_bound_raises_instead_of_waiting(tmp_path: Path) -> None:
    writer = BundleWriter(tmp_path / "b", "train", ParallelLayout(), background=True, hold_bytes=0)
    (tmp_path / "b" / "rank-00000" / ".step-000000.safetensors.tmp").mkdir()  # the first file cannot be written
    x = _values(torch.float32)
    raised: list[BaseException] = []

    def steps() -> None:
        try:
            for _ in range(4):  # the second end_step waits for the first step's bytes, then hears of the failure
                writer.begin_step(torch.arange(9), torch.arange(9))
                writer.record("h", x, REPLICATE)
                writer.end_step()
        except RuntimeError as e:
            raised.append(e)

    caller = threading.Thread(target=steps, daemon=True)
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "end_step waits for bytes a failed thread will never free"
    assert raised and "bundle writer failed" in str(raised[0])


def _steps(writer: BundleWriter, n: int) -> None:
    x = _values(torch.float32, rows=4)
    for k in range(n):
        writer.begin_step(torch.arange(4), torch.arange(4))
        writer.record("h", x + k, REPLICATE)
        writer.end_step()


def test_an_open_writer_logs_its_steps_and_rewrites_the_manifest_only_when_the_metadata_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from logdiff.records import bundle_writer

    dumps: list[str] = []
    real = bundle_writer.write_json
    monkeypatch.setattr(bundle_writer, "write_json", lambda path, data: (dumps.append(path.name), real(path, data)))
    rank = tmp_path / "b" / "rank-00000"
    writer = BundleWriter(tmp_path / "b", "train", ParallelLayout())
    _steps(writer, 30)
    assert dumps.count("manifest.json") == 1  # the first step's header, not one manifest per step
    head = json.loads((rank / "manifest.json").read_text())
    assert head["steps"] == [] and head["step_log"] == "steps.jsonl"
    assert len((rank / "steps.jsonl").read_text().splitlines()) == 30
    assert Bundle(tmp_path / "b").num_steps == 30  # an open writer's bundle reads through its log
    writer.meta_update({"fingerprints": {"w": "ab"}})
    _steps(writer, 1)
    assert dumps.count("manifest.json") == 2  # the changed metadata, once
    assert Bundle(tmp_path / "b").ranks[0].meta["fingerprints"] == {"w": "ab"}
    writer.close()
    manifest = json.loads((rank / "manifest.json").read_text())
    assert "step_log" not in manifest and not (rank / "steps.jsonl").exists()  # closed: the manifest whole
    assert [s["file"] for s in manifest["steps"]] == [f"step-{k:06d}.safetensors" for k in range(31)]


def test_a_killed_writers_step_log_reads_without_its_cut_line_and_a_bad_log_is_refused(tmp_path: Path) -> None:
    from logdiff.errors import InputError

    rank = tmp_path / "b" / "rank-00000"
    writer = BundleWriter(tmp_path / "b", "train", ParallelLayout())
    _steps(writer, 3)  # never closed: the process died here
    log = rank / "steps.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines) + "\n" + lines[-1][:25])  # a fourth entry cut short while it was appended
    part = Bundle(tmp_path / "b").ranks[0]
    assert len(part.steps) == 3 and part.load(2, ["h"])["h"].shape == (4, 40)
    log.write_text("\n".join([lines[0], lines[1][:25], lines[2]]) + "\n")  # a bad line before the last
    with pytest.raises(InputError, match="line 2 is not a JSON step entry"):
        Bundle(tmp_path / "b")
    manifest = json.loads((rank / "manifest.json").read_text())
    (rank / "manifest.json").write_text(json.dumps({**manifest, "step_log": "../../elsewhere.jsonl"}))
    with pytest.raises(InputError, match="outside its rank directory"):
        Bundle(tmp_path / "b")
    again = BundleWriter(tmp_path / "b", "train", ParallelLayout())  # the directory reused: a log of its own
    _steps(again, 1)
    assert Bundle(tmp_path / "b").num_steps == 1


def test_an_older_bundle_reads_its_sketches_as_splitmix64_and_compare_refuses_mixed_digests(tmp_path: Path) -> None:
    from logdiff.commands.compare import open_bundles
    from logdiff.errors import InputError

    x = _values(torch.bfloat16)
    new = _write(tmp_path / "new", [x], background=False, sketched=True)
    assert new.sketch_digest == DIGEST
    old_root = tmp_path / "old"
    _write(old_root, [x], background=False, sketched=True)
    manifest_path = old_root / "rank-00000" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["meta"]["sketch_digest"]
    manifest_path.write_text(json.dumps(manifest))
    old = Bundle(old_root)
    assert old.sketch_digest == LEGACY
    logical = old.logical(0, "h")
    # an old bundle's sketches are read as they are (its digest is what it was written with)
    assert np.array_equal(next(iter(logical.values())).value, old.ranks[0].load(0, ["h"])["h"], equal_nan=True)
    with pytest.raises(InputError, match="different digests"):
        open_bundles(tmp_path / "new", old_root)
    manifest["meta"]["sketch_digest"] = "crc32"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="row sketch digests"):
        Bundle(old_root)
