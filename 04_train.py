#!/usr/bin/env python3
"""Stage 04: hidden states + vocab mapping + verifier -> EAGLE-3 draft checkpoints in <output-dir>/checkpoints.

Its defaults are the recipe docs/quality.md measured best (Muon at 1e-3, the Eagle-3.1 norms, cosine, noise
0.05, 3 epochs); configs set only what depends on the data's size and the hardware.
Multi-GPU: torchrun --nproc-per-node N 04_train.py ... (one process per GPU, data parallel).
"""
import argparse
import contextlib
import os

from common.errors import UserError
from common.cli import add_verifier_flags, number, run_stage, stage_parser
from common.manifest import output_lock
from common.layout import DataDir, RunDir
from common.verifier import load_text_config, resolve_verifier, verifier_fingerprint

STAGE = "04_train"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--data-dir", nargs="+", default=["data"],
                   help="extracted hidden states: one or more rows_A-B folders, hidden_states/ folders or data roots")
    p.add_argument("--vocab-mapping-dir", help="output of stage 02 (default: the vocab_mapping folder beside the data)")
    p.add_argument("--output-dir", default="out", help="checkpoints, metrics.jsonl, plots and the log go here")
    p.add_argument("--epochs", type=number(int, 1), default=3, help="passes over the training rows")
    p.add_argument("--max-steps", type=number(int, 1), help="stop after this many optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=number(float, 0, low_open=True), default=1e-3,
                   help="peak learning rate (of both optimizer groups under muon, unless --muon-lr)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="muon",
                   help="muon: Muon on fc and the decoder layer's matrices, AdamW on the norms (speculators' default)")
    p.add_argument("--muon-lr", type=number(float, 0, low_open=True), help="peak lr of the Muon group (default --lr; its update is scaled to AdamW's RMS)")
    p.add_argument("--norm-before-fc", action=argparse.BooleanOptionalAction, default=True,
                   help="Eagle-3.1: an RMSNorm over the concatenated aux states before fc (speculators' eagle3 default)")
    p.add_argument("--norm-output", action=argparse.BooleanOptionalAction, default=True,
                   help="Eagle-3.1: feed the normed draft output back across TTT steps (speculators' eagle3 default)")
    p.add_argument("--min-lr-ratio", type=number(float, 0, 1), default=0.0, help="final learning rate as a share of --lr")
    p.add_argument("--scheduler", choices=["cosine", "linear", "none"], default="cosine", help="decay after warmup")
    p.add_argument("--warmup-steps", type=number(int, 0), help="warmup steps (default: --warmup-ratio of all steps)")
    p.add_argument("--warmup-ratio", type=number(float, 0, 1), default=0.02, help="warmup as a share of all steps")
    p.add_argument("--weight-decay", type=number(float, 0), default=0.01, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=number(float, 0, low_open=True), default=1.0, help="gradient norm clip")
    p.add_argument("--grad-accum", type=number(int, 1), default=1, help="packed sequences per optimizer step (per GPU)")
    p.add_argument("--pack-tokens", "--max-seq-len", dest="pack_tokens", type=number(int, 2), default=2048,
                   help="tokens per packed training sequence: several rows per step (the batch token budget per GPU); "
                        "a pack that runs out of memory is trained in parts cut at conversation boundaries, and the "
                        "log says so. --max-seq-len is its old name, still accepted (also as a train: key); the "
                        "top-level max_seq_len of a config is 01's row length and does not set it")
    p.add_argument("--draft-layers", type=number(int, 1), default=1,
                   help="decoder layers in the draft (the first reads the token embedding and fc output, as vLLM's "
                        "eagle3 drafts do; more layers cost proportionally more per drafted token at serving)")
    p.add_argument("--draft-intermediate-size", type=number(int, 1),
                   help="width of the draft layers' MLP (default: the verifier's); the draft's hidden size is the "
                        "verifier's, so this is where it can grow (vLLM serves any width)")
    p.add_argument("--ttt-steps", type=number(int, 1), default=3, help="test-time-training unroll: draft positions trained")
    p.add_argument("--ttt-loss-decay", type=number(float, 0, low_open=True), default=1.0, help="loss weight multiplier per TTT step")
    p.add_argument("--noise-std", type=number(float, 0), default=0.05, help="Gaussian noise on input hidden states (train only)")
    p.add_argument("--loss", default="kl_div", help="speculators loss name (kl_div, ce, ...) or a JSON dict of weights")
    p.add_argument("--loss-implementation", choices=["eager", "fused"], default="eager",
                   help="on a GPU: fused (Triton) or eager; the CPU always uses eager")
    p.add_argument("--attn-impl", choices=["auto", "sdpa", "eager", "simple_flex_attention"], default="auto",
                   help="draft attention. auto: sdpa (a dense TTT mask; faster at short packs) up to 16K-token packs, "
                        "from 16K with --compile on a GPU flex attention (a block mask: faster and smaller at long packs, "
                        "docs/benchmarks.md); flex attention without --compile is slow")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="compute dtype of the draft's forward (bf16 autocast over float32 weights) and of the states "
                        "it reads (default bfloat16 on a GPU and on a CPU with AMX or AVX512-BF16, float32 on other CPUs)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the draft forward, on a thread beside the first (eager) steps; the loop "
                        "switches to it when it is built, and logs how long that took (its speed: docs/benchmarks.md)")
    p.add_argument("--compile-wait", action="store_true",
                   help="with --compile: compile before the first step, so every step runs compiled "
                        "(reproducible step for step, and faster over a long run, since eager steps beside a compile run "
                        "slowly; the first step waits ~35 s on a cold cache; always so with several GPUs)")
    p.add_argument("--val-ratio", type=number(float, 0, 1, high_open=True), default=0.05, help="share of rows held out for validation")
    p.add_argument("--val-every", type=number(int, 0), default=0, help="also validate every N steps (0: once per epoch)")
    p.add_argument("--best-by", choices=["accept", "loss"], default="accept",
                   help="which validated checkpoint `best` points at: the highest estimated acceptance length "
                        "(1 + the summed all-correct rates per draft position), or the lowest loss")
    p.add_argument("--save-every", type=number(int, 0), default=0, help="also checkpoint every N steps (0: once per epoch)")
    p.add_argument("--log-every", type=number(int, 1), default=10, help="log a line every N steps")
    p.add_argument("--num-workers", type=number(int, 0), default=4,
                   help="threads reading rows into pinned buffers ahead of the step (0 counts as 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the data order and the noise")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in <output-dir>/checkpoints that loads "
                        "(`latest`, or with a warning the one before); settings that change the run must match")
    p.add_argument("--plot", action="store_true", help="only redraw <output-dir>/training.png from metrics.jsonl")
    return p


