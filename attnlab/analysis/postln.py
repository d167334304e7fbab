"""J3 with the paper's architecture: a classic post-LayerNorm causal Transformer LM.

JoMA's real-text runs (Figs. 6, 8) use PyTorch's word-language-model Transformer
(luckmatters ssl/real-dataset, config decoder_wiki.yaml): embedding 200 scaled by
sqrt(d) plus sinusoidal positions, layers of x = LN(x + Drop(Attn(x))), x = LN(x +
Drop(FFN(x))) with a ReLU FFN of width 200, 1 head, dropout 0.2, Adam at lr 1e-4, bptt
35, batch 20. Our engine's model is pre-RMSNorm + RoPE + SwiGLU, and the per-layer
entropy pattern differs between the two, so this small self-contained model exists to
run J3 on the paper's architecture (the engine's `llama.py` is left alone).

Besides per-layer attention entropy, `probe` measures the orthogonality the theory
relies on: |cos| between embeddings of co-occurring token pairs vs random pairs, and
between each query and the key it attends to most vs a random earlier key, all against
the random-vector baseline sqrt(2 / (pi d)).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.analysis.anatomy import row_entropy
from attnlab.errors import AttnlabError


@dataclass
class PostLNConfig:
    vocab_size: int
    dim: int = 200
    hidden_dim: int = 200
    n_layers: int = 2
    n_heads: int = 1
    dropout: float = 0.2
    context: int = 35


def sinusoidal(T: int, d: int) -> torch.Tensor:
    """(T, d) sinusoidal position table of "Attention is all you need"."""
    pos = torch.arange(T, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(T, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div[: d // 2])
    return pe


class PostLNLayer(nn.Module):
    """Causal multi-head attention and ReLU FFN, each followed by residual + LayerNorm."""

    def __init__(self, cfg: PostLNConfig):
        super().__init__()
        self.h = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ff1, self.ff2 = nn.Linear(cfg.dim, cfg.hidden_dim), nn.Linear(cfg.hidden_dim, cfg.dim)
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, record: list | None = None) -> torch.Tensor:
        """x: (B, T, d). If ``record`` is a list, appends (probs (B, H, T, T), q, k (B, H, T, d/H))."""
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.h)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        if record is not None:
            record.append((probs.detach(), q.detach(), k.detach()))
        att = (self.drop(probs) @ v).transpose(1, 2).reshape(B, T, d)
        x = self.ln1(x + self.drop(self.proj(att)))
        return self.ln2(x + self.drop(self.ff2(self.drop(F.relu(self.ff1(x))))))


class PostLNLM(nn.Module):
    """Embedding * sqrt(d) + sinusoidal positions -> post-LN layers -> linear decoder."""

    def __init__(self, cfg: PostLNConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.dim % 2:
            raise AttnlabError(f"dim {cfg.dim} must be even and divisible by n_heads {cfg.n_heads}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(PostLNLayer(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.register_buffer("pe", sinusoidal(cfg.context, cfg.dim), persistent=False)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # as the PyTorch example the paper builds on
        nn.init.uniform_(self.head.weight, -0.1, 0.1)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor, record: list | None = None) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, vocab)."""
        x = self.drop(self.embed(ids) * math.sqrt(self.cfg.dim) + self.pe[: ids.shape[1]])
        for layer in self.layers:
            x = layer(x, record)
        return self.head(x)


def cooccurring_pairs(ids: torch.Tensor, top: torch.Tensor, n_pairs: int = 500) -> torch.Tensor:
    """The ``n_pairs`` most frequent adjacent pairs (a, b), a != b, among the ``top`` tokens: (P, 2)."""
    rank = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
    rank[top] = torch.arange(len(top))
    a, b = rank[ids[:-1]], rank[ids[1:]]
    ok = (a >= 0) & (b >= 0) & (a != b)
    key = torch.minimum(a[ok], b[ok]) * len(top) + torch.maximum(a[ok], b[ok])
    counts = torch.bincount(key, minlength=len(top) ** 2)
    best = counts.argsort(descending=True)[:n_pairs]
    best = best[counts[best] > 0]
    return torch.stack([top[best // len(top)], top[best % len(top)]], 1)


def _abs_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1).abs().mean())


@torch.no_grad()
def probe(model: PostLNLM, val_batches, top: torch.Tensor, pairs: torch.Tensor, gen_seed: int = 0) -> dict:
    """Per-layer attention entropy (mean over rows, heads, batches; first batch separately) and
    the orthogonality numbers (see module docstring), in eval mode."""
    was = model.training
    model.eval()
    L = model.cfg.n_layers
    ent, qk_att, qk_rand = torch.zeros(L), torch.zeros(L), torch.zeros(L)
    chunk = None
    g = torch.Generator().manual_seed(gen_seed)
    for bi, (x, _) in enumerate(val_batches):
        rec: list = []
        model(x, rec)
        for i, (p, q, k) in enumerate(rec):
            ent[i] += row_entropy(p).mean()
            T = p.shape[-1]
            t = torch.arange(1, T)  # queries with at least one earlier key besides themselves
            j_att = p[:, :, 1:, :].argmax(-1)  # (B, H, T-1) most attended key
            j_rnd = (torch.rand(j_att.shape, generator=g) * (t + 1)).long()  # uniform over keys <= t
            qq = q[:, :, 1:]
            qk_att[i] += _abs_cos(qq, torch.gather(k, 2, j_att.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])))
            qk_rand[i] += _abs_cos(qq, torch.gather(k, 2, j_rnd.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])))
        if bi == 0:
            chunk = torch.stack([row_entropy(p).mean() for p, _, _ in rec])
    n = len(val_batches)
    e = model.embed.weight
    rnd = top[torch.randint(0, len(top), (2, 4 * len(pairs)), generator=g)]
    rnd = rnd[:, rnd[0] != rnd[1]]
    model.train(was)
    return {"entropy_val": (ent / n).tolist(), "entropy_chunk": chunk.tolist(),
            "qk_attended_abs_cos": (qk_att / n).tolist(), "qk_random_abs_cos": (qk_rand / n).tolist(),
            "emb_cooc_abs_cos": _abs_cos(e[pairs[:, 0]], e[pairs[:, 1]]),
            "emb_random_abs_cos": _abs_cos(e[rnd[0]], e[rnd[1]])}


