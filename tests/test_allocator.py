"""The allocator settings both programs make at start (`agent.wire.allocator`)."""

from __future__ import annotations

import subprocess
import sys

from agent.wire.allocator import tune_malloc

# Buffers a little larger each time, as a receive buffer grows: glibc maps each one afresh
# unless blocks of that size come from the heap. Prints the page faults the loop took.
GROWING_BUFFERS = """
import os, resource, sys
from agent.wire.allocator import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(200):
    buffer = os.urandom((1 << 20) + step * 4096)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", GROWING_BUFFERS, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    return int(done.stdout)


def test_buffers_that_come_and_go_are_not_faulted_in_again() -> None:
    untuned, tuned = faults("untuned"), faults("tuned")
    # 200 buffers of 1 MiB and more: 256 pages each when every one is mapped afresh.
    assert untuned > 200 * 200
    assert tuned * 10 < untuned


def test_an_operators_own_settings_are_left_alone() -> None:
    assert not tune_malloc({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not tune_malloc({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
