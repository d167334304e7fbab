"""Hierarchical latent data and a small Transformer (JoMA Table 1).

JoMA argues that attention first picks up token pairs that co-occur often, and
those are the pairs whose common latent ancestor is low in the generating tree;
so a multi-layer Transformer builds the hierarchy bottom-up and its lower
layers' hidden units end up tracking the lowest latents. This module has the
generator (leaf tokens <- level-0 latents <- level-1 latents <- classes), the
3-layer post-LayerNorm Transformer of the authors' experiment, and the two
measurements: per-layer hidden-unit / latent correlation, and leaf
co-occurrence as a function of the height of the lowest common ancestor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.errors import AttnlabError


class LatentTree:
    """Random generating hierarchy: classes -> level-1 -> level-0 latents -> leaf tokens.

    ``children[0]`` maps each level-0 latent to ``fanout`` distinct leaves (ids < vocab-1),
    ``children[1]`` each level-1 latent to level-0 latents, ``children[2]`` each class to
    level-1 latents. A class's sequence is the sorted union of the leaves below it,
    right-aligned and left-padded with token ``pad = vocab - 1``.
    """

    def __init__(self, gen: torch.Generator, num_leaves: int = 99, num_latents=(10, 20),
                 num_classes: int = 20, fanout: int = 2, seq_len: int = 30):
        self.pad = num_leaves
        self.vocab = num_leaves + 1
        self.seq_len = seq_len
        sizes = [num_leaves, *num_latents, num_classes]
        self.sizes = sizes
        self.children: list[list[list[int]]] = []
        for lower, upper in zip(sizes[:-1], sizes[1:]):
            if math.comb(lower, fanout) < upper:
                raise AttnlabError(f"cannot draw {upper} distinct {fanout}-subsets of {lower} nodes")
            seen: set[tuple[int, ...]] = set()
            level = []
            while len(level) < upper:
                combo = tuple(sorted(torch.randperm(lower, generator=gen)[:fanout].tolist()))
                if combo not in seen:
                    seen.add(combo)
                    level.append(list(combo))
            self.children.append(level)
        # active[l]: (num_classes, sizes[l]) bool, which level-l nodes lie below each class
        # (l = 0 leaves, 1 level-0 latents, 2 level-1 latents, 3 the class itself).
        n_cls = num_classes
        act = torch.eye(n_cls, dtype=torch.bool)
        self.active = [act]
        for level in reversed(self.children):
            below = torch.zeros(n_cls, max(max(c) for c in level) + 1, dtype=torch.bool)
            for parent, kids in enumerate(level):
                below[:, kids] |= act[:, parent : parent + 1]
            act = below
            self.active.insert(0, act)
        self.active[0] = F.pad(self.active[0], (0, num_leaves - self.active[0].shape[1]))
        self.active[1] = F.pad(self.active[1], (0, sizes[1] - self.active[1].shape[1]))
        self.active[2] = F.pad(self.active[2], (0, sizes[2] - self.active[2].shape[1]))
        self.sequences = torch.full((n_cls, seq_len), self.pad, dtype=torch.long)
        for c in range(n_cls):
            leaves = self.active[0][c].nonzero().flatten()
            if len(leaves) > seq_len:
                raise AttnlabError(f"class {c} has {len(leaves)} leaves > seq_len {seq_len}")
            self.sequences[c, seq_len - len(leaves):] = leaves

    def compact_sequences(self) -> tuple[torch.Tensor, int]:
        """The class sequences cut to their last (longest leaf set + 1) positions, and how many
        original positions the first one stands for.

        Without positional embeddings, under causal attention every leading pad position has the
        same hidden state in every layer (each sees only identical pads), so the left-padding
        can be folded into one position whose attention weight is multiplied by the number of
        pads it replaces: same logits and same max-pooled activations, ~3x fewer positions.
        """
        keep = int(self.active[0].sum(1).max()) + 1
        return self.sequences[:, -keep:], self.seq_len - keep + 1

    @property
    def num_classes(self) -> int:
        return self.sizes[-1]

    def sample(self, batch: int, gen: torch.Generator):
        """(tokens (B, L) long, labels (B,) long) with classes drawn uniformly."""
        y = torch.randint(0, self.num_classes, (batch,), generator=gen)
        return self.sequences[y], y

    def latent_indicators(self, labels: torch.Tensor, level: int) -> torch.Tensor:
        """(B, n_level) 0/1 float: which latents of ``level`` (0 or 1) each sample activates."""
        return self.active[level + 1][labels].float()

    def lca_height(self) -> torch.Tensor:
        """(leaves, leaves) height of the lowest common ancestor: 1 = same level-0 latent,
        2 = same level-1 latent, 3 = same class, 4 = only the root; 0 on the diagonal."""
        n = self.sizes[0]
        h = torch.full((n, n), 4, dtype=torch.long)
        for height in (3, 2, 1):
            # leaves below each node of level `height` (height 3 = classes)
            cover = self._leaf_cover(height)  # (nodes, leaves) bool
            share = (cover.float().T @ cover.float()) > 0
            h[share] = height
        h.fill_diagonal_(0)
        return h

    def _leaf_cover(self, height: int) -> torch.Tensor:
        cover = torch.eye(self.sizes[0], dtype=torch.bool)
        for level in self.children[:height]:
            nxt = torch.zeros(len(level), self.sizes[0], dtype=torch.bool)
            for parent, kids in enumerate(level):
                nxt[parent] = cover[kids].any(0)
            cover = nxt
        return cover


def cooccurrence_by_height(tree: LatentTree) -> dict:
    """Mean P(b in sequence | a in sequence) over used leaf pairs, grouped by LCA height.

    Classes are equally likely, so the probability is exact. Returns {height: (mean, pairs)}.
    """
    occ = tree.active[0].float()  # (classes, leaves)
    used = occ.sum(0) > 0
    both = occ.T @ occ  # (leaves, leaves) classes containing both
    cond = both / occ.sum(0).clamp_min(1).unsqueeze(1)  # P(b | a), row a
    h = tree.lca_height()
    mask = used.unsqueeze(0) & used.unsqueeze(1) & (h > 0)
    out = {}
    for height in (1, 2, 3, 4):
        sel = mask & (h == height)
        if sel.any():
            out[height] = (float(cond[sel].mean()), int(sel.sum()))
    return out


@dataclass
class HierConfig:
    vocab: int = 100
    num_classes: int = 20
    dim: int = 64
    layers: int = 3
    mlp_mult: int = 4
    # MLP width; 0 = mlp_mult * dim. The authors' Table-1 run uses 4 * vocab = 400 whatever d is
    # (luckmatters decoder_only_hier.py, hidden_multi_type=M, hidden_multi=4).
    mlp_hidden: int = 0


class Block(nn.Module):
    """Single-head causal attention (Q/K/V, residual, post-LN) then ReLU MLP (residual, post-LN)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        """x: (B, L, d) -> (out (B, L, d), hidden ReLU activations (B, L, hidden)).

        ``mask``: optional (L, L) additive attention mask replacing the plain causal one."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (F.scaled_dot_product_attention(q, k, v, is_causal=True) if mask is None
               else F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        x = self.ln1(x + att)
        hidden = torch.relu(self.up(x))
        return self.ln2(x + self.down(hidden)), hidden


class HierTransformer(nn.Module):
    """Token embedding (no positions, as in the paper) -> blocks -> linear head on the last position."""

    def __init__(self, cfg: HierConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        hidden = cfg.mlp_hidden or cfg.mlp_mult * cfg.dim
        self.blocks = nn.ModuleList(Block(cfg.dim, hidden) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, tokens: torch.Tensor, first_copies: int = 1):
        """tokens: (B, L) -> (logits (B, classes), [hidden (B, L, h) per block]).

        ``first_copies`` > 1: position 0 stands for that many identical leading positions
        (see ``LatentTree.compact_sequences``); its attention weight is multiplied accordingly."""
        x = self.embed(tokens)
        mask = None
        if first_copies > 1:
            L = tokens.shape[1]
            mask = torch.full((L, L), float("-inf")).triu(1)
            mask[:, 0] += math.log(first_copies)
        hiddens = []
        for blk in self.blocks:
            x, h = blk(x, mask)
            hiddens.append(h)
        return self.head(x[:, -1]), hiddens


def seeded_model(seed: int, dim: int, hidden: int):
    """(generator, tree, class permutation, untrained model) of one J4 seed, always drawn in this order."""
    from .common import make_generator
    gen = make_generator(seed)
    tree = LatentTree(gen)
    shuffle = torch.randperm(tree.num_classes, generator=gen)
    torch.manual_seed(seed)  # nn.Module init uses the global generator
    model = HierTransformer(HierConfig(vocab=tree.vocab, num_classes=tree.num_classes, dim=dim, mlp_hidden=hidden))
    return gen, tree, shuffle, model


def _pearson_cols(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(H, n) Pearson correlations between the columns of a (N, H) and b (N, n)."""
    a, b = a - a.mean(0), b - b.mean(0)
    return (a.T @ b) / (a.norm(dim=0).unsqueeze(1) * b.norm(dim=0).unsqueeze(0)).clamp_min(1e-12)


