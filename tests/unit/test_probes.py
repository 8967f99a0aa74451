"""GatheredMemory's wait for a storage freed a moment late (probes.other_threads_settle): it waits
while another thread can still drop the storage, and no longer once every other thread sleeps."""
import threading

import pytest

from zero3_recompute.testing import probes

pytestmark = pytest.mark.once_per_torch


def _storage_held_by_a_thread(work):
    """A storage whose last reference a new thread holds, runs ``work()`` with, then drops; the
    thread, started, and the storage's weak reference."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    tensor = torch.ones(1024)
    ref = StorageWeakRef(tensor.untyped_storage())
    holder = threading.Thread(target=work, args=([tensor],))
    del tensor
    holder.start()
    return holder, ref


def test_waits_while_another_thread_is_running_until_it_drops_the_storage(monkeypatch):
    """The thread computes (state R) for a while before it drops the storage; the wait must see
    it freed, however long that takes on a loaded machine (the guard set far out, as a hang guard)."""
    monkeypatch.setattr(probes, "SETTLE_GUARD_S", 300.0)
    dropped = []

    def work(held):
        total = 0
        for step in range(3_000_000):  # tens of milliseconds of Python, on any machine
            total += step
        dropped.append(total)  # before the drop: the wait may return the moment the storage goes
        held.clear()

    holder, ref = _storage_held_by_a_thread(work)
    try:
        assert probes.other_threads_settle(ref.expired) == probes.FREED, \
            "the storage was still alive when the wait gave up"
        assert dropped
    finally:
        holder.join()


def test_stops_waiting_once_every_other_thread_sleeps(monkeypatch):
    """A storage a sleeping thread keeps: the wait ends, the storage alive, because every other
    thread sleeps, not by its guard (set far out here, as a hang guard)."""
    monkeypatch.setattr(probes, "SETTLE_GUARD_S", 300.0)
    release = threading.Event()

    def work(held):
        release.wait()
        held.clear()

    holder, ref = _storage_held_by_a_thread(work)
    try:
        assert probes.other_threads_settle(ref.expired) == probes.SETTLED
        assert not ref.expired()
    finally:
        release.set()
        holder.join()
