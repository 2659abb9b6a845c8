"""Stage 04: train the EAGLE-3 draft on extracted hidden states.

Batches are packed by speculators' own sampler and laid out exactly as its shift_batch and CollateFn
lay them out (tests/test_train.py checks this), so our loop trains what its trainer trains.
"""
import json
import math
import os
import queue
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from common.cli import UserError
from common.data import load_prepared
from common.draft import build_draft, save_servable, trainable_state
from common.extract import row_file
from common.log import LAUNCH, fmt_duration, log, memory_summary
from common.manifest import atomic_write_json, find_stage_dirs, read_manifest, sha256_json


# ---------------------------------------------------------------- data

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64}


def safetensors_header(f) -> tuple[dict, int]:
    """The header of an open safetensors file and the offset its data starts at."""
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return header, f.tell()


def read_prefix(path: str, names: dict[str, torch.Tensor]) -> None:
    """Read the first rows of each named tensor of a safetensors file straight into the given
    (pinned) buffers, whose first dimension says how many: no intermediate copies."""
    with open(path, "rb") as f:
        header, base = safetensors_header(f)
        for name, out in names.items():
            meta = header[name]
            if SAFETENSORS_DTYPES[meta["dtype"]] != out.dtype or meta["shape"][1:] != list(out.shape[1:]):
                raise UserError(f"{path}: {name} is {meta['dtype']} {meta['shape']}, expected {out.dtype} "
                                f"[*, {', '.join(map(str, out.shape[1:]))}]; rerun 03_extract_hidden_states.py")
            if meta["shape"][0] < out.shape[0]:
                raise UserError(f"{path}: {name} holds {meta['shape'][0]} tokens, its manifest says at least "
                                f"{out.shape[0]}; rerun 03_extract_hidden_states.py")
            f.seek(base + meta["data_offsets"][0])
            f.readinto(out.view(torch.uint8).numpy())