def probe_score(feats: torch.Tensor, ind: torch.Tensor, folds: int | None = None, ridge: float = 1.0) -> float:
    """Class-held-out ridge probe: feats (N, H) per class, ind (N, n) latent indicators.

    Classes are split into ``folds`` groups (None: one per class, i.e. leave one class out,
    deterministic and the least data-starved); a ridge regression fitted on the other classes
    predicts the held-out classes' indicators. Score = Pearson correlation of the out-of-fold
    predictions with the indicators, mean over latents that vary. A latent shared with training
    classes can only be predicted if the features encode it, not the class identity, so this
    does not saturate the way a max over units on 20 points does. For reference (seeds 0-2,
    level-1 latents, leave-one-out): the true level-1 indicators as features score 0.63-0.68,
    the level-0 indicators 0.28-0.32, the bag of leaves 0.09-0.18 (``probe_references``).
    """
    folds = feats.shape[0] if folds is None else folds
    N = feats.shape[0]
    pred = torch.zeros_like(ind)
    for f in range(folds):
        test = torch.arange(N) % folds == f
        X, Y = feats[~test].double(), ind[~test].double()
        mu, sd = X.mean(0), X.std(0).clamp_min(1e-6)
        Xs, ym = (X - mu) / sd, Y.mean(0)
        K = Xs @ Xs.T / Xs.shape[1]
        alpha = torch.linalg.solve(K + ridge * torch.eye(len(K), dtype=K.dtype), Y - ym)
        Xt = (feats[test].double() - mu) / sd
        pred[test] = (Xt @ Xs.T / Xs.shape[1] @ alpha + ym).to(pred.dtype)
    keep = ind.std(0) > 0
    return float(torch.diagonal(_pearson_cols(pred[:, keep], ind[:, keep])).mean())


