"""One thread runs torch on several cores; every other pod thread keeps to one (service.runtime.threads)."""

from __future__ import annotations

import threading

import torch

from service.runtime import threads


def test_io_threads_keep_to_one_core_and_the_compute_thread_uses_all() -> None:
    compute = threads.compute_executor()
    assert compute is threads.compute_executor()  # one per process
    assert compute.submit(torch.get_num_threads).result() == threads.compute_threads()
    io = threads.io_executor(2, "test-io")
    try:
        assert io.submit(torch.get_num_threads).result() == 1
    finally:
        io.shutdown()


def test_one_core_is_a_setting_of_the_calling_thread_only() -> None:
    """The design rests on this: the event loop's thread keeps to one core without slowing the model's thread."""
    seen: list[int] = []

    def elsewhere() -> None:
        threads.one_core()
        seen.append(torch.get_num_threads())

    before = threads.compute_executor().submit(torch.get_num_threads).result()
    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert seen == [1]
    assert threads.compute_executor().submit(torch.get_num_threads).result() == before
