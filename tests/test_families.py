"""Every stage (01-05, transformers backends) on tiny random models of the big families, built here from
configs with transformers' native classes and saved with the SmolLM2 tokenizer: Llama, Qwen3 dense with
an embedding larger than its tokenizer, Qwen3-MoE, DeepSeek-V3 (MLA + MoE) and a Kimi-K2.5-shaped wrapper
(Kimi_K25ForConditionalGeneration: `text_config` nested, weights saved as `language_model.*` beside a
vision tower). vLLM's 05 runs the Llama family with tensor parallel 2 in test_evaluate.py; the others are
left to the transformers backend here (MLA verifiers with an EAGLE-3 draft do not run on vLLM's CPU build,
and every extra engine costs CI minutes)."""
import json
import shutil

import pytest
import torch

from conftest import read_json, stage

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, eos_token_id=2, pad_token_id=2, bos_token_id=1, max_position_embeddings=4096)
MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, eos_token_id=2, pad_token_id=2,
           bos_token_id=1, max_position_embeddings=4096, tie_word_embeddings=False)
FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25"]
KIMI_K25_AUTO_MAP = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",  # as the hub's config.json has it
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}


def build(name: str, vocab: int):
    import transformers as t
    torch.manual_seed(0)
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=vocab, **TINY))
    if name == "qwen3":  # an embedding 128 rows larger than the tokenizer, untied head
        return t.Qwen3ForCausalLM(t.Qwen3Config(vocab_size=vocab + 128, head_dim=16, tie_word_embeddings=False, **TINY))
    if name == "qwen3_moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(vocab_size=vocab, head_dim=16, num_experts=4,
                                                      num_experts_per_tok=2, moe_intermediate_size=32, **TINY))
    if name == "deepseek_v3":
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(vocab_size=vocab + 128, **MLA))
    return t.Kimi_K25ForConditionalGeneration(t.Kimi_K25Config(
        text_config=dict(model_type="deepseek_v3", vocab_size=vocab + 128, **MLA),
        vision_config=dict(num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                           pos_emb_height=8, pos_emb_width=8),
        projection_hidden_size=32, tie_word_embeddings=False))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_runs_on_the_family(tmp_path, tokenizer, family):
    verifier, data, out = tmp_path / family, tmp_path / "data", tmp_path / "out"
    build(family, len(tokenizer)).save_pretrained(verifier)
    tokenizer.save_pretrained(verifier)
    if family == "kimi_k25":  # the hub's config names its remote code; transformers' native classes serve it
        config = json.loads((verifier / "config.json").read_text())
        config["auto_map"] = KIMI_K25_AUTO_MAP
        (verifier / "config.json").write_text(json.dumps(config))
    if family == "kimi_k25":  # the hub's layout: the language model under language_model.*, a vision tower beside
        from safetensors import safe_open
        with safe_open(str(verifier / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        assert any(n.startswith("language_model.") for n in names) and any("vision_tower." in n for n in names)
    v = ["--verifier-path", verifier]
    stage("01_prepare_dataset.py", *v, "--data-dir", data, "--num-samples", 24, "--max-seq-len", 256)
    stage("02_build_vocab_mapping.py", *v, "--data-dir", data, "--draft-vocab-size", 1024)
    stage("03_extract_hidden_states.py", *v, "--data-dir", data, "--max-tokens-per-batch", 2048)
    stage("04_train.py", *v, "--data-dir", data, "--output-dir", out, "--max-steps", 4, "--max-seq-len", 512,
          "--num-workers", 1, "--val-ratio", 0.2)
    best = out / "checkpoints" / "best"
    stage("05_evaluate.py", *v, "--data-dir", data, "--output-dir", out, "--draft-path", best, "--backend",
          "transformers", "--num-prompts", 2, "--max-new-tokens", 16, "--max-turns", 1, "--max-prompt-len", 128,
          *(["--device", "auto"] if family == "kimi_k25" else []))  # device_map: the big verifier's way
    report = read_json(out / "eval" / "eval.json")["drafts"]
    assert len(report) == 1 and all(r["lossless"] is True and r["mean_acceptance_length"] >= 1 for r in report.values())
    # the language model's sizes (text_config for the wrapper) reach the draft; aux ids match the extraction
    with open(best / "config.json") as f:
        draft = json.load(f)
    config = json.loads((verifier / "config.json").read_text())
    text = config.get("text_config", config)
    assert draft["transformer_layer_config"]["hidden_size"] == text["hidden_size"] == 64
    assert draft["transformer_layer_config"]["vocab_size"] == text["vocab_size"]
    extracted = read_json(data / "hidden_states" / "rows_0-24" / "extract_config.json")
    assert draft["eagle_aux_hidden_state_layer_ids"] == extracted["aux_layers"]


def test_remote_code_is_not_used_where_transformers_has_native_classes(tmp_path, tokenizer):
    """--trust-remote-code on a verifier whose hub code is broken (as Kimi-K2.5's tokenizer code is for
    transformers 5): native classes are used, so every stage runs; the log says so."""
    verifier, data = tmp_path / "llama", tmp_path / "data"
    build("llama", len(tokenizer)).save_pretrained(verifier)
    tokenizer.save_pretrained(verifier)
    config = json.loads((verifier / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_hub.HubConfig", "AutoModel": "modeling_hub.HubModel",
                          "AutoModelForCausalLM": "modeling_hub.HubForCausalLM"}
    (verifier / "config.json").write_text(json.dumps(config))
    for name in ("configuration_hub.py", "modeling_hub.py"):
        (verifier / name).write_text("raise ImportError('the hub code was imported')\n")
    v = ["--verifier-path", verifier, "--trust-remote-code"]
    log = stage("01_prepare_dataset.py", *v, "--data-dir", data, "--num-samples", 8, "--max-seq-len", 128).stdout
    assert "native classes for 'llama'" in log
    stage("02_build_vocab_mapping.py", *v, "--data-dir", data, "--draft-vocab-size", 256)
    stage("03_extract_hidden_states.py", *v, "--data-dir", data, "--max-tokens-per-batch", 1024)


REMOTE_CONFIG = """from transformers import LlamaConfig


class HubConfig(LlamaConfig):
    model_type = "hub_llama"
"""
REMOTE_MODEL = """from transformers import LlamaForCausalLM, LlamaModel

from .configuration_hub import HubConfig


class HubModel(LlamaModel):
    config_class = HubConfig


class HubForCausalLM(LlamaForCausalLM):
    config_class = HubConfig
"""


@pytest.mark.slow
def test_a_verifier_with_remote_code_only_runs_every_stage_with_the_trust_flag(tmp_path, tokenizer):
    """A model type transformers does not know, its code beside its weights: --trust-remote-code carries it
    through every stage, the draft loading of 05 included (speculators reads the verifier's config without it)."""
    verifier, data, out = tmp_path / "hub", tmp_path / "data", tmp_path / "out"
    build("llama", len(tokenizer)).save_pretrained(verifier)
    tokenizer.save_pretrained(verifier)
    config = json.loads((verifier / "config.json").read_text())
    config.update(model_type="hub_llama", architectures=["HubForCausalLM"],
                  auto_map={"AutoConfig": "configuration_hub.HubConfig", "AutoModel": "modeling_hub.HubModel",
                            "AutoModelForCausalLM": "modeling_hub.HubForCausalLM"})
    (verifier / "config.json").write_text(json.dumps(config))
    (verifier / "configuration_hub.py").write_text(REMOTE_CONFIG)
    (verifier / "modeling_hub.py").write_text(REMOTE_MODEL)
    v = ["--verifier-path", verifier, "--trust-remote-code"]
    stage("01_prepare_dataset.py", *v, "--data-dir", data, "--num-samples", 8, "--max-seq-len", 128)
    stage("02_build_vocab_mapping.py", *v, "--data-dir", data, "--draft-vocab-size", 256)
    stage("03_extract_hidden_states.py", *v, "--data-dir", data, "--max-tokens-per-batch", 1024)
    stage("04_train.py", *v, "--data-dir", data, "--output-dir", out, "--max-steps", 2, "--max-seq-len", 256,
          "--num-workers", 1, "--val-ratio", 0.25)
    stage("05_evaluate.py", *v, "--data-dir", data, "--output-dir", out, "--draft-path", out / "checkpoints" / "best",
          "--backend", "transformers", "--num-prompts", 2, "--max-new-tokens", 8, "--max-turns", 1,
          "--max-prompt-len", 64)
    report = read_json(out / "eval" / "eval.json")["drafts"]
    assert len(report) == 1 and all(r["lossless"] is True for r in report.values())


def test_slot_decoding_is_offered_to_the_families_it_can_step(tokenizer):
    """01's --regen-batching auto takes slots on a GPU only for attention it steps (not MLA)."""
    from common.slot_decode import supported
    assert {f: supported(build(f, len(tokenizer))) for f in FAMILIES} == {
        "llama": True, "qwen3": True, "qwen3_moe": True, "deepseek_v3": False, "kimi_k25": False}


def damage(folder, drop: str | None = None, reshape: str | None = None) -> None:
    """Rewrite the checkpoint's one shard without the first tensor whose name holds `drop`, or with the first
    holding `reshape` cut by one row: what a bad copy or a mixed checkpoint leaves."""
    from safetensors.torch import load_file, save_file
    path = folder / "model.safetensors"
    tensors = load_file(path)
    if drop:
        del tensors[next(n for n in tensors if drop in n)]
    if reshape:
        name = next(n for n in tensors if reshape in n)
        tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("family,drop,reshape,words", [
    ("llama", "layers.3.self_attn.k_proj", None, "decoder layer 3 lacks self_attn.k_proj.weight"),
    ("llama", None, "layers.4.mlp.up_proj", "decoder layer 4 has mlp.up_proj.weight of shape [127, 64]"),
    ("kimi_k25", "blocks.2.mlp.experts.3.up_proj", None, "decoder layer 2 lacks mlp.experts.3.up_proj.weight"),
])
def test_missing_or_mismatched_verifier_weights_are_one_line_in_every_backend(tmp_path, tokenizer, data_dir, family,
                                                                            drop, reshape, words):
    """03 and 05 on both backends check the checkpoint's tensors before loading it (vLLM would run a lost expert on
    whatever its memory held, and 05 still report lossless): one line naming the layer, exit 2, no engine started."""
    from conftest import assert_user_error
    verifier = tmp_path / family
    build(family, len(tokenizer)).save_pretrained(verifier)
    tokenizer.save_pretrained(verifier)
    damage(verifier, drop, reshape)
    shutil.copytree(data_dir / "prepared", tmp_path / "data" / "prepared")  # 03 must write nowhere shared
    v = ["--verifier-path", verifier]
    for backend in ("transformers", "vllm") if family == "kimi_k25" else ("transformers",):  # the check precedes both
        assert_user_error(stage("03_extract_hidden_states.py", *v, "--data-dir", tmp_path / "data", "--backend",
                                backend, check=False), words)
        assert_user_error(stage("05_evaluate.py", *v, "--backend", backend, "--draft-path", tmp_path / "none",
                                "--output-dir", tmp_path / "out", check=False), words)
