"""Stage 04: train the EAGLE-3 draft on extracted hidden states.

Data handling reuses speculators' own pieces (its packing sampler, collate function and the
one-token shift between hidden states and inputs), so our loop trains exactly what its trainer does.
"""
import json
import math
import os
import random
import shutil
import time

import numpy as np
import torch
from safetensors.torch import load_file

from common.cli import UserError
from common.data import load_prepared
from common.draft import build_draft, save_servable, trainable_state
from common.extract import row_file
from common.log import fmt_duration, log, memory_summary
from common.manifest import atomic_write_json, find_stage_dirs, read_manifest, sha256_json


# ---------------------------------------------------------------- data

class HiddenStatesRows(torch.utils.data.Dataset):
    """One item per extracted row, in speculators' training layout, already shifted by one token."""

    def __init__(self, files: list[str], lengths: list[int]):
        self.files, self.lengths = files, lengths

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from speculators.models.eagle3.data import shift_batch
        f = load_file(self.files[i])
        hs = f["hidden_states"]
        return shift_batch({"hidden_states": hs[:, :-1].flatten(1), "verifier_last_hidden_states": hs[:, -1],
                            "input_ids": f["token_ids"], "loss_mask": f["loss_mask"],
                            "lengths": torch.tensor([hs.shape[0]]), "position_ids": torch.arange(hs.shape[0])})


def collect_rows(data_dirs, vocab_dir: str, verifier_hash: str, hidden_size: int):
    """Files and lengths of every extracted row, after checking the upstream manifests agree."""
    folders = find_stage_dirs(data_dirs, "hidden_states", "hidden_states")
    manifests = [read_manifest(f, "hidden_states") for f in folders]
    aux = manifests[0]["aux_layers"]
    for folder, m in zip(folders, manifests):
        if m["aux_layers"] != aux:
            raise UserError(f"{folder} holds aux layers {m['aux_layers']} but {folders[0]} holds {aux}; train on one set")
        if m["hidden_size"] != hidden_size or m["inputs"]["verifier_hash"] != verifier_hash:
            raise UserError(f"{folder} holds states of another verifier (hidden size {m['hidden_size']}, "
                            f"{m['num_hidden_layers']} layers) than --verifier-path; rerun 03_extract_hidden_states.py")
    vm = read_manifest(vocab_dir, "vocab_mapping")
    tok_hashes = {m["inputs"]["tokenizer_hash"] for m in manifests}
    if tok_hashes != {vm["inputs"]["tokenizer_hash"]}:
        raise UserError(f"{vocab_dir} was built for another tokenizer than the hidden states; rerun 02_build_vocab_mapping.py")
    files, lengths = [], []
    for folder, m in zip(folders, manifests):
        for i, n in enumerate(load_prepared(m["inputs"]["prepared_dir"])["seq_len"]):
            files.append(row_file(folder, i))
            lengths.append(n - 1)  # after the one-token shift
    return files, lengths, aux, folders


