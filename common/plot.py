"""PNG plots: training curves (stage 04) and acceptance by draft position (stage 05)."""
import json
import os

from common.manifest import tmp_path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_training(metrics_path: str, png: str) -> str:
    records = [json.loads(line) for line in open(metrics_path) if line.strip()]
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for split, style in (("train", "-"), ("val", "o--")):
        rows = [r for r in records if r["split"] == split]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        ax_loss.plot(steps, [r["loss"] for r in rows], style, label=split)
        for pos in range(len(rows[0]["acc_pos"])):
            ax_acc.plot(steps, [r["acc_pos"][pos] for r in rows], style, label=f"{split} position {pos + 1}")
    ax_loss.set(xlabel="step", ylabel="loss", title="draft loss")
    ax_acc.set(xlabel="step", ylabel="accuracy (all positions so far right)", title="accuracy by draft position")
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    return _save(fig, plt, png)


def plot_acceptance(results: dict, png: str) -> str:
    """results: {name: [acceptance rate at position 1, 2, ...]}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(results))
    for k, (name, rates) in enumerate(results.items()):
        ax.bar([p + 1 + k * width for p in range(len(rates))], rates, width=width, label=name)
    ax.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance by draft position", ylim=(0, 1))
    ax.legend(fontsize=7)
    return _save(fig, plt, png)


def _save(fig, plt, png: str) -> str:
    fig.tight_layout()
    tmp = tmp_path(os.path.abspath(png)) + ".png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png)
    return png
