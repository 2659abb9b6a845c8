"""Building the EAGLE-3 draft (speculators' Eagle3DraftModel) and writing vLLM-servable checkpoints."""
import os

import numpy as np
import torch

from common.errors import UserError


def accuracy_counts(pred_ids, target_ids, loss_mask, prev_correct):
    """speculators' compute_accuracy_single_step, same counts, without its masked_select: an output
    whose size depends on the data makes the host wait for the GPU (and breaks the compiled graph)
    at every TTT step."""
    correct = pred_ids == target_ids
    # torch.full, not torch.tensor(..., device=): a copy from host memory waits for the GPU too
    cond_total = torch.full((), correct.numel(), dtype=torch.float, device=correct.device)
    if prev_correct is not None:
        cond_total = prev_correct.sum().float()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)
    if loss_mask is None:
        full_total = torch.full((), correct.numel(), dtype=torch.float, device=correct.device)
    else:
        mask = loss_mask.to(torch.bool)
        correct, full_total = correct & mask, mask.sum().float()
    correct_sum = correct.float().sum()
    return correct_sum, full_total, correct_sum.clone(), cond_total


def eagle3_class():
    """Eagle3DraftModel, with its forward left uncompiled: speculators compiles it whenever CUDA is
    present, silently, for minutes; we compile only on --compile, and say so in the log. Its
    accuracy counts are computed without a host sync (accuracy_counts)."""
    from speculators.models.eagle3 import Eagle3DraftModel, metrics, model_definitions
    forward = Eagle3DraftModel.forward
    Eagle3DraftModel.forward = getattr(forward, "_torchdynamo_orig_callable", forward)
    metrics.compute_accuracy_single_step = accuracy_counts
    model_definitions.torch = torch_without_graph_break()
    return Eagle3DraftModel


def torch_without_graph_break():
    """`torch` as speculators' decoder layer sees it, minus the torch._dynamo.graph_break() it calls
    on torch >= 2.10 (against pytorch#175250, a fused kernel too big for shared memory, seen with flex
    attention): inside the TTT loop dynamo cannot resume after a break, so it ran the whole forward
    eagerly and compiled only its pieces, again at each TTT step."""
    import types
    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim._dynamo = types.SimpleNamespace(graph_break=lambda: None)  # noqa: SLF001
    return shim


def build_draft(verifier: str, aux_layers: list[int], vocab_dir: str, ttt_steps: int, attn_impl: str,
                trust_remote_code: bool = False, num_layers: int = 1, device="cpu", norm_before_fc: bool = False,
                norm_output: bool = False, intermediate_size: int | None = None):
    """A fresh draft whose frozen embedding, final norm and lm_head come from the verifier's shards.

    Built on `device` directly: initialising an 8B verifier's embedding and heads on the host
    (thrown away when the verifier's weights load) took 12 s on 2 CPU cores.

    speculators' own `from_training_args` reads the verifier config without trust_remote_code; this
    builds the same config through the pieces that take it, so Kimi-style verifiers work too.
    `norm_before_fc` and `norm_output` are speculators' Eagle-3.1 options (an RMSNorm over the
    concatenated aux states before fc; the normed output fed back across TTT steps); vLLM serves both.
    `intermediate_size` widens the layers' MLP beyond the verifier's (None: the verifier's).
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.model import DraftVocabMixin
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier, num_layers=num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=0, full_attention_indices=list(range(num_layers)), trust_remote_code=trust_remote_code)
    layer_config._attn_implementation = attn_impl  # noqa: SLF001 - how speculators selects it
    if intermediate_size is not None:
        layer_config.intermediate_size = intermediate_size
    t2d = torch.from_numpy(np.load(os.path.join(vocab_dir, "t2d.npy")))
    d2t = torch.from_numpy(np.load(os.path.join(vocab_dir, "d2t.npy")))
    if t2d.numel() != layer_config.vocab_size:
        raise UserError(f"{vocab_dir}: t2d covers {t2d.numel()} tokens but the verifier has {layer_config.vocab_size}; "
                        "rebuild it with 02_build_vocab_mapping.py for this verifier")
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=int(d2t.numel()), norm_before_residual=True,
        norm_before_fc=norm_before_fc, norm_output=norm_output,
        eagle_aux_hidden_state_layer_ids=list(aux_layers),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(verifier)))
    with torch.device(device):
        model = eagle3_class()(config)
    model.load_vocab_mappings(t2d, d2t)
    DraftVocabMixin._load_verifier_weights(model)  # noqa: SLF001 - skips Eagle3's config re-read
    model.embed_tokens.weight.requires_grad_(False)
    return model


def trainable_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_servable(model, folder: str) -> None:
    """speculators Eagle-3 format (config.json + model.safetensors with d2t/t2d), bf16, as vLLM loads it.
    The config lists only the aux layer ids, never the appended final layer."""
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in model.state_dict().items()
             if k not in model._keys_to_ignore_on_save}  # noqa: SLF001
    model.save_pretrained(folder, state_dict=state)


def load_draft(path: str, trust_remote_code: bool = False):
    """A saved checkpoint, for evaluation. Eagle3DraftModel's own from_pretrained and load_verifier_weights read
    the verifier's config without trust_remote_code (a verifier with remote-only code fails there); this loads
    the weights through the base class and checks the verifier's sizes with trust passed on."""
    from speculators.model import DraftVocabMixin
    from transformers import PreTrainedModel

    from common.verifier import load_text_config
    cls = eagle3_class()
    model = PreTrainedModel.from_pretrained.__func__(cls, path, config=cls.config_class.from_pretrained(path))
    DraftVocabMixin._load_verifier_weights(model)  # noqa: SLF001 - skips Eagle3's config re-read
    verifier = model.config.speculators_config.verifier.name_or_path
    hidden = load_text_config(verifier, trust_remote_code).hidden_size
    if hidden != model.hidden_size:
        raise UserError(f"{path}: a draft of hidden size {model.hidden_size} for a verifier of {hidden}")
    return model
