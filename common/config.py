"""Settings as typed, frozen dataclasses: each field holds its flag's default, help and check (run_clm's
dataclass arguments), the scripts' flags are made from the fields, and library code takes a config or the
fields it needs, never the argparse Namespace."""
import argparse
from dataclasses import MISSING, dataclass, field, fields

from common.errors import UserError


def number(kind=float, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False):
    """A check of a number's range, used as the flag's argparse type (so YAML values meet it too) and by the
    config's __post_init__; NaN is outside every range."""
    if high is None:
        rule = "a positive number" if low == 0 and low_open else f"at least {low}"
    else:
        rule = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(text):
        value = kind(text)  # a ValueError here is argparse's "invalid int value: '2.5'"
        below = low is not None and not (value > low if low_open else value >= low)
        above = high is not None and not (value < high if high_open else value <= high)
        if below or above or value != value:
            raise argparse.ArgumentTypeError(f"{value}: must be {rule}")
        return value
    check.__name__ = kind.__name__  # argparse names the type in its other messages
    check.rule = rule  # --help shows it
    return check


def device(text: str) -> str:
    """A check of a device name: cpu, cuda, cuda:N or auto."""
    if text not in ("auto", "cpu", "cuda") and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise argparse.ArgumentTypeError(f"{text}: use cuda, cuda:N, cpu or auto")
    return text


