"""Flags, YAML configs and the stage wrapper shared by every numbered script.

Precedence: command line > config file (`--config`) > the parser's defaults. A config file holds
top-level keys (applied to every stage that has that flag) and optional per-stage sections
(`prepare`, `vocab`, `extract`, `train`, `evaluate`) whose keys must be flags of that stage.
"""
import argparse
import difflib
import errno
import os
import shutil
import signal
import sys
import time

import yaml

from common.errors import Stopped, UserError, interrupt_on_stop_signals
from common.layout import STAGES
from common.log import fmt_bytes, fmt_duration, log, setup_logging

SECTIONS = {s.name: s.section for s in STAGES}


def check_cuda(device_flag: str) -> None:
    """A CUDA device asked for on a machine without one: one line, before anything loads."""
    import torch
    if device_flag.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device_flag}: this machine has no CUDA GPU; use --device cpu")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag's default and, for a number, its range."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        rule = getattr(action.type, "rule", None)
        return f"{text}; {rule}" if rule else text


def stage_parser(stage: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{stage}.py", description=description,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--config", help="YAML recipe from configs/; command-line flags override it")
    parser.add_argument("--log-file", help="also write the log to this file (default: <output-dir or data-dir>/logs/<stage>.log)")
    return parser


def add_verifier_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier-path", default="default",
                        help="verifier: a local Hugging Face folder, or 'default' for the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the verifier's own modelling/tokenizer code, used only where transformers has no native "
                             "class for its model type (transformers' own are preferred: Kimi-K2.5, DeepSeek-V3)")


def parse_rows(text: str | None) -> tuple[int, int] | None:
    """'A-B' -> (A, B), a half-open range of rows."""
    if text is None:
        return None
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise UserError(f"--rows {text!r}: expected A-B, for example --rows 0-1000")
    if a < 0 or b <= a:
        raise UserError(f"--rows {text!r}: need 0 <= A < B")
    return a, b


# Keys a config may hold at its top level (outside the stage sections): flags that several stages share.
SHARED_KEYS = {"verifier_path", "trust_remote_code", "max_seq_len", "seed", "data_dir", "device", "dtype",
               "tensor_parallel_size", "log_file"}


def config_tokens(parser: argparse.ArgumentParser, values: dict) -> list[str]:
    """Config values as the command-line tokens that would set them, so argparse checks their types and
    choices exactly as it checks typed flags."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}  # noqa: SLF001 - argparse lists its flags nowhere public
    tokens = []
    for key, value in values.items():
        action, flag = actions[key], actions[key].option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise UserError(f"{key}: {value!r} is not true or false")
            tokens.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                raise UserError(f"{key}: {value!r} is not true or false")
            tokens += [flag] if value else []
        elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
            items = value if isinstance(value, list) else [value]
            tokens += [flag, *map(str, items)]
        elif isinstance(value, (dict, list)):
            raise UserError(f"{key}: expected one value, got {type(value).__name__}")
        elif value is not None:
            tokens += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return tokens


def read_config(parser: argparse.ArgumentParser, stage: str, path: str) -> list[str]:
    """The config's values for this stage (its top level, then its section) as command-line tokens."""
    known = {a.dest for a in parser._actions}  # noqa: SLF001 - argparse lists its flags nowhere public
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except OSError as e:
        raise UserError(f"{e.strerror}")
    except yaml.YAMLError as e:
        raise UserError(f"not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(cfg, dict):
        raise UserError(f"the top level is a {type(cfg).__name__}; expected keys (see configs/default.yaml)")
    values = {}
    for key, value in cfg.items():
        k = str(key).replace("-", "_")
        if key in SECTIONS.values():
            if value is not None and not isinstance(value, dict):
                raise UserError(f"section '{key}' is a {type(value).__name__}; expected keys of {key}'s flags")
        elif k not in SHARED_KEYS:
            near = difflib.get_close_matches(k, SHARED_KEYS | known, n=1)
            raise UserError(f"unknown top-level key '{key}'" + (f" (did you mean '{near[0]}'?" if near else " (")
                            + f" stage flags go in their section: {', '.join(SECTIONS.values())})")
        elif k in known:
            values[k] = value
    # a section's key may also be a flag's other name (04's max_seq_len for --pack-tokens); a top-level key is
    # only ever a flag's own name, so it cannot set a renamed flag of one stage for all
    aliases = {o[2:].replace("-", "_"): a.dest for a in parser._actions  # noqa: SLF001 - as above
               for o in a.option_strings if o.startswith("--")}
    for key, value in (cfg.get(SECTIONS[stage]) or {}).items():
        k = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            raise UserError(f"section '{SECTIONS[stage]}' has unknown key '{key}'"
                            + (f" (did you mean '{near[0]}'?)" if near else ""))
        values[k] = value
    tokens = config_tokens(parser, values)
    # the values alone, checked now so that a bad one is reported with the config's name
    required = [a for a in parser._actions if a.required]  # noqa: SLF001 - (may come from the command line)
    parser.exit_on_error = False
    for a in required:
        a.required = False
    try:
        parser.parse_args(tokens)
    except argparse.ArgumentError as e:
        raise UserError(str(e).replace("argument --", ""))
    finally:
        parser.exit_on_error = True
        for a in required:
            a.required = True
    return tokens


def parse_args(parser: argparse.ArgumentParser, stage: str, argv=None) -> argparse.Namespace:
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--config")
    pre, _ = pre_parser.parse_known_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    if pre.config:
        try:
            argv = read_config(parser, stage, pre.config) + argv  # the command line comes last and wins
        except UserError as e:
            parser.error(f"--config {pre.config}: {e}")
    return parser.parse_args(argv)


def effective_config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in sorted(vars(args).items())}


