"""Flags, YAML configs and the stage wrapper shared by every numbered script.

Precedence: command line > config file (`--config`) > the parser's defaults. A config file holds
top-level keys (applied to every stage that has that flag) and optional per-stage sections
(`prepare`, `vocab`, `extract`, `train`, `evaluate`) whose keys must be flags of that stage.
"""
import argparse
import os
import sys
import time

import yaml

from common.log import fmt_duration, log, setup_logging

SECTIONS = {"01_prepare_dataset": "prepare", "02_build_vocab_mapping": "vocab",
            "03_extract_hidden_states": "extract", "04_train": "train", "05_evaluate": "evaluate",
            "export_speculators_data": "export"}


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2, no traceback."""


def stage_parser(stage: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{stage}.py", description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML recipe from configs/; command-line flags override it")
    parser.add_argument("--log-file", help="also write the log to this file (default: <output-dir or data-dir>/logs/<stage>.log)")
    return parser


def add_verifier_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier-path", default="default",
                        help="verifier: a local Hugging Face folder, or 'default' for the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the verifier's own modelling/tokenizer code (Kimi, DeepSeek)")


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


def parse_args(parser: argparse.ArgumentParser, stage: str, argv=None) -> argparse.Namespace:
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--config")
    pre, _ = pre_parser.parse_known_args(argv)
    if pre.config:
        known = {a.dest for a in parser._actions}
        try:
            with open(pre.config) as f:
                cfg = yaml.safe_load(f) or {}
        except OSError as e:
            parser.error(f"--config {pre.config}: {e.strerror}")
        except yaml.YAMLError as e:
            parser.error(f"--config {pre.config}: not valid YAML ({str(e).splitlines()[0]})")
        section = cfg.pop(SECTIONS[stage], None) or {}
        for other in SECTIONS.values():
            cfg.pop(other, None)
        values = {k.replace("-", "_"): v for k, v in cfg.items() if k.replace("-", "_") in known}
        for k, v in section.items():
            k = k.replace("-", "_")
            if k not in known:
                parser.error(f"--config {pre.config}: section '{SECTIONS[stage]}' has unknown key '{k}'")
            values[k] = v
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def effective_config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in sorted(vars(args).items())}


def run_stage(stage: str, parser: argparse.ArgumentParser, run, argv=None) -> None:
    """Parse, set up logging, run run(args) -> summary line, map user errors to exit 2 with one line."""
    args = parse_args(parser, stage, argv)
    folder = getattr(args, "output_dir", None) or getattr(args, "data_dir", None)
    if isinstance(folder, list):
        folder = None
    log_file = args.log_file or (os.path.join(folder, "logs", f"{stage}.log") if folder else None)
    setup_logging(stage, log_file)
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
    except KeyboardInterrupt:
        log.error("interrupted; rerun the same command to resume")
        sys.exit(130)
    log.info(f"{summary + '; ' if summary else ''}done in {fmt_duration(time.time() - start)}")
