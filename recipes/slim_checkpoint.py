#!/usr/bin/env python3
"""Carry a draft checkpoint between machines without its frozen verifier pieces, and rebuild it.

`strip CKPT DEST` writes DEST/config.json and DEST/model.safetensors without `embed_tokens.weight` and
`lm_head.weight` (for SmolLM2's draft 10 MB instead of 70). `rebuild DEST VERIFIER OUT` puts them back:
the embedding is the verifier's, the draft head is frozen to the verifier's head rows `i + d2t[i]`
(the verifier's tied embedding where it has no lm_head), which is what 04 trains with.
"""
import argparse
import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FROZEN = ("embed_tokens.weight", "lm_head.weight")


def verifier_tensor(verifier: str, names: tuple[str, ...]) -> torch.Tensor | None:
    for path in sorted(glob.glob(os.path.join(verifier, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def strip(ckpt: str, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({k: v for k, v in state.items() if k not in FROZEN}, os.path.join(dest, "model.safetensors"))
    shutil.copy(os.path.join(ckpt, "config.json"), os.path.join(dest, "config.json"))


def rebuild(dest: str, verifier: str, out: str) -> None:
    state = load_file(os.path.join(dest, "model.safetensors"))
    embed = verifier_tensor(verifier, ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"))
    head = verifier_tensor(verifier, ("lm_head.weight", "language_model.lm_head.weight"))
    head = embed if head is None else head
    d2t = state["d2t"].long()
    state["embed_tokens.weight"] = embed.to(torch.bfloat16)
    state["lm_head.weight"] = head[torch.arange(len(d2t)) + d2t].to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip", help="CKPT DEST: drop the frozen verifier pieces")
    s.add_argument("ckpt")
    s.add_argument("dest")
    r = sub.add_parser("rebuild", help="DEST VERIFIER OUT: put them back from the verifier folder")
    r.add_argument("dest")
    r.add_argument("verifier")
    r.add_argument("out")
    a = p.parse_args()
    strip(a.ckpt, a.dest) if a.cmd == "strip" else rebuild(a.dest, a.verifier, a.out)