def probe_references(tree: LatentTree) -> list[dict]:
    """Probe scores of ideal features, per level l = 0, 1: the bag of leaves (what the input
    gives linearly), the level-0 and the level-1 latent indicators (a perfect code of that level).
    They put a layer's probe score on a scale: a layer that built level-1 detectors would move
    from the level-0 reference towards the level-1 one."""
    labels = torch.arange(tree.num_classes)
    feats = {"leaves": tree.active[0].float(), "level0": tree.active[1].float(), "level1": tree.active[2].float()}
    return [{k: probe_score(f, tree.latent_indicators(labels, lvl)) for k, f in feats.items()} for lvl in range(2)]


@torch.no_grad()
def hierarchy_measures(model: HierTransformer, tree: LatentTree, shuffle: torch.Tensor) -> dict:
    """Unsaturated per-layer measures on the classes' sequences, true vs shuffled latents.

    For block l (l = 0, 1) against level-l latents: 'probe' (``probe_score``), 'mean_corr'
    (mean over units and latents of |Pearson| between position-max-pooled ReLU activations
    and the indicators) and 'max_corr' (the saturated Table-1 measure). ``shuffle`` is a class
    permutation: the same measures against latents assigned to the wrong classes (control).
    """
    labels = torch.arange(tree.num_classes)
    _, hiddens = model(tree.sequences)
    out = {}
    for tag, lab in (("true", labels), ("shuffled", shuffle)):
        rows = []
        for lvl in range(min(2, len(hiddens))):
            h, ind = hiddens[lvl].amax(1), tree.latent_indicators(lab, lvl)
            keep = (ind.std(0) > 0)
            corr = _pearson_cols(h, ind[:, keep]).abs()
            rows.append({"probe": probe_score(h, ind), "mean_corr": float(corr.mean()),
                         "max_corr": float(corr.amax(0).mean())})
        out[tag] = rows
    return out