class PackedBatches:
    """Packed training sequences of extracted rows, in speculators' layout (its shift_batch, then
    its CollateFn: rows shifted by one token, concatenated, cut and zero-padded to max_len).

    Rows are read by `threads` threads straight into a ring of pinned host buffers, copied to the
    device whole and laid out there: its DataLoader path makes five host copies of each 67 MB
    batch (an 8B verifier, 2048 tokens), which measured slower than the training step itself.
    """

    def __init__(self, files, lengths, n_aux: int, hidden: int, max_len: int, device, dtype, threads: int,
                 buffers: int = 3):
        self.files, self.lengths, self.n_aux, self.hidden = files, lengths, n_aux, hidden
        self.max_len, self.device, self.dtype = max_len, device, dtype
        with open(files[0], "rb") as f:
            self.file_dtype = SAFETENSORS_DTYPES[safetensors_header(f)[0]["hidden_states"]["dtype"]]
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="rows-read")
        self.free: queue.Queue = queue.Queue()
        for _ in range(buffers):
            self.free.put(None)  # buffers are made on first use, sized to the batch

    def _plan(self, rows: list[int]):
        """Which rows, and how many shifted tokens of each, fit in max_len."""
        plan, used = [], 0
        for r in rows:
            take = min(self.lengths[r], self.max_len - used)
            if take <= 0:
                break
            plan.append((r, take))
            used += take
        return plan

    def _buffer(self, old, raw_tokens: int):
        if old is not None and old["states"].shape[0] >= raw_tokens:
            if old["release"] is not None:
                old["release"].synchronize()  # its last copy to the device is done
            return old
        pin = self.device.type == "cuda"
        cap = max(raw_tokens, self.max_len + 64)
        return {"states": torch.empty(cap, self.n_aux + 1, self.hidden, dtype=self.file_dtype, pin_memory=pin),
                "ids": torch.empty(cap, dtype=torch.int64, pin_memory=pin),
                "mask": torch.empty(cap, dtype=torch.int64, pin_memory=pin),
                "layout": torch.empty(3, self.max_len, dtype=torch.int64, pin_memory=pin), "release": None}

    def _fill(self, rows: list[int]):
        plan = self._plan(rows)
        buf = self._buffer(self.free.get(), sum(take + 1 for _, take in plan))
        starts = np.cumsum([0] + [take + 1 for _, take in plan])
        list(self.pool.map(lambda job: read_prefix(self.files[job[0][0]], {
            "hidden_states": buf["states"][job[1]:job[1] + job[0][1] + 1],
            "token_ids": buf["ids"][job[1]:job[1] + job[0][1] + 1],
            "loss_mask": buf["mask"][job[1]:job[1] + job[0][1] + 1]}), zip(plan, starts)))
        takes = [take for _, take in plan]
        n = sum(takes)
        # Shifted token k of row j pairs aux states at raw position start_j + k with the token,
        # loss mask and last-layer state at start_j + k + 1. Written into the pinned buffer: a
        # copy from pageable memory would make the host wait for the GPU every step.
        if plan:
            layout = buf["layout"][:, :n].numpy()
            layout[0] = np.concatenate([np.arange(s, s + t) for s, t in zip(starts, takes)])
            layout[1] = np.concatenate([np.arange(1, t + 1) for t in takes])
            layout[2] = np.repeat(np.arange(len(takes)), takes)
        return buf, int(starts[-1]), n

    def _assemble(self, buf, raw: int, n: int) -> dict:
        dev, L = self.device, self.max_len
        states = buf["states"][:raw].to(dev, non_blocking=True)
        ids, mask = buf["ids"][:raw].to(dev, non_blocking=True), buf["mask"][:raw].to(dev, non_blocking=True)
        src, pos, doc = buf["layout"][:, :n].to(dev, non_blocking=True)
        if dev.type == "cuda":  # the host buffer may be refilled once these copies are done
            buf["release"] = torch.cuda.Event()
            buf["release"].record()

        def padded(values, fill=0):
            out = torch.full((1, L, *values.shape[1:]), fill, dtype=values.dtype, device=dev)
            out[0, :n] = values
            return out
        return {"hidden_states": padded(states[src, :self.n_aux].flatten(1).to(self.dtype)),
                "verifier_last_hidden_states": padded(states[src + 1, self.n_aux].to(self.dtype)),
                "input_ids": padded(ids[src + 1]), "loss_mask": padded(mask[src + 1]),
                "position_ids": padded(pos), "document_ids": padded(doc, -1), "tokens": n}

    def __call__(self, batches: list[list[int]]):
        """Yield each batch of row indices as device tensors; the next batches are read meanwhile."""
        pending: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()

        def produce():
            try:
                for rows in batches:
                    if stop.is_set():
                        return
                    pending.put(self._fill(rows))
                pending.put(None)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                pending.put(e)

        producer = threading.Thread(target=produce, daemon=True, name="rows-pack")
        producer.start()
        try:
            while (item := pending.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                batch = self._assemble(*item)
                self.free.put(item[0])
                yield batch
        finally:  # stopped early: let the producer finish, and its buffers return to the ring
            stop.set()
            while producer.is_alive() or not pending.empty():
                try:
                    item = pending.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    self.free.put(item[0])


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


class Compiler:
    """torch.compile of the draft's forward, run once on the first batch on a thread of its own while
    the loop goes on with eager steps; the loop switches to the compiled forward when it is built.
    A cold compile took 30-40 s for an 8B-shaped draft on an H200: without this, silent time before the
    first step that looks like a hang. Its one forward runs beside the eager steps, so GPU memory may
    peak near both (measured there, when it also ran a backward: 10.8 GB, against 10.7 eager and 7.9
    compiled). `wait` compiles before the first step instead."""

    def __init__(self, model, call, wait: bool, announce: bool):
        self.model, self.call, self.wait, self.announce = model, call, wait, announce
        self.eager, self.compiled = model.forward, torch.compile(model.forward)
        self.thread, self.error, self.started, self.installed = None, None, 0.0, False

    def _build(self, batch):
        try:
            if batch["input_ids"].is_cuda:  # the current GPU is per thread
                torch.cuda.set_device(batch["input_ids"].device)
            # Forward only, with the backward compiled at once rather than at its first call: running a
            # backward here would read parameters that the loop's optimizer has since updated in place.
            # (Where torch lacks the switch, the loop's first compiled backward compiles it.)
            config = torch._functorch.config  # noqa: SLF001
            eager_bw = {"force_non_lazy_backward_lowering": True} if hasattr(config, "force_non_lazy_backward_lowering") else {}
            with config.patch(eager_bw):
                self.call(self.compiled, batch)
        except Exception as e:  # noqa: BLE001 - reported by finish(); training goes on eager
            self.error = e

    def start(self, batch, step: int):
        if self.started:
            return
        self.started = time.time()
        self.thread = threading.Thread(target=self._build, args=(batch,), daemon=True, name="compile")
        self.thread.start()
        if self.wait:
            self.finish(step)

    def finish(self, step: int, block: bool = True, last: bool = False) -> None:
        """Install the compiled forward, once it is built (waited for if `block`), for the steps after `step`;
        after the `last` step, only let the thread end."""
        if self.installed or not self.started or (not block and self.thread.is_alive()):
            return
        self.thread.join()
        self.installed = True
        if self.error is not None:
            log.warning(f"torch.compile failed ({type(self.error).__name__}: {str(self.error).splitlines()[0][:300]}); "
                        "training goes on with the eager forward")
            return
        if last:
            if self.announce:
                log.info(f"torch.compile took {time.time() - self.started:.1f}s, longer than the run: all its steps were eager")
            return
        self.model.forward = self.compiled
        from torch._dynamo.utils import compile_times
        took = dict(zip(*compile_times(repr="csv", aggregate=True)))
        if self.announce:
            log.info(f"compiled forward in use from step {step + 1}: torch.compile took {time.time() - self.started:.1f}s "
                     f"({float(took.get('_compile.compile_inner', 0)):.1f}s tracing and compiling the forward, "
                     f"{float(took.get('compile_fx.<locals>.bw_compiler', 0)):.1f}s the backward)")


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
    attn = "sdpa" if args.attn_impl == "auto" else args.attn_impl  # sdpa measured faster than flex (docs/benchmarks.md)
    if args.compile and on_gpu:  # inductor's compile workers start while the draft is built (~3 s sooner to the first step)
        from torch._inductor.async_compile import maybe_warm_pool
        maybe_warm_pool()
    t_build = time.time()
    model = build_draft(verifier, aux, args.vocab_mapping_dir, args.ttt_steps, attn, args.trust_remote_code, device=device)
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
        log.info(f"draft built in {time.time() - t_build:.1f}s; {time.time() - LAUNCH:.1f}s since launch")

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

    raw_model = model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    packed = PackedBatches(files, lengths, len(aux), hidden, args.max_seq_len, device, dtype, args.num_workers)
    train_lengths = [lengths[i] for i in train_idx]
    total_steps = args.max_steps or sum(
        math.ceil(len(epoch_batches(train_lengths, args.max_seq_len, args.seed, e, rank, world)) / args.grad_accum)
        for e in range(args.epochs))
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    fwd_kwargs = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": args.ttt_loss_decay, "loss_config": loss_config}

    def forward(batch, noise: bool, fn=None):
        hs = batch["hidden_states"]
        if noise and args.noise_std > 0:  # augmentation of the train split only
            hs = hs + args.noise_std * torch.randn_like(hs)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            _, loss, metrics = (fn or model)(
                hidden_states=hs, input_ids=batch["input_ids"], document_ids=batch["document_ids"],
                loss_mask=batch["loss_mask"], position_ids=batch["position_ids"],
                verifier_last_hidden_states=batch["verifier_last_hidden_states"], **fwd_kwargs)
        return loss, metrics

    compiler = Compiler(raw_model, lambda fn, batch: forward(batch, noise=False, fn=fn)[0],
                        wait=args.compile_wait or world > 1, announce=rank == 0) if args.compile else None

    @torch.no_grad()
    def evaluate() -> dict | None:
        if not val_idx:
            return None
        if compiler:  # the compile thread traces in train mode; after the last step it is only waited for
            compiler.finish(step, last=step >= total_steps)
        model.eval()
        sums: dict = {}
        batches = epoch_batches([lengths[i] for i in val_idx], args.max_seq_len, 0, 0, rank, world)
        for batch in packed([[val_idx[i] for i in b] for b in batches]):
            # eager: a compiled no-grad graph would be a second compile (silent, ~20 s cold) for a few batches
            add_metrics(sums, forward(batch, noise=False, fn=compiler.eager if compiler else None)[1])
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
    t_loop = time.time()
    t_last, tokens_since, sums, first_step_logged = time.time(), 0, {}, False
    stop = False
    if rank == 0 and compiler:
        log.info("torch.compile starts on the first batch" + (
            "; the first step waits for it" if compiler.wait else ", beside eager steps until it is ready"))
    while epoch < args.epochs and not stop:
        batches = epoch_batches(train_lengths, args.max_seq_len, args.seed, epoch, rank, world)
        micro = batches[step_in_epoch * args.grad_accum:]
        for k, batch in enumerate(packed([[train_idx[i] for i in b] for b in micro])):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, args)
            if compiler:
                compiler.start(batch, step)
                compiler.finish(step, block=False)
            loss, metrics = forward(batch, noise=True)
            (loss / args.grad_accum).backward()
            add_metrics(sums, metrics)
            tokens_since += batch["tokens"] * world
            if (k + 1) % args.grad_accum and k + 1 < len(micro):
                continue
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_in_epoch += 1
            if not first_step_logged and rank == 0:
                log.info(f"first step done {time.time() - LAUNCH:.1f}s after launch, {time.time() - t_loop:.1f}s "
                         f"after the loop started")
                first_step_logged = True
            if step % args.log_every == 0 or step == total_steps:
                if on_gpu:  # the interval ends when its last step's work has run, not when it was queued
                    torch.cuda.synchronize()
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
            val = validate(f"step {step}", epoch + 1) if args.val_every and step % args.val_every == 0 else None
            if args.max_steps and step >= args.max_steps:
                stop = True
                break
            if args.save_every and step % args.save_every == 0:
                checkpoint(f"step_{step}", val)
        else:
            epoch, step_in_epoch = epoch + 1, 0
            checkpoint(f"epoch_{epoch}", validate(f"epoch {epoch}", epoch))
    if stop:  # the last step's checkpoint (not a second one by --save-every), validated once
        checkpoint(f"step_{step}", val if val is not None else validate(f"step {step}", epoch + 1))
    if compiler:  # a run shorter than the compile: let its thread end before the process does
        compiler.finish(step, last=True)
    if world > 1:
        torch.distributed.destroy_process_group()
    return f"trained {step} steps; best val loss {best_val:.4f}; checkpoints in {args.output_dir}/checkpoints"
