"""Stage 02: the draft vocabulary from assistant-token frequencies."""
import numpy as np
import torch

from conftest import DRAFT_VOCAB, assert_user_error, read_json, stage


def load_mapping(folder):
    return np.load(folder / "d2t.npy"), np.load(folder / "t2d.npy"), torch.load(folder / "token_freq.pt")


def test_d2t_and_t2d_agree(data_dir):
    d2t, t2d, freq = load_mapping(data_dir / "vocab_mapping")
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    assert t2d.shape == (49152,) and t2d.sum() == DRAFT_VOCAB == len(d2t)
    targets = np.arange(len(d2t)) + d2t
    assert t2d[targets].all() and (np.diff(targets) > 0).all()
    # the most frequent assistant tokens are in the draft vocabulary
    top = torch.argsort(freq, descending=True)[:100].numpy()
    assert t2d[top].all()
    stats = read_json(data_dir / "vocab_mapping" / "manifest.json")["counts"]
    assert 0.5 < stats["coverage"] <= 1.0


def test_fill_when_fewer_distinct_tokens_and_whole_vocab(tmp_path, data_dir):
    out = tmp_path / "vm"
    proc = stage("02_build_vocab_mapping.py", "--data-dir", data_dir, "--draft-vocab-size", 40000, "--output-dir", out)
    assert "coverage 100.00%" in proc.stdout and "filled" in proc.stdout
    d2t, t2d, freq = load_mapping(out)
    assert t2d.sum() == 40000 and t2d[freq.numpy() > 0].all()
    # unseen fillers are the lowest unseen ids: deterministic
    unseen_chosen = np.nonzero(t2d & (freq.numpy() == 0))[0]
    assert (unseen_chosen == np.nonzero(freq.numpy() == 0)[0][: len(unseen_chosen)]).all()
    proc = stage("02_build_vocab_mapping.py", "--data-dir", data_dir, "--draft-vocab-size", 60000, "--output-dir", out)
    assert "keeps the whole vocabulary" in proc.stdout
    d2t, t2d, _ = load_mapping(out)
    assert t2d.all() and (d2t == 0).all()


def test_rows_of_another_tokenizer_are_refused(tmp_path, data_dir, foreign_verifier):
    proc = stage("02_build_vocab_mapping.py", "--data-dir", data_dir, "--verifier-path", foreign_verifier,
                 "--output-dir", tmp_path / "vm", check=False)
    assert_user_error(proc, "another tokenizer")
    assert not (tmp_path / "vm" / "manifest.json").exists()
