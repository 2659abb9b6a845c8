"""Stage 04: train the EAGLE-3 draft on extracted hidden states (the loop; the data is in
common/loader.py, the background compile in common/compiler.py, checkpoints in common/checkpoint.py)."""
import gc
import hashlib
import json
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass

import torch

from common.checkpoint import load_resume_state, rng_state, save_checkpoint, set_rng_state
from common.errors import Stopped, UserError, catch_stop_signals, is_oom
from common.compiler import Compiler
from common.draft import build_draft
from common.loader import epoch_batches, split_pack, split_rows
from common.log import LAUNCH, fmt_duration, log, memory_summary
from common.manifest import atomic_write_text
from common.layout import RunDir
from common.config import TrainConfig


# ---------------------------------------------------------------- schedule, metrics

def lr_scale(step: int, total: int, cfg) -> float:
    """The share of each optimizer group's peak lr at `step`: linear warmup, then cosine or linear decay
    to --min-lr-ratio, or flat."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.scheduler == "none":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.scheduler == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def orthogonalize_float32(grad, ns_coefficients, ns_steps: int, eps: float):
    """torch's Muon orthogonalization (Newton-Schulz), in float32 rather than bfloat16: a CPU that emulates
    bfloat16 multiplies it tens of times slower than float32, which made Muon's step most of the step."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Optimizers:
    """AdamW over every trainable tensor; or, with --optimizer muon, Muon over the matrices of fc and the
    decoder layer and AdamW over the rest (norms), split as speculators' trainer splits them. Every
    group keeps its peak lr, which the schedule scales."""

    def __init__(self, model, cfg, on_gpu: bool):
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.opts, rest = [], [p for _, p in trainable]
        if cfg.optimizer == "muon":
            from speculators.train.optimizers import split_named_params_for_muon
            muon, adamw = split_named_params_for_muon(model)
            if not on_gpu and cfg.dtype == "float32":
                torch.optim._muon._zeropower_via_newtonschulz = orthogonalize_float32  # noqa: SLF001
            self.opts.append(torch.optim.Muon([p for _, p in muon], lr=cfg.muon_lr or cfg.lr, momentum=0.95,
                                              weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))
            rest = [p for _, p in adamw]
        if rest:
            self.opts.append(torch.optim.AdamW(rest, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                               fused=on_gpu))
        for g in self.groups:
            g["peak_lr"] = g["lr"]

    @property
    def groups(self) -> list[dict]:  # looked up each time: load_state_dict replaces the group dicts
        return [g for opt in self.opts for g in opt.param_groups]

    def set_lr_scale(self, scale: float) -> None:
        for g in self.groups:
            g["lr"] = g["peak_lr"] * scale

    def step(self) -> None:
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> list:
        return [opt.state_dict() for opt in self.opts]

    def load_state_dict(self, states: list) -> None:
        """The saved moments and step counts; the peak lr and weight decay stay this run's flags'."""
        flags = [(g["peak_lr"], g["weight_decay"]) for g in self.groups]
        for opt, state in zip(self.opts, states, strict=True):
            opt.load_state_dict(state)
        for g, (peak_lr, weight_decay) in zip(self.groups, flags, strict=True):
            g["peak_lr"], g["weight_decay"] = peak_lr, weight_decay


def summarize(sums: dict, ttt_steps: int) -> dict | None:
    """Loss and accuracy per TTT position from summed speculators metrics; `acc` is the share of
    positions whose draft tokens up to that position are all right, so 1 + sum(acc) estimates the
    acceptance length."""
    sums = {k: float(v) for k, v in sums.items()}
    if not sums.get("loss_total"):  # no batch reached any rank (fewer validation rows than a pack needs)
        return None
    out = {"loss": sums["loss_sum"] / max(sums["loss_total"], 1e-9)}
    out["loss_pos"] = [sums[f"loss_{s}_sum"] / max(sums[f"loss_{s}_total"], 1e-9) for s in range(ttt_steps)]
    out["acc_pos"] = [sums[f"full_acc_{s}_sum"] / max(sums[f"full_acc_{s}_total"], 1e-9) for s in range(ttt_steps)]
    out["est_accept_len"] = 1 + sum(out["acc_pos"])
    return out