def option(default=None, help: str = "", *, check=None, choices=None, names: tuple = (), nargs=None):
    """A config field that is also a flag (--the-field-name, or `names`): True/False defaults make switches
    (a True default gets a --no- form)."""
    meta = {"help": help, "check": check, "choices": choices, "names": names, "nargs": nargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_options(parser, cls, only: tuple = ()) -> None:
    """The flags of a config class's fields (those in `only`, if given), onto a parser or an argument group."""
    for f in fields(cls):
        if "help" not in f.metadata or (only and f.name not in only):
            continue
        m = f.metadata
        default = f.default_factory() if f.default is MISSING else f.default
        kwargs = {"dest": f.name, "default": default, "help": m["help"]}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs.update({k: m[k] for k in ("choices", "nargs") if m[k] is not None})
            if m["check"] is not None:
                kwargs["type"] = m["check"]
        parser.add_argument(*(m["names"] or (flag_name(f.name),)), **kwargs)


def from_args(cls, args: argparse.Namespace, **resolved):
    """The config of the parsed flags, with the values resolved after parsing (the dtype, the vocab folder) given."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **resolved})


def resolved(args: argparse.Namespace, **values) -> argparse.Namespace:
    """A copy of the parsed flags with the values a stage resolves after parsing (the device, the dtype, whether the
    verifier's own code runs): one visible step, and the manifest records what ran."""
    return argparse.Namespace(**{**vars(args), **values})


def check_options(config) -> None:
    """Each field's own check, for a config built in code rather than from flags; one line naming the flag."""
    for f in fields(config):
        value, check = getattr(config, f.name), f.metadata.get("check")
        choices = f.metadata.get("choices")
        for v in (value if isinstance(value, list) else [value]):
            if v is None:
                continue
            if choices is not None and v not in choices:
                raise UserError(f"{flag_name(f.name)} {v}: choose from {', '.join(map(str, choices))}")
            if check is not None:
                try:
                    check(v)
                except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                    raise UserError(f"{flag_name(f.name)} {e}")


# ---------------------------------------------------------------- stage 04

@dataclass(frozen=True)
class TrainConfig:
    """Stage 04's settings. The defaults are the recipe docs/quality.md measured best; a config file sets only
    what depends on the data's size and the hardware."""
    data_dir: list = option(["data"], "extracted hidden states: one or more rows_A-B folders, hidden_states/ folders "
                                      "or data roots", nargs="+")
    vocab_mapping_dir: str | None = option(None, "output of stage 02 (default: the vocab_mapping folder beside the data)")
    output_dir: str = option("out", "checkpoints, metrics.jsonl, plots and the log go here")
    epochs: int = option(3, "passes over the training rows", check=number(int, 1))
    max_steps: int | None = option(None, "stop after this many optimizer steps (overrides --epochs)", check=number(int, 1))
    lr: float = option(1e-3, "peak learning rate (of both optimizer groups under muon, unless --muon-lr)",
                       check=number(float, 0, low_open=True))
    optimizer: str = option("muon", "muon: Muon on fc and the decoder layer's matrices, AdamW on the norms "
                                    "(speculators' default)", choices=["adamw", "muon"])
    muon_lr: float | None = option(None, "peak lr of the Muon group (default --lr; its update is scaled to AdamW's RMS)",
                                   check=number(float, 0, low_open=True))
    norm_before_fc: bool = option(True, "Eagle-3.1: an RMSNorm over the concatenated aux states before fc "
                                        "(speculators' eagle3 default)")
    norm_output: bool = option(True, "Eagle-3.1: feed the normed draft output back across TTT steps "
                                     "(speculators' eagle3 default)")
    min_lr_ratio: float = option(0.0, "final learning rate as a share of --lr", check=number(float, 0, 1))
    scheduler: str = option("cosine", "decay after warmup", choices=["cosine", "linear", "none"])
    warmup_steps: int | None = option(None, "warmup steps (default: --warmup-ratio of all steps)", check=number(int, 0))
    warmup_ratio: float = option(0.02, "warmup as a share of all steps", check=number(float, 0, 1))
    weight_decay: float = option(0.01, "AdamW weight decay", check=number(float, 0))
    grad_clip: float = option(1.0, "gradient norm clip", check=number(float, 0, low_open=True))
    grad_accum: int = option(1, "packed sequences per optimizer step (per GPU)", check=number(int, 1))
    pack_tokens: int = option(
        2048, "tokens per packed training sequence: several rows per step (the batch token budget per GPU); a pack "
              "that runs out of memory is trained in parts cut at conversation boundaries, and the log says so. "
              "--max-seq-len is its old name, still accepted (also as a train: key); the top-level max_seq_len of "
              "a config is 01's row length and does not set it",
        check=number(int, 2), names=("--pack-tokens", "--max-seq-len"))
    draft_layers: int = option(1, "decoder layers in the draft (the first reads the token embedding and fc output, "
                                  "as vLLM's eagle3 drafts do; more layers cost proportionally more per drafted "
                                  "token at serving)", check=number(int, 1))
    draft_intermediate_size: int | None = option(
        None, "width of the draft layers' MLP (default: the verifier's); the draft's hidden size is the verifier's, "
              "so this is where it can grow (vLLM serves any width)", check=number(int, 1))
    ttt_steps: int = option(3, "test-time-training unroll: draft positions trained", check=number(int, 1))
    ttt_loss_decay: float = option(1.0, "loss weight multiplier per TTT step", check=number(float, 0, low_open=True))
    noise_std: float = option(0.05, "Gaussian noise on input hidden states (train only)", check=number(float, 0))
    noise_scale: str = option("absolute", "how --noise-std reads: absolute (the noise's std, one for every aux layer) "
                                          "or rms (a share of each aux layer's RMS in the batch, as the layers' states "
                                          "differ in scale)", choices=["absolute", "rms"])
    loss: str = option("kl_div", "speculators loss name (kl_div, ce, ...) or a JSON dict of weights")
    loss_implementation: str = option("eager", "on a GPU: fused (Triton) or eager; the CPU always uses eager",
                                      choices=["eager", "fused"])
    attn_impl: str = option(
        "auto", "draft attention. auto: sdpa (a dense TTT mask; faster at short packs) up to 16K-token packs, from "
                "16K with --compile on a GPU flex attention (a block mask: faster and smaller at long packs, "
                "docs/benchmarks.md); flex attention without --compile is slow",
        choices=["auto", "sdpa", "eager", "simple_flex_attention"])
    dtype: str | None = option(None, "compute dtype of the draft's forward (bf16 autocast over float32 weights) and "
                                     "of the states it reads (default: compute_dtype's rule, common/verifier.py)",
                               choices=["bfloat16", "float32"])
    compile: bool = option(False, "torch.compile the draft forward, on a thread beside the first (eager) steps; the "
                                  "loop switches to it when it is built, and logs how long that took (its speed: "
                                  "docs/benchmarks.md)")
    compile_wait: bool = option(False, "with --compile: compile before the first step, so every step runs compiled "
                                       "(reproducible step for step, and faster over a long run, since eager steps "
                                       "beside a compile run slowly; always so with several GPUs)")
    val_ratio: float = option(0.05, "share of rows held out for validation", check=number(float, 0, 1, high_open=True))
    val_every: int = option(0, "also validate every N steps (0: once per epoch)", check=number(int, 0))
    best_by: str = option("accept", "which validated checkpoint `best` points at: the highest estimated acceptance "
                                    "length (1 + the summed all-correct rates per draft position), or the lowest loss",
                          choices=["accept", "loss"])
    save_every: int = option(0, "also checkpoint every N steps (0: once per epoch)", check=number(int, 0))
    log_every: int = option(10, "log a line every N steps", check=number(int, 1))
    num_workers: int = option(4, "threads reading rows into pinned buffers ahead of the step (0 counts as 1)",
                              check=number(int, 0))
    seed: int = option(0, "seed of the split, the data order and the noise", check=int)
    states_from: str = option("disk", "where the hidden states come from: disk (03's files under --data-dir); "
                                      "colocated (the verifier in this process computes each pack's states from 01's "
                                      "rows under --data-dir as it trains); server (a vLLM server started by "
                                      "serve_states.py computes them, --states-url)",
                              choices=["disk", "colocated", "server"])
    states_url: str | None = option(None, "with --states-from server: the server's URL, as serve_states.py prints it "
                                          "(--num-workers requests are kept in flight)")
    on_policy: bool = option(False, "with --states-from server: the server writes every assistant reply anew (greedy, "
                                    "each at most as long as the row's own) and the draft trains on the states of the "
                                    "conversation with those replies, the loss on the generated tokens only")
    layers: list | None = option(None, "with --states-from colocated or server: aux layer ids (default: 03's, "
                                       "2 N/2 N-3)", check=number(int, 0), nargs="+")
    resume: bool = option(False, "continue from the newest checkpoint in <output-dir>/checkpoints that loads "
                                 "(`latest`, or with a warning the one before); settings that change the run must match")
    plot: bool = option(False, "only redraw <output-dir>/training.png from metrics.jsonl")
    # resolved after parsing (04's run): the verifier and whether its own code runs
    verifier_path: str = "default"
    trust_remote_code: bool = False

    def __post_init__(self):
        check_options(self)
        if self.muon_lr is not None and self.optimizer != "muon":
            raise UserError("--muon-lr sets the Muon group's lr: add --optimizer muon")
        if self.compile_wait and not self.compile:
            raise UserError("--compile-wait changes how --compile compiles: add --compile")
        if (self.states_from == "server") != (self.states_url is not None):
            raise UserError("--states-from server needs --states-url, and --states-url needs --states-from server")
        if self.on_policy and self.states_from != "server":
            raise UserError("--on-policy has the server write the replies: add --states-from server and --states-url")
        if self.layers and self.states_from == "disk":
            raise UserError("--layers chooses the layers colocated and server sources compute; from disk they are "
                            "03's (rerun 03 with --layers)")


# ---------------------------------------------------------------- stage 01's regeneration

@dataclass(frozen=True)
class RegenConfig:
    """How 01 has the verifier rewrite every assistant reply."""
    regenerate: str = option("none", "backend that regenerates the replies (vllm: what you serve with; transformers: "
                                     "batched generate on a GPU without vLLM); kept under "
                                     "<data-dir>/regenerated/rows_A-B, resumable",
                             choices=["none", "vllm", "transformers"])
    temperature: float = option(0.0, "0 = greedy replies; above 0 samples them", check=number(float, 0))
    top_p: float = option(1.0, "nucleus sampling share, with --temperature > 0", check=number(float, 0, 1, low_open=True))
    max_new_tokens: int = option(512, "longest reply; a reply cut here is trained without the end-of-turn token after "
                                      "it (the conversation goes on), a greedy loop in it cut after two periods",
                                 check=number(int, 1))
    regen_chunk: int = option(1024, "conversations per resumable part (one file each, written when the part is done)",
                              check=number(int, 1))
    regen_batch_tokens: int = option(1 << 20, "transformers: prompt+reply tokens per padded batch, or of the KV cache "
                                              "of the slots or the continuous batching (GPU memory; slots: this many "
                                              "tokens / --max-seq-len rows)", check=number(int, 1))
    regen_batching: str = option(
        "auto", "transformers: padded generate() batches; continuous batching (generate_batch: paged KV cache; its "
                "scheduler is slow); or slots (a fixed KV cache of rows refilled as replies end, Llama-style "
                "verifiers, the fast one on a GPU); auto: slots on CUDA for the verifiers it supports, else padded",
        choices=["auto", "padded", "continuous", "slots"])
    tensor_parallel_size: int = option(1, "vllm: GPUs the verifier is split over", check=number(int, 1))
    device: str = option("auto", "transformers: device of the verifier (auto: cuda if there is one)", check=device)
    # shared with the rest of 01 (declared there): a prompt and its reply fit in max_seq_len tokens
    max_seq_len: int = 2048
    seed: int = 0
    trust_remote_code: bool = False

    def __post_init__(self):
        check_options(self)


# ---------------------------------------------------------------- stage 05

@dataclass(frozen=True)
class EvalConfig:
    """How 05 answers the held-out prompts: decoding and the vLLM engine."""
    num_speculative_tokens: int = option(3, "draft tokens proposed per verify step", check=number(int, 1))
    max_new_tokens: int = option(128, "tokens generated per answer", check=number(int, 1))
    max_prompt_len: int = option(1024, "keep at most the last N prompt tokens", check=number(int, 1))
    temperature: float = option(0.0, "0 = greedy (and the lossless check)", check=number(float, 0))
    tensor_parallel_size: int = option(1, "vllm backend: GPUs the verifier (and its draft) are split over, as you "
                                          "serve it", check=number(int, 1))
    gpu_memory_utilization: float = option(0.9, "vllm backend: share of each GPU's memory the engine may take "
                                                "(weights + KV cache)", check=number(float, 0, 1, low_open=True))
    seed: int = option(0, "seed of the prompt choice and of sampling", check=int)
    # resolved after parsing (05's run)
    dtype: str = "float32"
    trust_remote_code: bool = False

    def __post_init__(self):
        check_options(self)

    @property
    def max_model_len(self) -> int:
        """Room for the longest prompt, its answer and the draft tokens past it."""
        return self.max_prompt_len + self.max_new_tokens + self.num_speculative_tokens + 16
