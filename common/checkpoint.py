"""Stage 04's checkpoints: written beside a temporary name and renamed, with `latest` and `best` links."""
import os
import random
import shutil

import numpy as np
import torch

from common.draft import save_servable, trainable_state
from common.manifest import atomic_write_json


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
