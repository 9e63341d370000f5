"""CUDA paths that the CPU suite cannot reach; these run where CUDA is present (the rest of the suite
also trains on the GPU there, the engine's default device) and are skipped on a CPU-only machine.
Each guards a failure or a host-device synchronisation found on the first GPU run (issue 19)."""
import pytest
import torch

import zeroshard
from distributed import spawn
from models import ADAMW_TOL, CUDA, batches, make_adamw, max_diff, reference, tiny_gpt2, train

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")


def _staged_collectives(rank, world):
    from zeroshard.distributed.collectives import Comm, init_process_group
    device = torch.device("cuda", 0)
    init_process_group(device)  # ranks share one GPU: gloo, CUDA tensors staged through the host
    comm = Comm(device)
    assert comm.staged
    shard = torch.full((3,), float(rank + 1), device=device)
    full = torch.empty(3 * world, device=device)
    comm.all_gather(full, shard, async_op=True).wait()
    assert full.tolist() == [float(r + 1) for r in range(world) for _ in range(3)]
    grads = torch.arange(2 * world, dtype=torch.float32, device=device) * (rank + 1)
    comm.reduce_scatter_sum(grads, async_op=True).wait()
    total = sum(r + 1 for r in range(world))
    assert grads[2 * rank:2 * rank + 2].tolist() == [float(i * total) for i in (2 * rank, 2 * rank + 1)]
    t = torch.ones(4, device=device)
    comm.all_reduce_sum(t)
    assert t.tolist() == [float(world)] * 4


@gpu
def test_ranks_sharing_a_gpu_run_collectives_over_gloo():
    spawn(2, _staged_collectives)


def _diverging_order(rank, world, out):
    from zeroshard.distributed.collectives import Comm, init_process_group
    from zeroshard.errors import DivergedError
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_process_group(device)
    comm = Comm(device)
    comm.enable_order_checks()
    full = torch.zeros(4 * world, device=device)
    comm.all_gather(full, torch.ones(4, device=device), async_op=True, tag=(1, 0)).wait()  # agree
    try:  # disagree: refused before the NCCL collective is issued, on host tensors (no device sync)
        comm.all_gather(full, torch.ones(4, device=device), async_op=True, tag=(1, 1 + rank)).wait()
        raised = False
    except DivergedError:
        raised = True
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(raised))


@two_gpus
def test_order_checks_on_nccl_raise_on_every_rank(tmp_path):
    spawn(2, _diverging_order, str(tmp_path / "raised"))
    assert [(tmp_path / f"raised.{r}").read_text() for r in range(2)] == ["True", "True"]


@gpu
def test_activation_offload_backward_does_not_wait_on_the_host(monkeypatch):
    """Each saved tensor's upload follows its download in the side stream's order: backward must not
    block the host on an event (94 waits per backward before the fix, bench/gpu_syncs.py)."""
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "offload_activations": True})
    data = batches(2, 1, 1)
    train(engine, data[:1], 0)
    waits = []
    real = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (waits.append(1), real(self))[1])
    x = data[1, 0, 0]
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    assert waits == []
    monkeypatch.undo()
    engine.step()
    assert engine.stats()["transfer_bytes"]["d2h"] > 0  # activations really went to the host


@gpu
def test_stage3_training_on_the_gpu_matches_the_cpu_reference():
    data = batches(3, 1, 1)
    ref, _, _ = reference(tiny_gpt2(), data, make_adamw)
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "cache_chunks": 2, "chunk_size": 20000})
    assert engine.device.type == "cuda"
    train(engine, data, 0)
    assert max_diff(engine.full_state_dict(), ref) <= ADAMW_TOL


@gpu
def test_an_upload_waited_for_by_the_device_can_still_be_synced_by_the_host():
    """Staging buffers are reused once the upload reading them is done (`Pending.sync`). The upload
    was already `wait()`ed, which only orders the compute stream; sync() must still block the host
    until the copy has run (it did nothing after wait() before: the host could overwrite a staging
    buffer the side stream had not yet read)."""
    from zeroshard.runtime.offload import Transfer
    t = Transfer(torch.device("cuda", 0))
    host = t.host_copy_of(torch.ones(1 << 20))
    torch.cuda._sleep(200_000_000)  # the compute stream is busy; the side stream's copy queues behind it
    pending = t.to_device(host)
    pending.wait()
    assert not pending.event.query()  # still queued: the host got here first
    pending.sync()
    assert pending.event.query()
    assert torch.equal(pending.tensor.cpu(), host)


@gpu
def test_delayed_update_on_cuda_trains_the_delayed_reference():
    """The delayed update's thread, staging buffers and uploads on a real device (fp32 SGD)."""
    from models import delayed_reference, make_sgd
    data = batches(5, 1, 2)
    ref = delayed_reference(tiny_gpt2(), data, make_sgd, 2)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 2, "chunk_size": 20000, "offload_optimizer": True,
                                                         "delay_update_after": 2})
    assert engine.device.type == "cuda"
    train(engine, data, 0)
    assert max_diff(engine.full_state_dict(), ref) <= 1e-5
