"""c, the weights a drafted token reads against the verifier's per token, counted by hand on tiny models:
drafts of one layer, two layers and a wider MLP, a tied dense verifier, a MoE verifier (its active experts
only) and a Kimi-K2.5-shaped wrapper (no vision tower, no multi-token-prediction layer)."""
import numpy as np
import pytest
import torch

from common.cost import draft_read, estimated_speedup, verifier_read

H, I, HEADS, KV, VOCAB, DRAFT_VOCAB = 64, 128, 4, 2, 512, 100
KV_WIDTH = KV * H // HEADS


@pytest.fixture(scope="module")
def tiny_verifier(tmp_path_factory):
    import transformers as t
    folder = tmp_path_factory.mktemp("cost") / "llama"
    torch.manual_seed(0)
    t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=4,
                                     num_attention_heads=HEADS, num_key_value_heads=KV,
                                     tie_word_embeddings=True)).save_pretrained(folder)
    vocab = folder.parent / "vocab"
    vocab.mkdir()
    t2d = np.zeros(VOCAB, bool)
    t2d[:DRAFT_VOCAB] = True
    np.save(vocab / "t2d.npy", t2d)
    np.save(vocab / "d2t.npy", np.zeros(DRAFT_VOCAB, np.int64))
    return folder, vocab


def attention(width_in: int) -> int:  # q, k, v from width_in, o back to H
    return width_in * H + 2 * width_in * KV_WIDTH + H * H


@pytest.mark.parametrize("layers,mlp", [(1, I), (2, I), (1, 4 * I)])
def test_draft_weights_by_hand(tmp_path, tiny_verifier, layers, mlp):
    from common.draft import build_draft, save_servable
    verifier, vocab = tiny_verifier
    save_servable(build_draft(str(verifier), [1, 2, 3], str(vocab), 3, "sdpa", num_layers=layers, norm_before_fc=True,
                              norm_output=True, intermediate_size=None if mlp == I else mlp), str(tmp_path / "d"))
    first = attention(2 * H) + 3 * H * mlp + 3 * H  # its q, k, v read [embedding, state]; three norms
    later = attention(H) + 3 * H * mlp + 2 * H
    by_hand = 3 * H * H + 3 * H + first + (layers - 1) * later + H + DRAFT_VOCAB * H  # fc, its norm, ..., norm, head
    assert draft_read(str(tmp_path / "d")) == {"weights": by_hand, "bytes": 2 * by_hand}


def test_dense_verifier_by_hand(tiny_verifier):
    from transformers import AutoConfig
    verifier, _ = tiny_verifier
    by_hand = 4 * (attention(H) + 3 * H * I + 2 * H) + H + VOCAB * H  # the tied embedding is the head
    # saved in float32, counted as served (bf16): 2 bytes a weight
    assert verifier_read(str(verifier), AutoConfig.from_pretrained(verifier)) == {"weights": by_hand, "bytes": 2 * by_hand}


def test_moe_verifier_counts_active_experts(tmp_path):
    import transformers as t
    config = t.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=3,
                              num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=H // HEADS, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)
    t.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    per_layer = attention(H) + 2 * (H // HEADS) + 2 * H + 8 * H + 2 * 3 * H * 32  # q/k norms, norms, router, 2 of 8
    by_hand = 3 * per_layer + H + VOCAB * H
    assert verifier_read(str(tmp_path), config)["weights"] == by_hand


def test_kimi_wrapper_counts_the_language_model_only(tmp_path):
    from test_families import build
    model = build("kimi_k25", VOCAB)
    model.save_pretrained(tmp_path)
    text = model.config.text_config
    lm = {n: p.numel() for n, p in model.state_dict().items() if "language_model" in n or "lm_head" in n}
    routed = sum(v for n, v in lm.items() if ".experts." in n)
    embedding = sum(v for n, v in lm.items() if n.endswith("embed_tokens.weight"))
    by_hand = sum(lm.values()) - embedding - routed + routed * text.num_experts_per_tok / text.n_routed_experts
    assert verifier_read(str(tmp_path), text)["weights"] == round(by_hand)


def test_estimated_speedup():
    # the figures: a one-layer draft reading 18% of the verifier's weights, tau 2.284, k 3
    assert estimated_speedup(2.284, 24.0 / 134.5, 3) == pytest.approx(1.49, abs=0.005)
    assert estimated_speedup(1.0, 0.0, 3) == 1.0
