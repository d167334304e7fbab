"""Registers J3 (`attnlab dynamics attention-entropy`); the code lives in attnlab.analysis.entropy_dynamics."""
from __future__ import annotations

from .spec import Experiment


def _run(out, seed, size, progress, **options):
    from attnlab.analysis.entropy_dynamics import run_attention_entropy
    return run_attention_entropy(out, seed=seed, size=size, progress=progress, **options)


def _summary(m):
    from attnlab.analysis.entropy_dynamics import summary_lines
    return summary_lines(m)


EXPERIMENT = Experiment("attention-entropy", "J3: attention entropy per layer while training on Shakespeare (JoMA Figs. 6, 8)",
                        _run, _summary,
                        options=(("arch", str, "llama", "llama (ours: pre-RMSNorm, RoPE, SwiGLU) or postln (the paper's)"),
                                 ("lr", float, 0.0, "learning rate (0 = the size's default)"),
                                 ("steps", int, 0, "minibatches (0 = the size's default)"),
                                 ("seeds", int, 1, "seeds per configuration (postln)"),
                                 ("layers", str, "", "comma-separated depths, e.g. 1,2 (empty = the size's default)")))
