"""Check hypershard's Hugging Face GPT-2 import and export against `transformers`.

1. A random `GPT2LMHeadModel` (exact GELU, every parameter perturbed so biases and norms are
   not trivially 0 / 1) is saved with `save_pretrained`; hypershard reads the folder as
   `train --init-from-hf` does and its logits on a fixed batch are compared with transformers'.
2. `hypershard train --init-from-hf` trains it for a few steps on 2 ranks,
   `hypershard export --format hf` writes a folder, `GPT2LMHeadModel.from_pretrained` loads it
   (it must report no missing, unexpected or mismatched weights), and its logits are compared
   with hypershard's logits of the same checkpoint (from the nanoGPT-named export, so the HF
   reader is not what is checked against itself).
3. For information: the logits difference when the config asks for `gelu_new` (OpenAI's GPT-2);
   hypershard computes the exact GELU, as nanoGPT does.

Usage (from the repository root; needs torch and transformers):

    cargo build --release -p hypershard --bin hypershard --example hf_logits
    python crates/hypershard/scripts/hf_gpt2_parity.py --out /tmp/hf-parity

Exit status 1 if a relative difference exceeds --tolerance (default 1e-5): the largest
absolute logit difference divided by the largest absolute logit.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = Path(__file__).resolve().parents[3]
BIN = None
EXAMPLE = None


def run(args):
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], check=True, cwd=ROOT)


def random_model(activation):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=300,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=255,
        eos_token_id=255,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float()


def our_logits(hf_dir, ids, out, nanogpt=None):
    text = ";".join(",".join(str(t) for t in row) for row in ids)
    args = [EXAMPLE, hf_dir, text, out]
    if nanogpt is not None:
        args.append(nanogpt)
    run(args)
    return load_file(str(out))["logits"].float()


def rel_diff(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--profile", default="release", help="target/PROFILE holds the builds")
    args = parser.parse_args()
    global BIN, EXAMPLE
    BIN = ROOT / "target" / args.profile / "hypershard"
    EXAMPLE = ROOT / "target" / args.profile / "examples" / "hf_logits"
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 64), generator=generator).tolist()
    failures = []

    # 1. transformers -> hypershard.
    model = random_model("gelu")
    source = out / "random-gpt2"
    model.save_pretrained(source)
    theirs = hf_logits(model, ids)
    ours = our_logits(source, ids, out / "ours-import.safetensors")
    import_diff = rel_diff(ours, theirs)
    print(f"import: max |ours - transformers| / max |transformers| = {import_diff:.3e}")
    if import_diff > args.tolerance:
        failures.append("import")

    # 2. hypershard train + export -> transformers.
    run_dir = out / "run"
    run(
        [BIN, "train", "--init-from-hf", source, "--nproc", "2", "--mesh", "2", "--steps", "3",
         "--batch-size", "2", "--warmup-steps", "0", "--out", run_dir]
    )
    exported = out / "exported"
    run([BIN, "export", "--checkpoint", run_dir, "--format", "hf", "--out", exported])
    nanogpt = out / "exported-nanogpt.safetensors"
    run([BIN, "export", "--checkpoint", run_dir, "--out", nanogpt])
    loaded, info = GPT2LMHeadModel.from_pretrained(exported, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    print(f"from_pretrained loading info: {info}")
    if problems:
        failures.append(f"from_pretrained reported {problems}")
    theirs = hf_logits(loaded.eval(), ids)
    ours = our_logits(exported, ids, out / "ours-export.safetensors", nanogpt=nanogpt)
    export_diff = rel_diff(ours, theirs)
    moved = rel_diff(theirs, hf_logits(model, ids))
    print(f"export: max |ours - transformers| / max |transformers| = {export_diff:.3e}"
          f" (training moved the logits by {moved:.3e})")
    if export_diff > args.tolerance:
        failures.append("export")

    # 3. For information: OpenAI's GPT-2 uses the tanh-approximated GELU.
    approx = random_model("gelu_new")
    approx_dir = out / "random-gpt2-gelu-new"
    approx.save_pretrained(approx_dir)
    ours = our_logits(approx_dir, ids, out / "ours-gelu-new.safetensors")
    print(f"gelu_new config (exact GELU here): relative difference "
          f"{rel_diff(ours, hf_logits(approx, ids)):.3e} (not checked)")

    if failures:
        print("FAILED:", ", ".join(failures))
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
