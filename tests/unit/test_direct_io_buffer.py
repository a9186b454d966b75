"""The memory O_DIRECT transfers go through: huge-page aligned, private, in huge pages where the kernel has them.

Why it matters: the kernel cuts a direct transfer from 4 KiB pages into 512 KiB device requests, and from 2 MiB
pages into 4 MiB ones; on the development VM that halved the converter's and unshard's write time. Python's
`mmap.mmap(-1, n)` is shared memory, which gets no huge pages under the usual `shmem_enabled=never`: the negative
control below shows it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from preshard.converter.writer import ALIGN, RecordFileWriter, stage_bytes
from preshard.format.fileio import HUGE_PAGE, DirectIOBuffer, direct_io_array
from preshard.format.slicing import BufferPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low <= address < high
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_buffer_is_aligned_and_sized():
    buffer = DirectIOBuffer(3 * HUGE_PAGE + ALIGN)
    assert buffer.array.ctypes.data % HUGE_PAGE == 0
    assert len(buffer.view) == buffer.array.size == 3 * HUGE_PAGE + ALIGN
    buffer.array[:] = 7
    assert bytes(buffer.view[-3:]) == b"\x07\x07\x07"
    buffer.close()
    buffer.close()  # twice is harmless
    assert buffer.view is None and buffer.array is None


def test_close_with_an_array_still_exported_leaves_it_valid():
    buffer = DirectIOBuffer(HUGE_PAGE)
    kept = buffer.array[:10]
    kept[:] = 3
    buffer.close()  # the mapping stays while `kept` lives
    assert kept.tolist() == [3] * 10


@pytest.mark.skipif(not thp_available(), reason="the kernel has no transparent huge pages")
def test_buffer_is_backed_by_huge_pages_and_shared_mmap_is_not():
    buffer = DirectIOBuffer(4 * HUGE_PAGE)
    buffer.array[:] = 1  # first touch
    assert anon_huge_kib(buffer.array.ctypes.data) >= 2 * (HUGE_PAGE >> 10)
    shared = mmap.mmap(-1, 4 * HUGE_PAGE)  # the memory the writer staged in before
    array = np.frombuffer(shared, dtype=np.uint8)
    array[:] = 1
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text():
        assert anon_huge_kib(array.ctypes.data) == 0
    del array
    shared.close()
    buffer.close()


def test_writer_stages_in_a_direct_io_buffer(tmp_path):
    writer = RecordFileWriter(tmp_path / "f", stage=stage_bytes(4))
    writer.append(b"x" * 100)
    assert writer._stage.ctypes.data % HUGE_PAGE == 0
    assert writer._capacity % HUGE_PAGE == 0
    writer.append(os.urandom(3 * writer._capacity))
    writer.close()
    assert (tmp_path / "f").stat().st_size == 100 + 3 * writer._capacity


@pytest.mark.parametrize("files", [1, 4, 8, 32, 1000])
def test_stage_bytes_are_whole_huge_pages(files):
    each = stage_bytes(files)
    assert each % HUGE_PAGE == 0 and HUGE_PAGE <= each <= 8 << 20


def test_pool_takes_aligned_buffers_and_reuses_given_ones():
    pool = BufferPool(keep=2, minimum=HUGE_PAGE)
    first = pool.take(1000)
    assert first.size == 1000 and first.ctypes.data % HUGE_PAGE == 0
    pool.give(first)  # a view: the pool keeps the array it was cut from
    again = pool.take(HUGE_PAGE)
    assert again.ctypes.data == first.ctypes.data
    whole = direct_io_array(3 * HUGE_PAGE)
    pool.give(whole)  # a whole array (its base is the mapping, not an array) is kept as itself
    assert pool.take(3 * HUGE_PAGE).ctypes.data == whole.ctypes.data
