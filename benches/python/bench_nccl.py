"""The torch.distributed peer of `bench-nccl`: the same NCCL sweep through PyTorch's NCCL backend.

Reads the plan that `bench-nccl` writes on standard input (JSON: `world`, `iters`, `reps`,
`warmup`, and `cells`, each with `op`, `dtype`, `bytes`, `input_len`, `output_len`, `depth`),
runs it with one process per GPU (rank r on cuda:r, `init_process_group("nccl")` over
127.0.0.1), and prints one JSON object on standard output: `torch`, `nccl` (versions),
`device`, and per cell `rep_seconds`, the slowest rank's time of each repetition. The rows,
bandwidths and ratios are computed by `bench-nccl` from these times, so both sides share one
formula.

A cell is timed exactly as `bench-nccl` times ours:
  * `depth` buffer sets (zeros, the plan's lengths) rotate through the ops; torch could reuse
    one buffer, but ours cannot queue one buffer twice, so both rotate the same sets;
  * `warmup` untimed ops, then `reps` repetitions of: a one-element all-reduce and
    `torch.cuda.synchronize()` (the barrier), t0, `iters` ops back to back,
    `torch.cuda.synchronize()`, t1;
  * the repetition's time is the maximum over ranks (an all-reduce with MAX).
Ops: all_reduce (in place, SUM), broadcast (in place, root 0), all_gather_into_tensor and
reduce_scatter_tensor (out of place, SUM), the same calls as ours.

`--backend gloo` runs the same plan on CPU tensors through gloo: only a check of this script's
plumbing where no GPU exists (gloo has no reduce_scatter_tensor; those cells are skipped).

    python bench_nccl.py < plan.json > report.json
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_sets(cell, device):
    dtype = DTYPES[cell["dtype"]]
    sets = []
    for _ in range(cell["depth"]):
        inp = torch.zeros(cell["input_len"], dtype=dtype, device=device)
        out = torch.zeros(cell["output_len"], dtype=dtype, device=device) if cell["output_len"] else None
        sets.append((inp, out))
    return sets


def op_fn(name):
    if name == "all_reduce":
        return lambda inp, out: dist.all_reduce(inp, op=dist.ReduceOp.SUM)
    if name == "broadcast":
        return lambda inp, out: dist.broadcast(inp, src=0)
    if name == "all_gather":
        return lambda inp, out: dist.all_gather_into_tensor(out, inp)
    if name == "reduce_scatter":
        return lambda inp, out: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
    raise ValueError(f"unknown op {name!r}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cell(cell, plan, device, flag):
    fn = op_fn(cell["op"])
    sets = make_sets(cell, device)
    depth = len(sets)
    for i in range(plan["warmup"]):
        fn(*sets[i % depth])
    sync(device)
    times = []
    for _ in range(plan["reps"]):
        dist.all_reduce(flag)
        sync(device)
        t0 = time.perf_counter()
        for i in range(plan["iters"]):
            fn(*sets[i % depth])
        sync(device)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    del sets
    return slowest.tolist()


def rank_main(rank, world, port, plan, backend, queue):
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            device_id=device,
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    cells = []
    for cell in plan["cells"]:
        if backend == "gloo" and cell["op"] == "reduce_scatter":
            continue
        seconds = time_cell(cell, plan, device, flag)
        cells.append({"op": cell["op"], "dtype": cell["dtype"], "bytes": cell["bytes"], "rep_seconds": seconds})
        if rank == 0:
            per_op = sorted(s / plan["iters"] for s in seconds)[len(seconds) // 2]
            print(
                f"torch-{backend} n={world} {cell['op']:15} {cell['dtype']:4} {cell['bytes']:>10} B "
                f"depth={cell['depth']:2} median={per_op * 1e6:10.2f}us",
                file=sys.stderr,
                flush=True,
            )
    dist.barrier()
    if rank == 0:
        nccl = "none (gloo)"
        if backend == "nccl":
            # A (major, minor, patch[, suffix]) tuple in torch 2.x, a plain number before.
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)
        name = torch.cuda.get_device_name(device) if backend == "nccl" else "cpu"
        report = {"torch": torch.__version__, "nccl": nccl, "device": name, "cells": cells}
        if queue is None:
            print(json.dumps(report), flush=True)
        else:
            queue.put(report)
    dist.destroy_process_group()


def spawned(rank, world, port, plan, backend, queue):
    rank_main(rank, world, port, plan, backend, queue if rank == 0 else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    args = parser.parse_args()
    plan = json.load(sys.stdin)
    world = int(plan["world"])
    if args.backend == "nccl" and torch.cuda.device_count() < world:
        sys.exit(f"bench_nccl.py: world {world} needs {world} GPUs, torch sees {torch.cuda.device_count()}")
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if world == 1:
        rank_main(0, 1, port, plan, args.backend, None)
        return
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(spawned, args=(world, port, plan, args.backend, queue), nprocs=world, join=True)
    print(json.dumps(queue.get()), flush=True)


if __name__ == "__main__":
    main()
