#!/usr/bin/env python3
"""Stage 04: hidden states + vocab mapping + verifier -> EAGLE-3 draft checkpoints in <output-dir>/checkpoints.

Its defaults are the recipe docs/quality.md measured best (Muon at 1e-3, the Eagle-3.1 norms, cosine, noise
0.05, 3 epochs); configs set only what depends on the data's size and the hardware.
Multi-GPU: torchrun --nproc-per-node N 04_train.py ... (one process per GPU, data parallel).
"""
import contextlib
import os
from dataclasses import replace

from common.errors import UserError
from common.cli import add_verifier_flags, run_stage, stage_parser
from common.config import TrainConfig, add_options, from_args
from common.manifest import output_lock
from common.layout import RunDir, default_vocab_dir
from common.verifier import (compute_dtype, load_text_config, load_tokenizer, remote_code_needed, resolve_verifier,
                             verifier_fingerprint)

STAGE = "04_train"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    add_options(p, TrainConfig)  # each flag's default, help and check: common/config.py
    return p


def states_source(cfg: TrainConfig, text_config, verifier_hash: str):
    """The rows and their states, from where --states-from says (common/sources.py)."""
    from common.sources import ColocatedStates, DiskStates, ServerStates
    if cfg.states_from == "disk":
        return DiskStates(cfg.data_dir, cfg.vocab_mapping_dir, verifier_hash, text_config.hidden_size)
    tokenizer = load_tokenizer(cfg.verifier_path, cfg.trust_remote_code)
    if cfg.states_from == "server":
        return ServerStates(cfg.data_dir, cfg.vocab_mapping_dir, text_config, cfg.layers, cfg.states_url, tokenizer,
                            cfg.on_policy, cfg.verifier_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # as 03 pads
    return ColocatedStates(cfg.data_dir, cfg.vocab_mapping_dir, text_config, cfg.layers, cfg.verifier_path,
                           cfg.trust_remote_code, pad_id)


def run(args):
    from common.checkpoint import checkpoint_entries
    from common.plot import plot_training
    run_dir = RunDir(args.output_dir)
    if args.plot:
        if not os.path.exists(run_dir.metrics):
            raise UserError(f"{run_dir.metrics} does not exist: nothing to plot")
        return f"wrote {plot_training(run_dir.metrics, run_dir.plot)}"
    from speculators.losses import resolve_loss_config
    try:
        resolve_loss_config(args.loss, "eager")
    except ValueError as e:
        raise UserError(f"--loss {args.loss}: {e}")
    cfg = from_args(TrainConfig, args)  # each flag's check and the rules between flags
    import torch
    verifier = resolve_verifier(args.verifier_path)
    # the settings resolved in one visible step: the verifier, whether its code runs, the vocab folder, the dtype
    cfg = replace(cfg, verifier_path=verifier, trust_remote_code=remote_code_needed(verifier, args.trust_remote_code),
                  vocab_mapping_dir=cfg.vocab_mapping_dir or default_vocab_dir(cfg.data_dir),
                  dtype=cfg.dtype or compute_dtype("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(cfg.output_dir, exist_ok=True)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    with output_lock(cfg.output_dir) if rank0 else contextlib.nullcontext():  # one run writes a folder
        existing = checkpoint_entries(cfg.output_dir)  # not `latest` alone: it may be gone (rsync without -l)
        if existing and not cfg.resume:
            raise UserError(f"{cfg.output_dir}/checkpoints already holds {', '.join(existing)}: "
                            "pass --resume to continue, or a new --output-dir")
        if not cfg.resume and os.path.exists(run_dir.metrics) and rank0:  # rank 0 alone writes the metrics
            os.remove(run_dir.metrics)
        text_config = load_text_config(verifier, cfg.trust_remote_code)
        verifier_hash = verifier_fingerprint(text_config)
        from common.train import train
        summary = train(cfg, states_source(cfg, text_config, verifier_hash), text_config, verifier_hash)
        if rank0:
            summary += f"; plot {plot_training(run_dir.metrics, run_dir.plot)}"
        return summary

if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
