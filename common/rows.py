"""A row's states file, in one place: its name, its writer, its one validator and the reader of its prefix.

A row's file is `hs_<i>.safetensors` (i = its index in the prepared rows_A-B folder, as speculators'
FileTransfer reads it): `token_ids` [L] int64, `hidden_states` [L, n_aux+1, H] bf16 (aux layers in
order, then the last decoder layer's output before the final norm), `loss_mask` [L] int64. With
`--hidden-states-dtype fp8`, `hidden_states` is float8_e4m3fn and `hidden_states_scales` [L, 1, 1]
float32 holds one scale per token: hs-connectors' fp8 format (its FP8Transfer reads it for speculators).
"""
import contextlib
import glob
import json
import os

import torch
from hs_connectors.fp8_utils import SCALES_KEY as SCALES, quantize_tensor_to_fp8
from safetensors.torch import save_file

from common.errors import UserError

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                      "F8_E4M3": torch.float8_e4m3fn}


def row_file(folder: str, index: int) -> str:
    return os.path.join(folder, f"hs_{index}.safetensors")


def row_files(folder: str) -> list[str]:
    """Every row file in a folder, whatever its index."""
    return glob.glob(os.path.join(folder, "hs_*.safetensors"))


def row_index(path: str) -> int:
    return int(os.path.basename(path)[len("hs_"):-len(".safetensors")])


def save_row(path: str, token_ids, states: torch.Tensor, loss_mask, fp8: bool = False) -> int:
    """Write atomically (temporary name, then rename); return the bytes written."""
    tmp = f"{path}.tmp"
    tensors = {"token_ids": torch.as_tensor(token_ids, dtype=torch.int64),
               "loss_mask": torch.as_tensor(loss_mask, dtype=torch.int64)}
    if fp8:
        tensors["hidden_states"], tensors[SCALES] = quantize_tensor_to_fp8(states)  # hs-connectors' own
    else:
        tensors["hidden_states"] = states.contiguous()
    try:
        save_file(tensors, tmp)
    except BaseException:  # a full disk: leave no part-file taking the space a rerun needs
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    return os.path.getsize(path)


def safetensors_header(f) -> tuple[dict, int]:
    """The header of an open safetensors file and the offset its data starts at."""
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return header, f.tell()


def whole_safetensors(path: str) -> dict:
    """The header of a safetensors file that is whole: it reads, and the file is exactly as long as it says.
    FileNotFoundError if it is missing, ValueError saying what is wrong if not whole."""
    try:
        with open(path, "rb") as f:
            header, base = safetensors_header(f)
        end = max((meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__"), default=0)
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, OSError):
        raise ValueError("damaged (no readable header)")
    size = os.path.getsize(path)
    if size != base + end:
        raise ValueError(f"truncated or damaged ({size:,} bytes, its header says {base + end:,})")
    return header


def row_problem(path: str, tokens: int, n_slots: int, hidden: int, fp8: bool | None = None,
                token_ids: list[int] | None = None) -> str | None:
    """What is wrong with a row's file, or None: missing, not whole, other tensors, another shape, another dtype
    (where `fp8` is given), other tokens (where `token_ids` is given: that reads them)."""
    try:
        header = whole_safetensors(path)
    except FileNotFoundError:
        return "missing"
    except ValueError as e:
        return str(e)
    names = set(header) - {"__metadata__"}
    if names - {SCALES} != {"token_ids", "hidden_states", "loss_mask"} or (fp8 is not None and (SCALES in names) != fp8):
        return f"holding other tensors ({', '.join(sorted(names))})"
    shape = header["hidden_states"]["shape"]
    if shape != [tokens, n_slots, hidden]:
        return f"of the wrong shape: states {shape}, its row needs [{tokens}, {n_slots}, {hidden}]"
    if fp8 is not None and header["hidden_states"]["dtype"] != ("F8_E4M3" if fp8 else "BF16"):
        return f"of {header['hidden_states']['dtype']} states, not {'fp8' if fp8 else 'bf16'}"
    if SCALES in names and header[SCALES]["shape"] != [tokens, 1, 1]:
        return f"of the wrong shape: scales {header[SCALES]['shape']}"
    if token_ids is not None:
        ids = torch.empty(tokens, dtype=torch.int64)
        try:
            read_prefix(path, {"token_ids": ids})
        except UserError as e:
            return str(e).split(": ", 1)[-1]
        if ids.tolist() != token_ids:
            return "of other tokens than its row"
    return None


def check_row_file(path: str, tokens: int, n_slots: int, hidden: int) -> None:
    """A states file is whole before training starts (not when a batch first meets it, hours in): one line
    saying what is wrong with it."""
    problem = row_problem(path, tokens, n_slots, hidden)
    if problem == "missing":
        raise UserError(f"{path} is missing; rerun 03_extract_hidden_states.py (it redoes missing rows)")
    if problem is not None:
        raise UserError(f"{path} is {problem}; rerun 03_extract_hidden_states.py (it redoes it)")


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
