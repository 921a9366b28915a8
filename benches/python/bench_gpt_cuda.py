"""PyTorch's side of `cargo xtask gpu-check`'s GPT step: the model `hypershard train --model
gpt2` trains (nanoGPT's GPT from `compare_nanogpt.py`: tied token embedding and head, biases,
exact GELU, causal attention), trained with AdamW on random tokens, one device per rank. One rank trains plainly;
several run FSDP2 (`fully_shard` on every block, then on the root) over NCCL, or gloo on the
CPU.

Timing is `hypershard train`'s steady state: the first `--warmup` steps are left out and the
tokens of the others, over all ranks, are divided by their summed time, forward to optimizer
step, with the device synchronised at each step's end. Rank 0 prints one JSON line.

  python bench_gpt_cuda.py --preset gpt2 --batch-size 8 --steps 12 --warmup 3
  torchrun --nproc-per-node 2 bench_gpt_cuda.py --preset gpt2 --batch-size 4
  python bench_gpt_cuda.py --preset small --device cpu --steps 4 --warmup 1   # a smoke test
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# nanoGPT's GPT as `compare_nanogpt.py` builds it: beside this file in a gpu-check bundle,
# under crates/hypershard/scripts in the repository.
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / ".." / ".." / "crates" / "hypershard" / "scripts")]
from compare_nanogpt import GPT  # noqa: E402

# (block_size, n_layer, n_head, n_embd, vocab_size): `hypershard train --model` presets.
SHAPES = {
    "small": (64, 4, 4, 64, 256),
    "medium": (128, 6, 6, 192, 256),
    "gpt2": (1024, 12, 12, 768, 50304),
}


def synchronise(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt2", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", default="", help="also write the JSON line to this file")
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must lie in 1 .. --steps - 1")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpt_cuda.py: --device cuda, but torch sees no CUDA device")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (world,))

    block_size, layers, heads, width, vocab = SHAPES[args.preset]
    torch.manual_seed(1337)
    model = GPT(vocab, block_size, layers, heads, width).to(device)
    if world > 1:
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.99),
                                  weight_decay=0.1, fused=device.type == "cuda")
    generator = torch.Generator(device="cpu").manual_seed(rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_seconds = []
    for _ in range(args.steps):
        window = torch.randint(vocab, (args.batch_size, block_size + 1), generator=generator)
        window = window.to(device)
        synchronise(device)
        started = time.perf_counter()
        loss = model(window[:, :-1].contiguous(), window[:, 1:].contiguous())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronise(device)
        step_seconds.append(time.perf_counter() - started)

    timed = step_seconds[args.warmup:]
    tokens = len(timed) * args.batch_size * block_size * world
    if world > 1:
        # The slowest rank decides a synchronous step.
        total = torch.tensor([sum(timed)], device=device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        seconds = total.item()
    else:
        seconds = sum(timed)
    result = {
        "library": "torch",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "world": world,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1e3 * seconds / len(timed),
        "last_loss": loss.item(),
        "peak_device_mib": (torch.cuda.max_memory_allocated(device) / 2**20
                            if device.type == "cuda" else None),
    }
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as out:
                out.write(line + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