def split_rows(n: int, val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = math.ceil(n * val_ratio) if val_ratio > 0 else 0
    if n - n_val < 1:
        raise UserError(f"--val-ratio {val_ratio} leaves no training rows out of {n}; lower it")
    return sorted(order[n_val:]), sorted(order[:n_val])


def epoch_batches(lengths, max_len, seed, epoch, rank, world) -> list:
    """Packed batches of row indices for one epoch: deterministic in (seed, epoch), split across ranks."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    sampler = MultipackDistributedBatchSamplerV2(max_len, lengths, world, rank, seed=seed)
    sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


def loader(dataset, subset, batches, args, hidden, n_aux, dtype):
    """A DataLoader over `batches` (lists of indices into `subset`)."""
    from speculators.train.data import CollateFn
    mapped = [[subset[i] for i in b] for b in batches]
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=mapped, num_workers=args.num_workers, pin_memory=torch.cuda.is_available(),
        collate_fn=CollateFn(args.max_seq_len, hidden, n_aux, dtype=dtype),
        persistent_workers=False, prefetch_factor=4 if args.num_workers else None)


# ---------------------------------------------------------------- schedule, metrics

def lr_at(step: int, total: int, args) -> float:
    """Linear warmup, then cosine or linear decay to --min-lr-ratio of --lr, or flat."""
    warmup = args.warmup_steps if args.warmup_steps is not None else int(args.warmup_ratio * total)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    if args.scheduler == "none":
        return args.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if args.scheduler == "cosine" else 1 - progress
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * shape)


def summarize(sums: dict, ttt_steps: int) -> dict:
    """Loss and accuracy per TTT position from summed speculators metrics; `acc` is the share of
    positions whose draft tokens up to that position are all right, so 1 + sum(acc) estimates the
    acceptance length."""
    sums = {k: float(v) for k, v in sums.items()}
    out = {"loss": sums["loss_sum"] / max(sums["loss_total"], 1e-9)}
    out["loss_pos"] = [sums[f"loss_{s}_sum"] / max(sums[f"loss_{s}_total"], 1e-9) for s in range(ttt_steps)]
    out["acc_pos"] = [sums[f"full_acc_{s}_sum"] / max(sums[f"full_acc_{s}_total"], 1e-9) for s in range(ttt_steps)]
    out["est_accept_len"] = 1 + sum(out["acc_pos"])
    return out


def add_metrics(sums: dict, metrics: dict) -> None:
    """Accumulate on the device: reading a value each step would stall the GPU pipeline."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v.detach()


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(out_dir: str, name: str, model, optimizer, state: dict, is_best: bool) -> str:
    """Write checkpoints/<name> beside a temporary name and rename; point `latest` (and `best`) at it."""
    ckpt_root = os.path.join(out_dir, "checkpoints")
    final = os.path.join(ckpt_root, name)
    tmp = os.path.join(ckpt_root, f".tmp.{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    raw = model.module if hasattr(model, "module") else model
    save_servable(raw, tmp)
    torch.save({"model": trainable_state(raw), "optimizer": optimizer.state_dict(), **state},
               os.path.join(tmp, "training_state.pt"))
    atomic_write_json(os.path.join(tmp, "run.json"), {k: v for k, v in state.items() if k not in ("rng",)})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for link, target in [("latest", name)] + ([("best", name)] if is_best else []):
        tmp_link = os.path.join(ckpt_root, f".{link}.tmp")
        if os.path.lexists(tmp_link):
            os.remove(tmp_link)
        os.symlink(target, tmp_link)
        os.replace(tmp_link, os.path.join(ckpt_root, link))
    return final


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- the run

def setup_distributed():
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: one process per GPU (gloo on the CPU)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def run_fingerprint(args, aux, verifier_hash, draft_vocab) -> str:
    """What must match for --resume to continue a run."""
    return sha256_json({"verifier": verifier_hash, "aux": aux, "draft_vocab": draft_vocab, "ttt": args.ttt_steps,
                        "max_seq_len": args.max_seq_len, "val_ratio": args.val_ratio, "seed": args.seed})


def train(args, verifier: str, text_config, verifier_hash: str) -> str:
    rank, world, device = setup_distributed()
    on_gpu = device.type == "cuda"
    torch.manual_seed(args.seed)
    hidden = text_config.hidden_size
    files, lengths, aux, folders = collect_rows(args.data_dir, args.vocab_mapping_dir, verifier_hash, hidden)
    train_idx, val_idx = split_rows(len(files), args.val_ratio, args.seed)
    dataset = HiddenStatesRows(files, lengths)
    attn = "sdpa" if args.attn_impl == "auto" else args.attn_impl  # sdpa measured faster than flex (docs/benchmarks.md)
    model = build_draft(verifier, aux, args.vocab_mapping_dir, args.ttt_steps, attn, args.trust_remote_code).to(device)
    if on_gpu:  # frozen verifier pieces in bf16 once, rather than an autocast copy of them every step
        for frozen in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm):
            frozen.to(torch.bfloat16)
    draft_vocab = model.draft_vocab_size
    from speculators.losses import resolve_loss_config
    loss_config = resolve_loss_config(args.loss, args.loss_implementation if on_gpu else "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=on_gpu)
    fingerprint = run_fingerprint(args, aux, verifier_hash, draft_vocab)
    n_params = sum(p.numel() for p in params)
    if rank == 0:
        log.info(f"{len(files)} rows from {len(folders)} folder(s): {len(train_idx)} train, {len(val_idx)} val; "
                 f"aux layers {aux}; draft vocab {draft_vocab}; {n_params / 1e6:.1f}M trainable parameters; "
                 f"attention {attn}; device {device} x {world}")

    # Resume: model, optimizer, schedule position, data order (epoch + batch) and RNG.
    epoch, step_in_epoch, step, best_val, history_tokens = 0, 0, 0, float("inf"), 0
    latest = os.path.join(args.output_dir, "checkpoints", "latest")
    if args.resume and os.path.exists(latest):
        ckpt = torch.load(os.path.join(latest, "training_state.pt"), map_location="cpu", weights_only=False)
        if ckpt["fingerprint"] != fingerprint:
            raise UserError(f"{os.path.realpath(latest)} was trained with another verifier, layers, vocab, "
                            "--ttt-steps, --max-seq-len, --val-ratio or --seed; use a new --output-dir")
        model.load_state_dict(ckpt["model"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch, step_in_epoch, step = ckpt["epoch"], ckpt["step_in_epoch"], ckpt["step"]
        best_val, history_tokens = ckpt["best_val"], ckpt["tokens"]
        set_rng_state(ckpt["rng"])
        log.info(f"resumed from {os.path.realpath(latest)}: epoch {epoch}, step {step}")
    elif args.resume:
        log.info(f"--resume: no checkpoint in {args.output_dir}; starting fresh")

    if args.compile:
        model.forward = torch.compile(model.forward)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    n_aux = len(aux)
    train_lengths = [lengths[i] for i in train_idx]
    total_steps = args.max_steps or sum(
        math.ceil(len(epoch_batches(train_lengths, args.max_seq_len, args.seed, e, rank, world)) / args.grad_accum)
        for e in range(args.epochs))
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    fwd_kwargs = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": args.ttt_loss_decay, "loss_config": loss_config}

    def forward(batch, noise: bool):
        hs = batch["hidden_states"].to(device, non_blocking=True)
        if noise and args.noise_std > 0:  # augmentation of the train split only
            hs = hs + args.noise_std * torch.randn_like(hs)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            _, loss, metrics = model(
                hidden_states=hs, input_ids=batch["input_ids"].to(device), document_ids=batch["document_ids"].to(device),
                loss_mask=batch["loss_mask"].to(device), position_ids=batch["position_ids"].to(device),
                verifier_last_hidden_states=batch["verifier_last_hidden_states"].to(device), **fwd_kwargs)
        return loss, metrics

    @torch.no_grad()
    def evaluate() -> dict | None:
        if not val_idx:
            return None
        model.eval()
        sums: dict = {}
        batches = epoch_batches([lengths[i] for i in val_idx], args.max_seq_len, 0, 0, rank, world)
        for batch in loader(dataset, val_idx, batches, args, hidden, n_aux, dtype):
            add_metrics(sums, forward(batch, noise=False)[1])
        model.train()
        return summarize(sums, args.ttt_steps)

    def validate(tag: str, epoch_no: int) -> dict | None:
        val = evaluate()
        if val and rank == 0:
            log.info(f"val {tag}: loss {val['loss']:.4f} acc {'/'.join(f'{a:.3f}' for a in val['acc_pos'])} "
                     f"est. accept len {val['est_accept_len']:.2f}")
            log_jsonl({"split": "val", "step": step, "epoch": epoch_no, **val})
        return val

    def log_jsonl(record: dict):
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def checkpoint(name: str, val: dict | None):
        nonlocal best_val
        if rank != 0:
            return
        val_loss = val["loss"] if val else float("inf")
        is_best = val is not None and val_loss < best_val
        best_val = min(best_val, val_loss)
        state = {"epoch": epoch, "step_in_epoch": step_in_epoch, "step": step, "best_val": best_val,
                 "tokens": history_tokens, "fingerprint": fingerprint, "rng": rng_state(), "val": val,
                 "aux_layers": aux, "verifier": verifier, "args": vars(args)}
        path = save_checkpoint(args.output_dir, name, model, optimizer, state, is_best)
        log.info(f"saved {path}{' (best so far)' if is_best else ''}")

    # ------------------------------------------------ the loop
    model.train()
    t_launch = time.time()
    t_last, tokens_since, sums, first_step_logged = time.time(), 0, {}, False
    stop = False
    if rank == 0 and on_gpu and args.compile:
        log.info("torch.compile is running on the first step; this takes a while")
    while epoch < args.epochs and not stop:
        batches = epoch_batches(train_lengths, args.max_seq_len, args.seed, epoch, rank, world)
        micro = batches[step_in_epoch * args.grad_accum:]
        for k, batch in enumerate(loader(dataset, train_idx, micro, args, hidden, n_aux, dtype)):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, args)
            loss, metrics = forward(batch, noise=True)
            (loss / args.grad_accum).backward()
            add_metrics(sums, metrics)
            tokens_since += int((batch["document_ids"] >= 0).sum()) * world
            if (k + 1) % args.grad_accum and k + 1 < len(micro):
                continue
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_in_epoch += 1
            if not first_step_logged and rank == 0:
                log.info(f"first step done {time.time() - t_launch:.1f}s after the loop started"
                         f"{' (includes torch.compile)' if args.compile else ''}")
                first_step_logged = True
            if step % args.log_every == 0 or step == total_steps:
                dt = time.time() - t_last
                s = summarize(sums, args.ttt_steps)
                history_tokens += tokens_since
                eta = (total_steps - step) * dt / args.log_every
                acc = "/".join(f"{a:.3f}" for a in s["acc_pos"])
                if rank == 0:
                    log.info(f"step {step}/{total_steps} epoch {epoch + 1} loss {s['loss']:.4f} acc {acc} "
                             f"lr {optimizer.param_groups[0]['lr']:.2e} {args.log_every / dt:.2f} steps/s "
                             f"{tokens_since / dt:,.0f} tok/s eta {fmt_duration(eta)} {memory_summary()}")
                log_jsonl({"split": "train", "step": step, "epoch": epoch + 1, **s,
                           "lr": optimizer.param_groups[0]["lr"], "tokens_per_s": tokens_since / dt})
                t_last, tokens_since, sums = time.time(), 0, {}
            if args.val_every and step % args.val_every == 0:
                validate(f"step {step}", epoch + 1)
            if args.save_every and step % args.save_every == 0:
                checkpoint(f"step_{step}", None)
            if args.max_steps and step >= args.max_steps:
                stop = True
                break
        else:
            epoch, step_in_epoch = epoch + 1, 0
            checkpoint(f"epoch_{epoch}", validate(f"epoch {epoch}", epoch))
    if stop:
        checkpoint(f"step_{step}", validate(f"step {step}", epoch + 1))
    if world > 1:
        torch.distributed.destroy_process_group()
    return f"trained {step} steps; best val loss {best_val:.4f}; checkpoints in {args.output_dir}/checkpoints"
