"""distributed/buffers.py: the pool the stage 2-3 gradient buffers and the reduce-scatters' receive
buffers are taken from on the CPU. The parity suites train through it (their chunks are above
MIN_POOLED), so a buffer handed out while still in use would show there as a wrong model; this
checks the pool's own rules."""
import torch

from zeroshard.distributed.buffers import MIN_POOLED, BufferPool


def test_a_buffer_pool_hands_out_what_was_given_back_and_keeps_a_few():
    pool = BufferPool(keep=2)
    n = MIN_POOLED // 4
    a, b, c = (pool.take(n, torch.float32, torch.device("cpu")) for _ in range(3))
    for t in (a, b, c):
        pool.give(t)
    assert pool.held_bytes == 2 * n * 4  # two kept, the third let go
    again = [pool.take(n, torch.float32, torch.device("cpu")) for _ in range(3)]
    assert {id(again[0]), id(again[1])} == {id(a), id(b)} and again[2] is not c and pool.held_bytes == 0
    pool.give(again[0][1:])  # a view, or a smaller tensor: never kept
    pool.give(torch.empty(8))
    assert pool.take(n - 1, torch.float32, torch.device("cpu")).numel() == n - 1 and pool.held_bytes == 0