def add_metrics(sums: dict, metrics: dict) -> None:
    """Accumulate on the device: reading a value each step would stall the GPU pipeline."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v.detach()


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


def keep_metrics_until(path: str, step: int) -> None:
    """A resumed run replays the steps after its checkpoint: their first records go, so each step is logged once.
    A line that does not parse (torn by a kill mid-write) goes too, with a warning."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    log.warning(f"{path} line {line_no} is damaged (a write cut short?): dropped")
    atomic_write_text(path, "".join(kept))


def append_metrics(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def resume_settings(cfg, aux, verifier_hash: str, data_hash: str, vocab_hash: str, verifier_mlp: int | None) -> dict:
    """Everything that changes what a run computes, by the name a refusal shows: a resumed run must match its
    checkpoint in each. What is left out (the lr, epochs, --max-steps, weight decay, logging, dtype, workers)
    may change on resume, and takes effect."""
    return {"verifier": verifier_hash, "rows (--data-dir)": data_hash, "vocab mapping (d2t.npy)": vocab_hash,
            "aux layers": aux, "--ttt-steps": cfg.ttt_steps, "--ttt-loss-decay": cfg.ttt_loss_decay,
            "--loss": cfg.loss, "--pack-tokens": cfg.pack_tokens, "--grad-accum": cfg.grad_accum,
            "--val-ratio": cfg.val_ratio, "--seed": cfg.seed, "--noise-std": cfg.noise_std,
            "--noise-scale": cfg.noise_scale,
            "--norm-before-fc": cfg.norm_before_fc, "--norm-output": cfg.norm_output, "--optimizer": cfg.optimizer,
            "--draft-layers": cfg.draft_layers, "--draft-intermediate-size": cfg.draft_intermediate_size or verifier_mlp,
            "--scheduler": cfg.scheduler, "--warmup-steps": cfg.warmup_steps, "--warmup-ratio": cfg.warmup_ratio,
            "--min-lr-ratio": cfg.min_lr_ratio, "--grad-clip": cfg.grad_clip}


RENAMED = {"--max-seq-len": "--pack-tokens"}  # a setting's name in checkpoints written before its flag was renamed


def check_resume(folder: str, ckpt: dict, settings: dict, cfg: TrainConfig) -> None:
    """Refuse a resume that would compute another run than the checkpoint's, naming the setting; log the
    flags that changed and take effect."""
    if "settings" not in ckpt:
        log.warning(f"{folder} was written before 04 saved its settings: they cannot be compared with this run's")
    saved_settings = {RENAMED.get(k, k): v for k, v in ckpt.get("settings", {}).items()}
    for name, value in settings.items():
        saved = saved_settings.get(name, value)
        if saved != value:
            what = f"another {name}" if name[0] != "-" else f"{name} {saved} (this run: {value})"
            raise UserError(f"{folder} was trained with {what}: a resumed run must compute the same run; "
                            f"{'pass the same value' if name[0] == '-' else 'restore it'}, or use a new --output-dir")
    old_args = ckpt.get("args", {})
    changed = [f"--{k.replace('_', '-')} {old_args[k]} -> {v}" for k, v in sorted(asdict(cfg).items())
               if k in old_args and old_args[k] != v and k not in ("resume", "output_dir", "data_dir")]
    if changed:
        log.info(f"resumed with changed flags, in effect from here: {', '.join(changed)}")


def timed(batches, waited: list):
    """The batches, adding to waited[0] the seconds spent waiting for each (the source's share of the step)."""
    it = iter(batches)
    while True:
        start = time.perf_counter()
        batch = next(it, None)
        waited[0] += time.perf_counter() - start
        if batch is None:
            return
        yield batch


@dataclass
class Position:
    """Where a run is: what a checkpoint saves besides the weights, and --resume restores."""
    epoch: int = 0          # finished epochs
    step_in_epoch: int = 0  # optimizer steps into the current epoch
    step: int = 0           # optimizer steps in all
    best_score: float = -math.inf
    tokens: int = 0         # trained tokens, up to the last logged step


FLEX, FLEX_BLOCK = "simple_flex_attention", 128  # flex attention's block mask needs lengths in whole blocks
FLEX_FROM_TOKENS = 16384  # packs this long train with flex attention's block mask under --attn-impl auto


def draft_attention(cfg, on_gpu: bool) -> str:
    """--attn-impl auto: sdpa with speculators' dense TTT mask for short packs (compiled, it beat flex attention at
    2K tokens), flex attention's block mask from FLEX_FROM_TOKENS on, compiled: faster and in less memory at long
    packs (docs/benchmarks.md, stage 04 at long context). Flex attention runs only
    compiled: eager, it falls back to a path that materializes every score."""
    long_packs = cfg.pack_tokens >= FLEX_FROM_TOKENS
    if cfg.attn_impl == FLEX and not on_gpu:
        raise UserError(f"--attn-impl {FLEX} trains only on a GPU (torch has no flex attention backward "
                        "on the CPU); use --attn-impl auto")
    if cfg.attn_impl == FLEX and cfg.pack_tokens % FLEX_BLOCK:
        raise UserError(f"--attn-impl {FLEX} needs --pack-tokens in whole blocks of {FLEX_BLOCK} tokens "
                        f"(not {cfg.pack_tokens}): use {cfg.pack_tokens // FLEX_BLOCK * FLEX_BLOCK or FLEX_BLOCK}")
    if cfg.attn_impl != "auto":
        if cfg.attn_impl == FLEX and not cfg.compile:
            log.warning("flex attention without --compile runs its unfused path, which holds every score: "
                        "slow, and out of memory on long packs")
        return cfg.attn_impl
    flex = long_packs and cfg.compile and on_gpu and cfg.pack_tokens % FLEX_BLOCK == 0
    if long_packs and not flex:
        log.info(f"{cfg.pack_tokens}-token packs with sdpa's dense TTT mask: with --compile on a GPU and --pack-tokens "
                 f"in whole {FLEX_BLOCK}-token blocks, flex attention's block mask trains them instead (less memory, faster)")
    return FLEX if flex else "sdpa"


def noised(hs: torch.Tensor, hidden: int, std: float, scale: str) -> torch.Tensor:
    """The aux states ([..., aux layers * hidden]) plus Gaussian noise of `std` (scale "absolute") or of `std`
    times each aux layer's RMS over the batch (scale "rms"): an early layer's states are far smaller than a late
    one's, so one absolute std is much noise for the one and none for the other."""
    if scale == "absolute":
        return hs + std * torch.randn_like(hs)
    layers = hs.unflatten(-1, (-1, hidden))
    rms = layers.float().pow(2).mean(dim=[d for d in range(layers.dim()) if d != layers.dim() - 2], keepdim=True).sqrt()
    return (layers + (std * rms).to(hs.dtype) * torch.randn_like(layers)).flatten(-2)


def forward(model, batch: dict, cfg, loss_config, device, noise: bool):
    """The draft's TTT forward on one packed batch: (loss, speculators' metrics)."""
    hs = batch["hidden_states"]
    if noise and cfg.noise_std > 0:  # augmentation of the train split only
        hs = noised(hs, batch["verifier_last_hidden_states"].shape[-1], cfg.noise_std, cfg.noise_scale)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        _, loss, metrics = model(
            hidden_states=hs, input_ids=batch["input_ids"], document_ids=batch["document_ids"],
            loss_mask=batch["loss_mask"], position_ids=batch["position_ids"],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"], ttt_steps=cfg.ttt_steps,
            ttt_step_loss_decay=cfg.ttt_loss_decay, loss_config=loss_config)
    return loss, metrics


def backward_fitting(model, batch: dict, pieces: int, multiple: int, cfg, loss_config, device, params) -> tuple[dict, int]:
    """Forward and backward of one packed batch, in `pieces` parts (each padded to a `multiple` of tokens);
    on out-of-memory, again in twice as many parts (cut at conversation boundaries, the same tokens and
    loss weights), until it fits. Returns the step's metrics and the number of parts that fit, which later
    batches start from."""
    while True:
        try:
            metrics = {}
            for part, weight in split_pack(batch, pieces, multiple) if pieces > 1 else [(batch, 1.0)]:
                loss, part_metrics = forward(model, part, cfg, loss_config, device, noise=True)
                (loss * weight / cfg.grad_accum).backward()
                add_metrics(metrics, part_metrics)
            return metrics, pieces
        except Exception as e:
            if not is_oom(e):
                raise
            error = str(e).strip().splitlines()[0][:160]
        # out of the except block: its traceback no longer holds the failed step's tensors
        for p in params:  # this micro-batch's partial gradients go (with --grad-accum, the step's earlier ones too)
            p.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if len(split_pack(batch, pieces * 2)) <= len(split_pack(batch, pieces)):
            raise UserError(f"out of memory with each conversation of a {batch['tokens']}-token pack on its own: "
                            f"lower --pack-tokens or free memory ({error})")
        pieces *= 2
        log.warning(f"out of memory on a {batch['tokens']}-token pack ({error}); training each pack in {pieces} parts "
                    "from here on (cut at conversation boundaries, same tokens per step)"
                    + ("; this optimizer step drops its earlier micro-batches" if cfg.grad_accum > 1 else ""))


@torch.no_grad()
def validation_metrics(model, packed, val_rows: list[int], lengths, cfg, loss_config, device, rank, world,
                       fn=None) -> dict | None:
    """Loss, accuracy per position and the estimated acceptance length on the validation rows (through
    `fn`, the model's eager forward when it runs compiled)."""
    if not val_rows:
        return None
    model.eval()
    sums: dict = {}
    # DDP's forward broadcasts its buffers: ranks with unequal numbers of packs would wait on each other for ever;
    # validation needs no collective but the one below, so it runs the module itself
    forward_fn = fn or getattr(model, "module", model)
    # every validation row once: packed as one process would, the packs dealt out to the ranks (the training
    # sampler balances ranks by dropping rows, and with fewer rows than ranks dropped them all)
    batches = epoch_batches([lengths[i] for i in val_rows], cfg.pack_tokens, 0, 0, 0, 1)[rank::world]
    for batch in packed([[val_rows[i] for i in b] for b in batches]):
        add_metrics(sums, forward(forward_fn, batch, cfg, loss_config, device, noise=False)[1])
    model.train()
    if world > 1:  # every rank validated its share (none, with fewer rows than ranks): the sums of all
        shares = [None] * world
        torch.distributed.all_gather_object(shares, {k: float(v) for k, v in sums.items()})
        sums = {k: sum(share.get(k, 0.0) for share in shares) for share in shares for k in share}
    return summarize(sums, cfg.ttt_steps)


def train(cfg: TrainConfig, source, text_config, verifier_hash: str) -> str:
    """Train the draft on the rows and states of `source` (common/sources.py); the summary line."""
    return Trainer(cfg, source, text_config, verifier_hash).run()


class Trainer:
    """04's loop, read top to bottom in run(): set up (here), resume, one epoch at a time (a step, a progress line,
    a stop on a signal), validate, save. The rows and their states come from `source` (disk, colocated or server:
    common/sources.py), the one thing that differs between them."""

    def __init__(self, cfg: TrainConfig, source, text_config, verifier_hash: str):
        self.cfg = cfg
        self.rank, self.world, self.device = setup_distributed()
        self.on_gpu = self.device.type == "cuda"
        torch.manual_seed(cfg.seed)
        self.lengths, self.aux = source.lengths, source.aux
        self.train_rows, self.val_rows = split_rows(len(self.lengths), cfg.val_ratio, cfg.seed)
        attn = draft_attention(cfg, self.on_gpu)
        self.multiple = FLEX_BLOCK if attn == FLEX else 1  # the length a pack cut after out-of-memory is padded to
        if cfg.compile and self.on_gpu:  # inductor's compile workers start while the draft is built (~3 s sooner to the first step)
            from torch._inductor.async_compile import maybe_warm_pool
            maybe_warm_pool()
        t_build = time.time()
        self.model = build_draft(cfg.verifier_path, self.aux, cfg.vocab_mapping_dir, cfg.ttt_steps, attn, cfg.trust_remote_code,
                                 device=self.device, norm_before_fc=cfg.norm_before_fc, norm_output=cfg.norm_output,
                                 num_layers=cfg.draft_layers, intermediate_size=cfg.draft_intermediate_size)
        if cfg.dtype == "bfloat16":  # frozen verifier pieces in bf16 once, rather than an autocast copy of them every step
            for frozen in (self.model.embed_tokens, self.model.lm_head, self.model.verifier_lm_head, self.model.verifier_norm):
                frozen.to(torch.bfloat16)
        from speculators.losses import resolve_loss_config
        self.loss_config = resolve_loss_config(cfg.loss, cfg.loss_implementation if self.on_gpu else "eager")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = Optimizers(self.model, cfg, self.on_gpu)
        with open(os.path.join(cfg.vocab_mapping_dir, "d2t.npy"), "rb") as f:
            vocab_hash = hashlib.sha256(f.read()).hexdigest()[:16]
        self.settings = resume_settings(cfg, self.aux, verifier_hash, source.fingerprint, vocab_hash,
                                        getattr(text_config, "intermediate_size", None))
        if self.rank == 0:
            log.info(f"{len(self.lengths)} rows from {len(source.folders)} folder(s), states from {source.name}: "
                     f"{len(self.train_rows)} train, {len(self.val_rows)} val; "
                     f"aux layers {self.aux}; draft vocab {self.model.draft_vocab_size}; "
                     f"{sum(p.numel() for p in self.params) / 1e6:.1f}M trainable parameters; attention {attn}; "
                     f"device {self.device} x {self.world}, {cfg.dtype}")
            log.info(f"draft built in {time.time() - t_build:.1f}s; {time.time() - LAUNCH:.1f}s since launch")
        self.packed = source.packed(cfg.pack_tokens, self.device, getattr(torch, cfg.dtype), cfg.num_workers)
        self.train_lengths = [self.lengths[i] for i in self.train_rows]
        self.total_steps = cfg.max_steps or sum(math.ceil(len(self.batches(e)) / cfg.grad_accum) for e in range(cfg.epochs))
        self.metrics_path = RunDir(cfg.output_dir).metrics
        self.pos = Position()
        self.raw_model, self.compiler = self.model, None
        self.pieces = 1  # parts each packed batch is trained in: more after an out-of-memory step

    def batches(self, epoch: int) -> list:
        """This rank's packs of one epoch (lists of train-row positions), in the order every run takes them."""
        cfg = self.cfg
        return epoch_batches(self.train_lengths, cfg.pack_tokens, cfg.seed, epoch, self.rank, self.world, cfg.grad_accum)

    def run(self) -> str:
        cfg = self.cfg
        if not self.resume():
            return (f"already finished at step {self.pos.step} (epoch {self.pos.epoch}): nothing to train; "
                    f"checkpoints in {cfg.output_dir}/checkpoints")
        if self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.on_gpu else None)
        # --compile: the forward is compiled on a thread beside eager steps and swapped in when ready
        if cfg.compile:
            self.compiler = Compiler(
                self.raw_model, lambda fn, batch: forward(fn, batch, cfg, self.loss_config, self.device, noise=False)[0],
                wait=cfg.compile_wait or self.world > 1, announce=self.rank == 0)
            if self.rank == 0:
                log.info("torch.compile starts on the first batch" + (
                    "; the first step waits for it" if self.compiler.wait else ", beside eager steps until it is ready"))
        self.stop_signal = catch_stop_signals()
        self.model.train()
        self.t_loop = self.t_last = time.time()
        self.tokens_since, self.sums, self.waited, self.first_step_logged = 0, {}, [0.0], False
        while self.pos.epoch < cfg.epochs:
            val, finished = self.epoch()
            if not finished:  # --max-steps: the last step's checkpoint (not a second one by --save-every), validated once
                self.save(f"step_{self.pos.step}",
                          val if val is not None else self.validate(f"step {self.pos.step}", self.pos.epoch + 1))
                break
            self.pos.epoch, self.pos.step_in_epoch = self.pos.epoch + 1, 0
            self.save(f"epoch_{self.pos.epoch}", self.validate(f"epoch {self.pos.epoch}", self.pos.epoch))
        if self.compiler:  # a run shorter than the compile: let its thread end before the process does
            self.compiler.finish(self.pos.step, last=True)
        if self.world > 1:  # every rank leaves together, DDP (whose reducer holds the process group) before the group
            torch.distributed.barrier()
            self.model = self.raw_model
            gc.collect()
            torch.distributed.destroy_process_group()
        best = (f"best est. accept len {self.pos.best_score:.3f}" if cfg.best_by == "accept"
                else f"best val loss {-self.pos.best_score:.4f}")
        return (f"trained {self.pos.step} steps; {best if self.val_rows else 'no validation split'}; "
                f"checkpoints in {cfg.output_dir}/checkpoints")

    def resume(self) -> bool:
        """--resume: weights, optimizer, position, data order and RNG from the latest checkpoint. False when
        the run it finds has nothing left to train."""
        cfg = self.cfg
        found = load_resume_state(cfg.output_dir) if cfg.resume else None
        if found:
            folder, ckpt = found
            check_resume(folder, ckpt, self.settings, cfg)
            self.model.load_state_dict(ckpt["model"], strict=False)
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.pos = Position(**{k: ckpt[k] for k in asdict(self.pos)})
            set_rng_state(ckpt["rng"])
            log.info(f"resumed from {os.path.realpath(folder)}: epoch {self.pos.epoch}, step {self.pos.step}")
            if self.rank == 0:
                keep_metrics_until(self.metrics_path, self.pos.step)
        elif cfg.resume:
            log.info(f"--resume: no checkpoint in {cfg.output_dir}; starting fresh")
            if self.rank == 0:
                keep_metrics_until(self.metrics_path, 0)  # what a run killed before its first checkpoint logged goes
        return not (self.pos.epoch >= cfg.epochs or (cfg.max_steps and self.pos.step >= cfg.max_steps))

    def epoch(self) -> tuple[dict | None, bool]:
        """The rest of the current epoch, step by step: (the last validation, whether the epoch ran to its end
        rather than to --max-steps)."""
        cfg, pos = self.cfg, self.pos
        micro = self.batches(pos.epoch)[pos.step_in_epoch * cfg.grad_accum:]  # a resumed epoch skips the batches it trained
        val = None
        for k, batch in enumerate(timed(self.packed([[self.train_rows[i] for i in b] for b in micro]), self.waited)):
            self.optimizer.set_lr_scale(lr_scale(pos.step, self.total_steps, cfg))
            if self.compiler:  # swaps the compiled forward into the model when it is ready
                self.compiler.start(batch, pos.step)
                self.compiler.finish(pos.step, block=False)
            metrics, self.pieces = backward_fitting(self.model, batch, self.pieces, self.multiple, cfg, self.loss_config,
                                                    self.device, self.params)
            add_metrics(self.sums, metrics)
            self.tokens_since += batch["tokens"] * self.world
            if (k + 1) % cfg.grad_accum and k + 1 < len(micro):
                continue  # gradient accumulation
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            self.optimizer.step()
            pos.step += 1
            pos.step_in_epoch += 1
            self.log_progress()
            val = self.validate(f"step {pos.step}", pos.epoch + 1) if cfg.val_every and pos.step % cfg.val_every == 0 else None
            self.stop_if_signalled()
            if cfg.max_steps and pos.step >= cfg.max_steps:
                return val, False
            if cfg.save_every and pos.step % cfg.save_every == 0:
                self.save(f"step_{pos.step}", val)
        return val, True

    def log_progress(self) -> None:
        """The first step's time once; every --log-every steps a progress line and a metrics record."""
        cfg, pos = self.cfg, self.pos
        if not self.first_step_logged and self.rank == 0:
            log.info(f"first step done {time.time() - LAUNCH:.1f}s after launch, {time.time() - self.t_loop:.1f}s "
                     f"after the loop started")
            self.first_step_logged = True
        if pos.step % cfg.log_every and pos.step != self.total_steps:
            return
        if self.on_gpu:  # the interval ends when its last step's work has run, not when it was queued
            torch.cuda.synchronize()
        dt = time.time() - self.t_last
        s = summarize(self.sums, cfg.ttt_steps)
        pos.tokens += self.tokens_since
        lr = self.optimizer.groups[-1]["lr"]
        waited = self.waited[0] / dt  # the share of the interval the loop waited for the source's next pack
        if self.rank == 0:
            log.info(f"step {pos.step}/{self.total_steps} epoch {pos.epoch + 1} loss {s['loss']:.4f} acc "
                     f"{'/'.join(f'{a:.3f}' for a in s['acc_pos'])} lr {lr:.2e} {cfg.log_every / dt:.2f} "
                     f"steps/s {self.tokens_since / dt:,.0f} tok/s waited for states {waited:.0%} eta "
                     f"{fmt_duration((self.total_steps - pos.step) * dt / cfg.log_every)} {memory_summary()}")
            append_metrics(self.metrics_path, {"split": "train", "step": pos.step, "epoch": pos.epoch + 1, **s,
                                               "lr": lr, "tokens_per_s": self.tokens_since / dt,
                                               "states_wait_share": waited})
        self.t_last, self.tokens_since, self.sums, self.waited[0] = time.time(), 0, {}, 0.0

    def stop_if_signalled(self) -> None:
        """After SIGTERM or SIGINT: a checkpoint of this step, then Stopped with the command that resumes."""
        if not self.stop_signal:
            return
        self.save(f"step_{self.pos.step}", None)
        resume = shlex.join([sys.executable, *sys.argv] + ([] if "--resume" in sys.argv else ["--resume"]))
        raise Stopped(f"stopped by {signal.Signals(self.stop_signal[0]).name} after step {self.pos.step}, checkpoint "
                      f"saved; resume with: {resume}", self.stop_signal[0])

    def validate(self, tag: str, epoch_no: int) -> dict | None:
        """Validation (eager: a compiled no-grad graph would be a second compile for a few batches), logged."""
        if self.compiler:  # the compile thread traces in train mode; after the last step it is only waited for
            self.compiler.finish(self.pos.step, last=self.pos.step >= self.total_steps)
        val = validation_metrics(self.model, self.packed, self.val_rows, self.lengths, self.cfg, self.loss_config, self.device,
                       self.rank, self.world, fn=self.compiler.eager if self.compiler else None)
        if val and self.rank == 0:
            log.info(f"val {tag}: loss {val['loss']:.4f} acc {'/'.join(f'{a:.3f}' for a in val['acc_pos'])} "
                     f"est. accept len {val['est_accept_len']:.2f}")
            append_metrics(self.metrics_path, {"split": "val", "step": self.pos.step, "epoch": epoch_no, **val})
        return val

    def save(self, name: str, val: dict | None) -> None:
        """A checkpoint. `best` is the one with the highest estimated acceptance length (what serving pays for),
        or with --best-by loss the lowest validation loss."""
        cfg, pos = self.cfg, self.pos
        score = -math.inf if val is None else val["est_accept_len"] if cfg.best_by == "accept" else -val["loss"]
        is_best = score > pos.best_score
        pos.best_score = max(pos.best_score, score)  # on every rank: validation is reduced, the score the same
        if self.rank != 0:
            return
        state = {**asdict(pos), "settings": self.settings, "rng": rng_state(), "val": val, "aux_layers": self.aux,
                 "verifier": cfg.verifier_path, "args": asdict(cfg)}
        path = save_checkpoint(cfg.output_dir, name, self.model, self.optimizer, state, is_best)
        log.info(f"saved {path}{' (best so far)' if is_best else ''}")
