"""Stage 04's checkpoints: written beside a temporary name and renamed, with `latest` and `best` links;
found again for --resume even when `latest` is gone or the newest checkpoint is damaged."""
import json
import os
import random
import shutil

import numpy as np
import torch

from common.errors import UserError
from common.layout import RunDir
from common.draft import save_servable, trainable_state
from common.log import fmt_bytes, log
from common.manifest import atomic_write_json

LINKS = ("latest", "best")
FULL_DISK_BYTES = 16 * 2**20  # what is left when a write failed because the disk is full: a few blocks at most


def save_checkpoint(out_dir: str, name: str, model, optimizer, state: dict, is_best: bool) -> str:
    """Write checkpoints/<name> beside a temporary name and rename; point `latest` (and `best`) at it."""
    ckpt_root = RunDir(out_dir).checkpoints
    final = os.path.join(ckpt_root, name)
    tmp = os.path.join(ckpt_root, f".tmp.{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    raw = model.module if hasattr(model, "module") else model
    try:
        save_servable(raw, tmp)
        torch.save({"model": trainable_state(raw), "optimizer": optimizer.state_dict(), **state},
                   os.path.join(tmp, "training_state.pt"))
        atomic_write_json(os.path.join(tmp, "run.json"), {k: v for k, v in state.items() if k not in ("rng",)})
    except Exception as e:  # safetensors and torch's zip writer say "unexpected pos", not that the disk is full
        free = shutil.disk_usage(ckpt_root).free
        shutil.rmtree(tmp, ignore_errors=True)
        if free < FULL_DISK_BYTES:
            raise UserError(f"the disk holding {ckpt_root} is full ({fmt_bytes(free)} free) while saving {name} "
                            f"({type(e).__name__}); free space there, then rerun with --resume (it continues from "
                            "the last whole checkpoint)") from e
        raise
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


def checkpoint_entries(out_dir: str) -> list[str]:
    """What a new run would write over: the checkpoint folders and links (a dangling `latest` too)."""
    root = RunDir(out_dir).checkpoints
    return sorted(n for n in os.listdir(root) if not n.startswith(".")) if os.path.isdir(root) else []


def saved_step(folder: str) -> int:
    try:
        with open(os.path.join(folder, "run.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1  # unreadable: tried last, and its load says what is wrong


def load_resume_state(out_dir: str) -> tuple[str, dict] | None:
    """The newest checkpoint that loads, and its training state: `latest` if it is whole, else (with a warning)
    the newest other one, so a deleted or damaged `latest` never makes a run start over on its checkpoints.
    None where there is no checkpoint at all."""
    root = RunDir(out_dir).checkpoints
    latest = os.path.join(root, "latest")
    folders = [os.path.join(root, n) for n in checkpoint_entries(out_dir) if n not in LINKS]
    folders = sorted((f for f in folders if os.path.isdir(f)), key=saved_step, reverse=True)
    if os.path.isdir(latest):
        folders.sort(key=lambda f: not os.path.samefile(f, latest))  # latest's target first, the rest by step
    elif folders:
        log.warning(f"{latest} is {'a link to a missing folder' if os.path.lexists(latest) else 'missing'}: "
                    "resuming from the newest checkpoint that loads")
    elif os.path.lexists(latest):
        raise UserError(f"{latest} points at a missing folder and no other checkpoint is left; "
                        "use a new --output-dir or delete the link to start over")
    damaged = []
    for folder in folders:
        try:
            state = torch.load(os.path.join(folder, "training_state.pt"), map_location="cpu", weights_only=False)
            missing = {"model", "optimizer", "step"} - set(state)
            if missing:
                raise ValueError(f"no {', '.join(sorted(missing))}")
        except Exception as e:  # noqa: BLE001 - a torn or foreign file: any error torch.load raises means it cannot be resumed
            damaged.append(f"{os.path.basename(folder)} ({type(e).__name__}: {str(e).split('. ')[0][:120]})")
            continue
        if damaged:
            log.warning(f"resuming from {folder}: the newer {', '.join(damaged)} could not be read")
        return folder, state
    if damaged:
        raise UserError(f"no checkpoint in {root} can be read ({'; '.join(damaged)}); use a new --output-dir")
    return None