@functools.lru_cache(maxsize=2)
def _shakespeare_ids(vocab_size: int):
    """(tokenizer, train ids, validation ids) for word tokens; cached, a sweep tokenizes once."""
    from attnlab.data import corpus
    from attnlab.train.tokenizers import make_tokenizer

    tok = make_tokenizer("word", corpus("shakespeare:train"), vocab_size)
    train_ids = torch.tensor(tok.encode(corpus("shakespeare:train")), dtype=torch.long)
    val_ids = torch.tensor(tok.encode(corpus("shakespeare:validation")), dtype=torch.long)
    return tok, train_ids, val_ids


def train_postln(n_layers: int, lr: float, seed: int, steps: int, eval_at: list[int], dim: int = 200,
                 hidden_dim: int = 200, vocab_size: int = 2000, eval_batches: int = 5, batch: int = 20,
                 context: int = 35, clip: float = 0.5, dropout: float = 0.2, progress=None,
                 checkpoint=None, save_every: int = 200) -> list[dict]:
    """Train a PostLNLM on the Shakespeare training plays (word tokens) with Adam, constant lr,
    gradient clipping; minibatches are random bptt windows. Returns one row per evaluation.

    ``checkpoint``: a file path; the run saves model, optimiser, data and dropout generators and
    the rows so far there (atomically) every ``save_every`` minibatches, and resumes from it if it
    exists, so a long run on a shared machine survives being stopped and can be extended by
    calling again with a larger ``steps`` (the continuation is the same run, bit for bit). The
    checkpoint also keeps one ``segments`` entry per session (its commit, dirty flag, start, the
    minibatches it trained and its wall time): `segments` reads them back. Rows past ``steps``
    (a checkpoint further on than asked) are not returned."""
    tok, train_ids, val_ids = _shakespeare_ids(vocab_size)
    n_seq = min(eval_batches * batch, (len(val_ids) - 1) // context)
    vx = val_ids[: n_seq * context].view(n_seq, context)
    vy = val_ids[1: n_seq * context + 1].view(n_seq, context)
    val = [(vx[i:i + batch], vy[i:i + batch]) for i in range(0, n_seq, batch)]
    counts = torch.bincount(train_ids, minlength=tok.vocab_size)
    counts[0] = 0  # <unk>
    top = counts.argsort(descending=True)[:1000]
    pairs = cooccurring_pairs(train_ids, top)
    torch.manual_seed(seed)
    model = PostLNLM(PostLNConfig(tok.vocab_size, dim, hidden_dim, n_layers, dropout=dropout, context=context))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    rows, t0, marks = [], time.perf_counter(), set(eval_at) | {0, steps}

    def evaluate(step):
        with torch.no_grad():
            model.eval()
            vl = sum(float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in val) / len(val)
            model.train()
        rows.append({"step": step, "val_loss": vl, "seconds": round(time.perf_counter() - t0, 2),
                     **probe(model, val, top, pairs, seed)})

    first, done = 1, []
    if checkpoint is not None and Path(checkpoint).exists():
        st = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        g.set_state(st["data_rng"])
        torch.set_rng_state(st["torch_rng"])
        rows, first, done = st["rows"], st["step"] + 1, st.get("segments", [])
        t0 -= st["seconds"]
        if progress is not None:
            progress.update(min(st["step"], steps))
    else:
        evaluate(0)
    session = None
    if checkpoint is not None and first <= steps:
        from attnlab.io import provenance
        session = {k: v for k, v in provenance(None).items() if k != "command"}
        session.update(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), from_step=first - 1)
    s0 = time.perf_counter()
    for step in range(first, steps + 1):
        starts = torch.randint(0, len(train_ids) - context - 1, (batch,), generator=g)
        seq = train_ids[starts[:, None] + torch.arange(context + 1)]
        loss = F.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if progress is not None:
            progress.update(1)
        if step in marks:
            evaluate(step)
        if checkpoint is not None and (step % save_every == 0 or step == steps):
            seg = {**session, "to_step": step, "wall_s": round(time.perf_counter() - s0, 2)}
            _save(checkpoint, {"model": model.state_dict(), "opt": opt.state_dict(), "data_rng": g.get_state(),
                               "torch_rng": torch.get_rng_state(), "rows": rows, "step": step,
                               "seconds": time.perf_counter() - t0, "segments": done + [seg]})
    return [r for r in rows if r["step"] <= steps]


def segments(checkpoint) -> list[dict]:
    """The sessions that trained a checkpointed run: commit, dirty flag, start, minibatches, wall time."""
    if not Path(checkpoint).exists():
        return []
    return torch.load(checkpoint, weights_only=False).get("segments", [])


def _save(path, state: dict) -> None:
    from attnlab.io import write_atomic
    write_atomic(path, lambda tmp: torch.save(state, tmp))