def default_vocab_dir(data_dirs: list[str]) -> str:
    """The vocab_mapping folder of the data dir that holds the first data folder."""
    vocab = DataDir.holding(data_dirs[0]).vocab_mapping
    if os.path.isdir(vocab):
        return vocab
    raise UserError(f"no vocab_mapping folder near {data_dirs[0]}; pass --vocab-mapping-dir or run 02_build_vocab_mapping.py")


def run(args):
    from common.checkpoint import checkpoint_entries
    from common.plot import plot_training
    metrics = RunDir(args.output_dir).metrics
    if args.plot:
        if not os.path.exists(metrics):
            raise UserError(f"{metrics} does not exist: nothing to plot")
        return f"wrote {plot_training(metrics, RunDir(args.output_dir).plot)}"
    if args.muon_lr is not None and args.optimizer != "muon":
        raise UserError("--muon-lr sets the Muon group's lr: add --optimizer muon")
    if args.compile_wait and not args.compile:
        raise UserError("--compile-wait changes how --compile compiles: add --compile")
    from speculators.losses import resolve_loss_config
    try:
        resolve_loss_config(args.loss, "eager")
    except ValueError as e:
        raise UserError(f"--loss {args.loss}: {e}")
    args.vocab_mapping_dir = args.vocab_mapping_dir or default_vocab_dir(args.data_dir)
    os.makedirs(args.output_dir, exist_ok=True)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    with output_lock(args.output_dir) if rank0 else contextlib.nullcontext():  # one run writes a folder
        existing = checkpoint_entries(args.output_dir)  # not `latest` alone: it may be gone (rsync without -l)
        if existing and not args.resume:
            raise UserError(f"{args.output_dir}/checkpoints already holds {', '.join(existing)}: "
                            "pass --resume to continue, or a new --output-dir")
        if not args.resume and os.path.exists(metrics) and rank0:  # rank 0 alone writes the metrics
            os.remove(metrics)
        verifier = resolve_verifier(args.verifier_path, args)
        text_config = load_text_config(verifier, args.trust_remote_code)
        from common.train import train
        summary = train(args, verifier, text_config, verifier_fingerprint(text_config))
        if rank0:
            summary += f"; plot {plot_training(metrics, RunDir(args.output_dir).plot)}"
        return summary


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
