"""Draft vocabulary: the most frequent assistant tokens, as speculators' t2d/d2t (stage 02)."""
import numpy as np
import torch


def count_assistant_tokens(datasets_, target_vocab: int) -> torch.Tensor:
    """Frequency of every verifier token id over loss-masked (assistant) positions."""
    freq = torch.zeros(target_vocab, dtype=torch.int64)
    for ds in datasets_:
        for batch in ds.with_format("numpy").iter(batch_size=256):
            for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
                ids = np.asarray(ids)[np.asarray(mask).astype(bool)]
                freq += torch.bincount(torch.from_numpy(ids.astype(np.int64)), minlength=target_vocab)[:target_vocab]
    return freq


def build_mapping(freq: torch.Tensor, draft_vocab: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Top `draft_vocab` tokens by frequency; ties and unseen fillers go to the lowest id (deterministic).

    Returns d2t (int64 offsets: target = i + d2t[i], draft ids sorted by target id, as vLLM expects),
    t2d (bool over the target vocab) and statistics.
    """
    target_vocab = freq.numel()
    draft_vocab = min(draft_vocab, target_vocab)
    # Stable sort on -freq keeps ascending ids among equal counts, zeros included.
    order = torch.from_numpy(np.argsort(-freq.numpy(), kind="stable"))
    chosen = torch.sort(order[:draft_vocab]).values
    d2t = (chosen - torch.arange(draft_vocab)).numpy().astype(np.int64)
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[chosen.numpy()] = True
    total = int(freq.sum())
    distinct = int((freq > 0).sum())
    stats = {"target_vocab": target_vocab, "draft_vocab": draft_vocab, "distinct_assistant_tokens": distinct,
             "assistant_tokens": total, "filled_unseen": max(0, draft_vocab - distinct),
             "coverage": float(freq[chosen].sum()) / total if total else 0.0}
    return d2t, t2d, stats
