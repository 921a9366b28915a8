"""Train the same GPT on the same data in PyTorch (nanoGPT's model, optimizer and schedule) and
in `hypershard train`, from the same --init weights, and compare the loss curves.

Usage (from the repository root, after `cargo build --release -p hypershard`):

    python crates/hypershard/scripts/compare_nanogpt.py --out /tmp/compare

It writes OUT/init.safetensors (nanoGPT names), runs `hypershard train --init ... --data-order
sequential` on 4 ranks (2x2 HSDP) and this file's PyTorch loop on one process with the same
global batch, and prints the per-step losses and their largest relative difference.

Only torch is needed: the safetensors files are read and written here directly (the format is
an 8-byte header length, a JSON header, then the raw little-endian data).
"""

import argparse
import json
import math
import struct
import subprocess
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# The model: nanoGPT's GPT (pre-LN blocks, causal attention, GELU MLP, tied lm_head), f32.


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, n_embd)
        self.transformer.wpe = nn.Embedding(block_size, n_embd)
        self.transformer.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(n_embd)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif "ln_" not in name:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.transformer.ln_f(x) @ self.transformer.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def save_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        data = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def get_lr(it, lr, min_lr, warmup, decay):
    """nanoGPT's get_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min((it - warmup) / max(decay - warmup, 1), 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hypershard", default="target-cli/release/hypershard")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--data", default="data/shakespeare.txt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # The `small` preset, byte tokens; global batch 32 = 4 ranks x 8.
    V, T, L, H, C = 256, 64, 4, 4, 64
    B, lr, min_lr, warmup, wd, b1, b2, clip = 32, 3e-3, 3e-4, 10, 0.1, 0.9, 0.99, 1.0
    model = GPT(V, T, L, H, C)
    init = args.out / "init.safetensors"
    save_safetensors(init, dict(model.named_parameters()))

    run = args.out / "hypershard"
    subprocess.run(
        [args.hypershard, "train", "--init", str(init), "--data-order", "sequential",
         "--steps", str(args.steps), "--out", str(run), "--data", args.data],
        check=True,
    )
    ours = [json.loads(line)["loss"] for line in open(run / "losses.jsonl")]

    data = torch.tensor(list(Path(args.data).read_bytes()), dtype=torch.long)
    span = len(data) - T - 1
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(b1, b2), eps=1e-8,
    )
    theirs = []
    for step in range(args.steps):
        starts = [((step * B + b) * T) % span for b in range(B)]
        x = torch.stack([data[s:s + T] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + T] for s in starts])
        for group in opt.param_groups:
            group["lr"] = get_lr(step, lr, min_lr, warmup, args.steps)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        theirs.append(loss.item())

    worst = 0.0
    print("step  hypershard  pytorch  rel.diff")
    for step, (a, b) in enumerate(zip(ours, theirs)):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        print(f"{step:4d}  {a:10.6f}  {b:8.6f}  {rel:.2e}")
    print(f"max relative difference over {len(theirs)} steps: {worst:.3e}")
    json.dump({"hypershard": ours, "pytorch": theirs, "max_rel_diff": worst},
              open(args.out / "comparison.json", "w"), indent=1)


if __name__ == "__main__":
    main()
