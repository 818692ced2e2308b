"""featcache.read.buffer_read: one buffer's blocks read by the reader thread and the consumer."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from featcache.read.buffer_read import SharedRead


def _tasks(count: int, log: list, delay: float = 0.005, fail_at: int | None = None):
    def task(i: int) -> None:
        log.append((i, threading.current_thread().name))
        time.sleep(delay)  # releases the GIL, as featcache's chunk reads do
        if i == fail_at:
            raise OSError(f"block {i} is unreadable")

    return [lambda i=i: task(i) for i in range(count)]


def test_every_block_is_read_once_by_one_thread_or_the_other():
    log: list = []
    with ThreadPoolExecutor(1, thread_name_prefix="reader") as reader:
        SharedRead(_tasks(40, log), reader).result()
    assert sorted(i for i, _ in log) == list(range(40))
    assert {name for _, name in log} == {threading.current_thread().name, "reader_0"}


def test_unshared_reads_stay_on_the_reader_and_no_reader_means_here():
    log: list = []
    with ThreadPoolExecutor(1, thread_name_prefix="reader") as reader:
        SharedRead(_tasks(10, log), reader, shared=False).result()
    assert sorted(i for i, _ in log) == list(range(10))
    assert {name for _, name in log} == {"reader_0"}
    log.clear()
    SharedRead(_tasks(5, log), None, shared=False).result()
    assert [name for _, name in log] == [threading.current_thread().name] * 5


@pytest.mark.parametrize("fail_at", [0, 1, 17])
def test_the_first_error_of_either_thread_is_raised_and_reading_stops(fail_at):
    log: list = []
    with ThreadPoolExecutor(1, thread_name_prefix="reader") as reader:
        read = SharedRead(_tasks(40, log, fail_at=fail_at), reader)
        with pytest.raises(OSError, match=f"block {fail_at} is unreadable"):
            read.result()
    assert len(log) < 40 and len({i for i, _ in log}) == len(log)


def test_stop_leaves_the_remaining_blocks():
    log: list = []
    with ThreadPoolExecutor(1, thread_name_prefix="reader") as reader:
        read = SharedRead(_tasks(200, log, delay=0.002), reader)
        deadline = time.monotonic() + 10
        while not log and time.monotonic() < deadline:  # the reader has begun
            time.sleep(0.001)
        read.stop()
    assert 0 < len(log) < 200
