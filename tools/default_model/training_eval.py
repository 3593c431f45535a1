"""How the embedded model is judged: held-out bits per byte against gzip -9 on the same
bytes, and the loss curve. See :mod:`tools.default_model.train_default`."""
from __future__ import annotations

import gzip
import math
from pathlib import Path

def heldout_bits_per_byte(model, tok, texts: list[str], ids: dict, ctx: int, batch: int = 8) -> dict:
    """Sum of token NLL (nats) / ln 2 / UTF-8 bytes, each file as bos + text + eos.

    Each file is cut into windows of ``ctx`` inputs overlapping by one token, so every
    token after bos is predicted exactly once (context resets at window borders).
    """
    import torch
    import torch.nn.functional as F

    total_nll = 0.0
    total_tokens = 0
    total_bytes = 0
    model.eval()
    full_windows: list[list[int]] = []
    partial: list[list[int]] = []
    for text in texts:
        seq = [ids["bos"]] + tok.encode(text, add_special_tokens=False).ids + [ids["eos"]]
        total_bytes += len(text.encode("utf-8"))
        for start in range(0, len(seq) - 1, ctx):
            w = seq[start : start + ctx + 1]
            (full_windows if len(w) == ctx + 1 else partial).append(w)

    def run(batch_windows):
        nonlocal total_nll, total_tokens
        t = torch.tensor(batch_windows, dtype=torch.long)
        logits = model(input_ids=t[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1), reduction="sum")
        total_nll += float(nll)
        total_tokens += t[:, 1:].numel()

    with torch.inference_mode():
        for i in range(0, len(full_windows), batch):
            run(full_windows[i : i + batch])
        for w in partial:
            run([w])
    model.train()
    return {
        "nll_nats": total_nll,
        "tokens": total_tokens,
        "bytes": total_bytes,
        "loss": total_nll / max(total_tokens, 1),
        "bits_per_byte": total_nll / math.log(2) / max(total_bytes, 1),
    }


def gzip_bits_per_byte(data: bytes) -> float:
    return 8.0 * len(gzip.compress(data, 9)) / len(data)


def plot_loss_curve(history, path: Path, gz_loss=None, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(h["tokens"], h["train_loss"]) for h in history if h.get("train_loss") is not None]
    he = [(h["tokens"], h["heldout_loss"]) for h in history if h.get("heldout_loss") is not None]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    if tr:
        ax.plot([t / 1e6 for t, _ in tr], [v for _, v in tr], label="train (EMA)", lw=1.2)
    if he:
        ax.plot([t / 1e6 for t, _ in he], [v for _, v in he], "o-", label="held-out", lw=1.5, ms=4)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("loss (nats/token)")
    lo = min([v for _, v in tr + he] or [0])
    ax.set_ylim(max(0.0, lo - 0.2), min(10.0, lo + 4.0))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
