"""PyTorch's f32 matmul on one thread at the layer products of a GPT-2 and a medium block.

The PyTorch peer of `cargo run --release -p hypershard-benches --bin bench-gemm`: the same
products in the same layouts (forward `x · Wᵀ`, input gradient `dy · W`, weight gradient
`dyᵀ · x`, 1024 token rows), each timed as the median of `--reps` repetitions of a few calls
after a warm-up. Prints one line per product and, with `--json`, one JSON object.

    python bench_layer_mm.py [--threads 1] [--reps 7] [--model gpt2|medium|both] [--json]
"""

import argparse
import json
import statistics
import time

import torch

TOKENS = 1024
WIDTHS = {"gpt2": 768, "medium": 192}


def products(model):
    c = WIDTHS[model]
    layers = [("qkv", c, 3 * c), ("proj", c, c), ("fc", c, 4 * c), ("fc_proj", 4 * c, c)]
    for name, fan_in, fan_out in layers:
        yield f"{name} forward", (TOKENS, fan_in), (fan_out, fan_in), "a @ b.t()"
        yield f"{name} input grad", (TOKENS, fan_out), (fan_out, fan_in), "a @ b"
        yield f"{name} weight grad", (TOKENS, fan_out), (TOKENS, fan_in), "a.t() @ b"


def flops(a_shape, b_shape, form):
    if form == "a @ b.t()":
        (m, k), (n, _) = a_shape, b_shape
    elif form == "a @ b":
        (m, k), (_, n) = a_shape, b_shape
    else:
        (k, m), (_, n) = a_shape, b_shape
    return 2 * m * k * n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--model", choices=["gpt2", "medium", "both"], default="both")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = ["gpt2", "medium"] if args.model == "both" else [args.model]
    rows = []
    for model in models:
        for name, a_shape, b_shape, form in products(model):
            a = torch.randn(*a_shape)
            b = torch.randn(*b_shape)
            run = {
                "a @ b.t()": lambda: a @ b.t(),
                "a @ b": lambda: a @ b,
                "a.t() @ b": lambda: a.t() @ b,
            }[form]
            calls = 3
            run()
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                times.append((time.perf_counter() - start) / calls)
            median = statistics.median(times)
            gflops = flops(a_shape, b_shape, form) / median / 1e9
            rows.append({"model": model, "name": name, "median_s": median, "gflops": gflops})
            print(f"{model:7s} {name:22s} {median * 1e3:8.3f} ms {gflops:7.1f} GFLOP/s")
    if args.json:
        print(json.dumps({"torch": torch.__version__, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
