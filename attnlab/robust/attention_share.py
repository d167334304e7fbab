"""What attention shows: the share of the reply's attention that an adversarial suffix takes from the instruction.

At the position that predicts the reply's first token, per layer (heads averaged), the attention mass on the
suffix's tokens over the mass on the instruction's and the suffix's together; the same for a random suffix of the
same length from the same token set, the control. A suffix that works by drawing attention to itself should take
more than a random one does.
"""
from __future__ import annotations

import torch

from attnlab.analysis.anatomy import Recorder


def suffix_share(engine, case, suffix: list[int]) -> list[float]:
    """Per layer, the suffix's share of the attention mass (suffix + instruction) at the last prompt position."""
    ids = torch.tensor(case.before + list(suffix) + case.after)[None]
    a, b = case.prompt_start, len(case.before)
    c = b + len(suffix)
    shares: dict[int, float] = {}

    def on_probs(i: int, probs: torch.Tensor) -> None:
        row = probs[0, :, -1]  # [Hq, T]
        instr, suff = row[:, a:b].sum(-1), row[:, b:c].sum(-1)
        shares[i] = float((suff / (suff + instr).clamp_min(1e-12)).mean())

    engine.logits(ids, observers=[Recorder(on_probs)])
    return [shares[i] for i in range(len(shares))]


def random_suffix(allowed: torch.Tensor, length: int, seed: int) -> list[int]:
    pool = allowed.nonzero().flatten()
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randint(len(pool), (length,), generator=g)].tolist()


def plot(found: list[list[float]], control: list[list[float]], path, title: str) -> str:
    """Mean share per layer over the cases (with the min-max band): found suffixes against random ones."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnlab.io import save_figure
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for rows, label, color in ((found, "GCG suffix", "C3"), (control, "random suffix, same length", "C0")):
        t = torch.tensor(rows)
        x = range(t.shape[1])
        ax.plot(x, t.mean(0), label=label, color=color)
        ax.fill_between(x, t.min(0).values, t.max(0).values, color=color, alpha=0.15)
    ax.set_xlabel("layer")
    ax.set_ylabel("suffix share of attention\n(suffix / (suffix + instruction))")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, 1)
    ax.legend()
    return save_figure(fig, path)
