"""Host memory of engine.full_state_dict() and full_optimizer_state_dict(), with and without rank0_only.

    torchrun --standalone --nproc_per_node 2 bench/full_state_memory.py [--layers 24] [--width 1024]

A stack of Linear layers (24 x 1024 x 1024: 25.2M parameters, 96 MiB in fp32), stage 3, 12 chunks,
AdamW stepped once (so it has two moments per parameter). For each call, each rank prints how far
its peak resident memory rose above where it was before the call (VmHWM, reset through
/proc/self/clear_refs) and how much the returned dict holds. Run it under
MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go back to the system and each peak is the
call's own. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _bytes(tree) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_bytes(v) for v in tree)
    return 0


def main() -> None:
    import zeroshard
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    engine = zeroshard.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                  {"stage": 3, "chunk_size": 3 << 20})
    engine.backward(engine(torch.randn(2, args.width)).sum())
    engine.step()
    n = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"{n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB in fp32), {len(engine.chunks)} chunks, "
              f"{dist.get_world_size()} ranks")
    for name, call in [("full_state_dict()", lambda: engine.full_state_dict()),
                       ("full_state_dict(rank0_only=True)", lambda: engine.full_state_dict(rank0_only=True)),
                       ("full_optimizer_state_dict()", lambda: engine.full_optimizer_state_dict()),
                       ("full_optimizer_state_dict(rank0_only=True)",
                        lambda: engine.full_optimizer_state_dict(rank0_only=True))]:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        before = _status("VmRSS")
        out = call()
        peak = _status("VmHWM") - before
        kept = _bytes(out) / 2**20
        del out
        for r in range(dist.get_world_size()):
            if r == rank:
                print(f"{name:45s} rank {rank}: peak {peak:6.0f} MiB above the start, the dict holds {kept:6.0f} MiB",
                      flush=True)
            dist.barrier()


if __name__ == "__main__":
    main()