def authors_corr(hidden: torch.Tensor, ind: torch.Tensor) -> float:
    """The authors' Table-1 number (luckmatters decoder_only_hier.py, ``compute_corr(zero_mean=True)``):
    signed Pearson correlation between each latent's 0/1 indicator and each hidden unit over the
    samples, max over units per latent, mean over latents. hidden (N, H), ind (N, n).

    Signed and zero-mean (a unit that is *off* when the latent is on does not count), with the
    authors' 1e-9 in the norms, so a latent that never varies in the sample scores 0, as theirs."""
    a, b = ind - ind.mean(0), hidden - hidden.mean(0)
    corr = (a.T @ b) / (a.norm(dim=0)[:, None] + 1e-9) / (b.norm(dim=0)[None, :] + 1e-9)
    return float(corr.amax(1).mean())


@torch.no_grad()
def pooled_activations(model: HierTransformer, tree: LatentTree, labels: torch.Tensor) -> list[torch.Tensor]:
    """Position-max-pooled ReLU activations of blocks 0 and 1 on the sequences of classes ``labels``,
    (N, hidden) each. Sequences are a function of the class here, so each class is run once and
    its row repeated: the same numbers as running all samples."""
    seqs, copies = tree.compact_sequences()
    _, hiddens = model(seqs, copies)
    return [h.amax(1)[labels] for h in hiddens[:2]]


def authors_measure(model: HierTransformer, tree: LatentTree, labels: torch.Tensor, shuffle: torch.Tensor) -> dict:
    """``authors_corr`` per block l = 0, 1 against level-l latents on sampled sequences ``labels``
    (the authors draw 1,280), true latents vs latents of the class-shuffled label ``shuffle[y]``."""
    pooled = pooled_activations(model, tree, labels)
    return {tag: [authors_corr(h, tree.latent_indicators(lab, lvl)) for lvl, h in enumerate(pooled)]
            for tag, lab in (("true", labels), ("shuffled", shuffle[labels]))}


def batch_loss(model: HierTransformer, tree: LatentTree, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch of classes ``y`` (B,), computed once per distinct class
    on the compact sequences and weighted by the class counts: equal to the loss on
    ``tree.sequences[y]``, with the cost of ``num_classes`` short sequences whatever B is."""
    seqs, copies = tree.compact_sequences()
    labels = torch.arange(tree.num_classes)
    weight = torch.bincount(y, minlength=tree.num_classes).to(torch.float32) / len(y)
    logits, _ = model(seqs, copies)
    return (weight * F.cross_entropy(logits, labels, reduction="none")).sum()


def train_hierarchy(model: HierTransformer, tree: LatentTree, steps: int, batch: int, lr: float,
                    weight_decay: float, gen: torch.Generator, eval_every: int = 100,
                    progress=None) -> dict:
    """Adam on cross-entropy of the class at the last position; tracks the per-layer measures.

    A batch of ``batch`` uniformly drawn classes holds only the tree's few distinct sequences,
    so the batch loss is computed exactly as the class losses weighted by their counts in the
    batch, on the compact sequences: the same loss and gradient as the plain batch (up to float
    rounding) at ~20x less compute, which is what lets a CPU run the authors' step counts.

    Returns dict: 'steps' (S,), 'loss' (S,) batch loss, 'probe' (S, 2) and 'corr' (S, 2) (the
    class-held-out probe and max-unit correlation of ``hierarchy_measures``, true latents, layers
    0 and 1), 'accuracy' (final, fraction of classes predicted right).
    """
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    labels = torch.arange(tree.num_classes)
    shuffle = labels  # the control is not tracked over training
    rec = {"steps": [], "loss": [], "probe": [], "corr": []}
    for t in range(steps + 1):
        y = torch.randint(0, tree.num_classes, (batch,), generator=gen)
        loss = batch_loss(model, tree, y)
        if t % eval_every == 0 or t == steps:
            true = hierarchy_measures(model, tree, shuffle)["true"]
            rec["steps"].append(t)
            rec["loss"].append(loss.item())
            rec["probe"].append([r["probe"] for r in true])
            rec["corr"].append([r["max_corr"] for r in true])
        if t == steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress.update(1)
    with torch.no_grad():
        acc = float((model(tree.sequences)[0].argmax(-1) == labels).float().mean())
    return {"steps": torch.tensor(rec["steps"]), "loss": torch.tensor(rec["loss"]),
            "probe": torch.tensor(rec["probe"]), "corr": torch.tensor(rec["corr"]), "accuracy": acc}
