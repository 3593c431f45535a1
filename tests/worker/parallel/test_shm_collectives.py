"""The collectives of tensor parallelism, both transports: two ranks as two threads of
this process, each with its own gloo group and its own view of the shared memory."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from kvserve.model.tensor_parallel import TensorParallelGroup
from kvserve.worker.parallel import shm_collectives
from kvserve.worker.parallel.shm_collectives import SharedMemoryGroup, shm_path
from kvserve.worker.parallel.tensor_parallel_worker import _Channel, _process_group


def run_ranks(fn, size: int = 2):
    """fn(tp) on each rank at once; returns their results by rank."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=60),
                     wait_for_workers=False)
    path = shm_path()
    shared = [SharedMemoryGroup(path, r, size, create=(r == 0)) for r in range(size)]
    shared[0].unlink()
    results, errors = [None] * size, []

    def rank(r: int) -> None:
        try:
            peer = store if r == 0 else TCPStore("127.0.0.1", store.port, size, False,
                                                timeout=timedelta(seconds=60))
            tp = TensorParallelGroup(r, size, _process_group(peer, r, size), shared[r])
            results[r] = fn(tp)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("use_shm", [True, False], ids=["shared-memory", "gloo"])
def test_all_reduce_and_all_gather_give_every_rank_the_same_sums(use_shm, monkeypatch):
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 4096)  # large tensors go in pieces
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(shape, generator=gen) for shape in ((1, 64), (7, 300), (3, 5))]
              for _ in range(2)]

    def fn(tp):
        tp.use_shm = use_shm
        sums = [tp.all_reduce_(x.clone()) for x in inputs[tp.rank]]
        gathered = tp.all_gather_last(inputs[tp.rank][2])
        return sums, gathered

    results = run_ranks(fn)
    for j in range(3):
        expected = inputs[0][j] + inputs[1][j]
        for sums, _ in results:
            assert torch.equal(sums[j], expected)  # the same bits on every rank
    for _, gathered in results:
        assert torch.equal(gathered, torch.cat([inputs[0][2], inputs[1][2]], dim=-1))


def test_commands_reach_the_other_ranks_small_and_large(monkeypatch):
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 4096)
    import kvserve.worker.parallel.tensor_parallel_worker as tpw
    monkeypatch.setattr(tpw, "SLOT_BYTES", 4096)
    messages = [("execute_model", (list(range(10)),)), ("warm_up", (b"x" * 10000,)),
                ("close", ())]

    def fn(tp):
        channel = _Channel(tp)
        if tp.rank == 0:
            for m in messages:
                channel.send(m)
            return messages
        return [channel.receive() for _ in messages]

    assert run_ranks(fn) == [messages, messages]
