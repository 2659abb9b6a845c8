"""Where the stages' files live, in one place.

A data dir: `prepared/rows_A-B` (01's rows of conversations A to B), `regenerated/rows_A-B` (01's replies by the
verifier, kept for a resumed regeneration), `vocab_mapping/` (02), `hidden_states/rows_A-B` (03, one folder per
prepared shard, named as it). A run dir: `checkpoints/<name>` with the links `latest` and `best`, `metrics.jsonl`
and `training.png` (04). Either holds `logs/<stage>.log`.
"""
import os
from dataclasses import dataclass

from common.errors import UserError

PREPARED, REGENERATED, HIDDEN_STATES, VOCAB_MAPPING = "prepared", "regenerated", "hidden_states", "vocab_mapping"
STAGE_FOLDERS = (PREPARED, REGENERATED, HIDDEN_STATES)  # the folders that hold rows_A-B shards


@dataclass(frozen=True)
class Stage:
    name: str           # the script without .py; its log is logs/<name>.log
    section: str        # its section of a YAML config
    manifest: str = ""  # the `stage` its manifests record, where others read its output
    folder: str = ""    # what it writes in a data dir

    @property
    def script(self) -> str:
        return f"{self.name}.py"


STAGES = (Stage("01_prepare_dataset", "prepare", "prepare", PREPARED),
          Stage("02_build_vocab_mapping", "vocab", "vocab_mapping", VOCAB_MAPPING),
          Stage("03_extract_hidden_states", "extract", "hidden_states", HIDDEN_STATES),
          Stage("04_train", "train"),
          Stage("05_evaluate", "evaluate"),
          Stage("export_speculators_data", "export"))
BY_MANIFEST = {s.manifest: s for s in STAGES if s.manifest}


def shard(a: int, b: int) -> str:
    """The folder name of the shard of conversations a to b (half-open)."""
    return f"rows_{a}-{b}"


def shard_span(folder: str) -> tuple[int, int] | None:
    """(a, b) of a rows_A-B folder, or None for any other name."""
    name = os.path.basename(os.path.normpath(folder))
    try:
        a, b = (int(x) for x in name.removeprefix("rows_").split("-")) if name.startswith("rows_") else (None, None)
    except ValueError:
        return None
    return None if a is None else (a, b)


class DataDir:
    def __init__(self, root: str):
        self.root = root

    @classmethod
    def holding(cls, path: str) -> "DataDir":
        """The data dir that `path` is, or holds it: a data root, one of its stage folders, or a shard folder."""
        path = os.path.abspath(path)
        if shard_span(path) is not None:
            path = os.path.dirname(path)
        return cls(os.path.dirname(path) if os.path.basename(path) in STAGE_FOLDERS + (VOCAB_MAPPING,) else path)

    def prepared(self, name: str = "") -> str:
        return os.path.join(self.root, PREPARED, *[name] * bool(name))

    def regenerated(self, name: str = "") -> str:
        return os.path.join(self.root, REGENERATED, *[name] * bool(name))

    def hidden_states(self, name: str = "") -> str:
        return os.path.join(self.root, HIDDEN_STATES, *[name] * bool(name))

    @property
    def vocab_mapping(self) -> str:
        return os.path.join(self.root, VOCAB_MAPPING)


def states_of(prepared: str, data: DataDir) -> str:
    """The hidden-states folder that 03 writes for a prepared shard, in `data`."""
    return data.hidden_states(os.path.basename(os.path.normpath(prepared)))


def prepared_of(states: str) -> str:
    """The prepared shard a hidden-states folder was extracted from: the same name, beside it in its data dir."""
    states = os.path.abspath(states)
    return DataDir.holding(states).prepared(os.path.basename(states))


class RunDir:
    def __init__(self, root: str):
        self.root = root

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    def checkpoint(self, name: str) -> str:
        return os.path.join(self.checkpoints, name)

    @property
    def metrics(self) -> str:
        return os.path.join(self.root, "metrics.jsonl")

    @property
    def plot(self) -> str:
        return os.path.join(self.root, "training.png")


def default_vocab_dir(data_dirs: list[str]) -> str:
    """The vocab_mapping folder of the data dir that holds the first data folder."""
    vocab = DataDir.holding(data_dirs[0]).vocab_mapping
    if os.path.isdir(vocab):
        return vocab
    raise UserError(f"no vocab_mapping folder near {data_dirs[0]}; pass --vocab-mapping-dir or run 02_build_vocab_mapping.py")