def path_error(e: OSError) -> str:
    if e.errno in (errno.EEXIST, errno.ENOTDIR):  # makedirs under a regular file: "File exists" misleads
        return f"{e.filename}: a file is in the way where a folder belongs; move it or choose another path"
    return f"{e.filename}: {e.strerror or type(e).__name__}; check the path, its permissions and free space"


def run_stage(stage: str, parser: argparse.ArgumentParser, run, argv=None) -> None:
    """Parse, set up logging, run run(args) -> summary line, map user errors to exit 2 with one line."""
    args = parse_args(parser, stage, argv)
    folder = getattr(args, "output_dir", None) or getattr(args, "data_dir", None)
    if isinstance(folder, list):
        folder = None
    log_file = args.log_file or (os.path.join(folder, "logs", f"{stage}.log") if folder else None)
    try:
        setup_logging(stage, log_file)
    except OSError as e:  # the log's folder cannot be made: the data or output path is a file, or read-only
        print(f"error: {path_error(e)}", file=sys.stderr)
        sys.exit(2)
    interrupt_on_stop_signals()
    start = time.time()
    log.info(f"=== {stage} start ===")
    for k, v in effective_config(args).items():
        log.info(f"  {k} = {v}")
    try:
        summary = run(args)
    except UserError as e:
        log.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Stopped as e:
        log.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        resume = "rerun the same command with --resume" if stage == "04_train" else "rerun the same command"
        message = f"stopped by {signal.Signals(signum).name}: nothing half-written is kept; {resume} to continue"
        log.error(message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(128 + signum)
    except OSError as e:  # a path the stage cannot use: a file where a folder belongs, no permission, EIO, ...
        if not e.filename:
            raise
        message = path_error(e)
        log.error(message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a full disk, whichever writer met it (safetensors' error carries the OS's words)
        if getattr(e, "errno", None) != errno.ENOSPC and "No space left on device" not in str(e):
            raise
        where = folder if folder and os.path.isdir(folder) else "."
        message = (f"the disk holding {where} is full ({fmt_bytes(shutil.disk_usage(where).free)} free; "
                   f"{type(e).__name__}: {str(e).splitlines()[0][:160]}); free space, then rerun the same command: "
                   "finished parts are kept, nothing half-written is")
        log.error(message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    log.info(f"{summary + '; ' if summary else ''}done in {fmt_duration(time.time() - start)}")
