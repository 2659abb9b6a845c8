"""What a drafted token costs: the weights a draft reads per token against the verifier's, c, and the speedup
of memory-bound decoding that follows, tau / (1 + k c), an estimate that bench/bench_draft_cost.py checks.

Decoding a large verifier is memory-bound: a step costs about the bytes of weights it reads. Counted from the
checkpoints' safetensors headers (nothing is loaded): floating weights at 2 bytes (bf16, as both are served),
quantized ones (packed integers, fp8) at their stored size. Per token the draft reads fc, its layers, its norms
and its lm head (one embedding row is nothing); the verifier reads its decoder layers, its final norm and its lm
head (the embedding, if tied), of a MoE only the routed experts a token goes to (top-k of n), and neither a
vision tower nor the multi-token-prediction layers past num_hidden_layers.
"""
import math
import re

from common.verifier import NOT_THE_LANGUAGE_MODEL, weight_headers

ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                 "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT16_OR_WIDER = {"F64", "F32", "F16", "BF16"}  # served as bf16: 2 bytes a weight
LAYER = re.compile(r"\blayers\.(\d+)\.")


def tensors(folder: str) -> dict[str, tuple[str, int]]:
    """name -> (dtype, elements) of every tensor in the folder's safetensors files."""
    return {name: (dtype, math.prod(shape)) for name, (dtype, shape) in weight_headers(folder).items()}


def served_bytes(dtype: str, elements: int) -> int:
    return elements * (2 if dtype in FLOAT16_OR_WIDER else ELEMENT_BYTES.get(dtype, 2))


def draft_read(draft_path: str) -> dict:
    """Weights (count and bytes) the draft reads per drafted token: every floating tensor but the embedding."""
    weights = {n: t for n, t in tensors(draft_path).items()
               if t[0] in FLOAT16_OR_WIDER and not n.endswith("embed_tokens.weight") and not n.startswith("verifier_")}
    return {"weights": sum(e for _, e in weights.values()), "bytes": sum(served_bytes(*t) for t in weights.values())}


def verifier_read(verifier_path: str, text_config) -> dict:
    """Weights (count and bytes) the verifier reads per token; a MoE's routed experts count top_k / n of theirs."""
    n_experts = getattr(text_config, "n_routed_experts", None) or getattr(text_config, "num_experts", None)
    share = (text_config.num_experts_per_tok / n_experts) if n_experts else 1.0
    layers = text_config.num_hidden_layers
    weights, nbytes, embedding, head = 0.0, 0.0, None, False
    for name, (dtype, elements) in tensors(verifier_path).items():
        if NOT_THE_LANGUAGE_MODEL.search(name):
            continue
        if (m := LAYER.search(name)) and int(m.group(1)) >= layers:
            continue  # multi-token-prediction layers: not run when decoding
        if name.endswith("embed_tokens.weight") or name.endswith("wte.weight"):
            embedding = (dtype, elements)  # one row per token, unless it is the head too
            continue
        head = head or name.endswith("lm_head.weight")
        scale = share if ".experts." in name else 1.0
        weights += elements * scale
        nbytes += served_bytes(dtype, elements) * scale
    if not head and embedding is not None:  # tied: the embedding is the head, read whole for the logits
        weights += embedding[1]
        nbytes += served_bytes(*embedding)
    return {"weights": round(weights), "bytes": round(nbytes)}


def estimated_speedup(acceptance_length: float, c: float, k: int) -> float:
    """tau / (1 + k c): tokens per verify step over the cost of one verify step and k draft steps, in verify steps."""
    return acceptance_length / (1 + k * c)
