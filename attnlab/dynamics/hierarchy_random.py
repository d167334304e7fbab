"""J4 with random child activation: the route the authors' Table-1 code does not take.

In luckmatters' ``decoder_only_hier.py`` every child of an active latent is active, so each
class has exactly one sequence and a level-0 latent is present exactly when its leaves are:
layer 0 can only copy the input and nothing below the class needs composing. JoMA's generative
model (Sec. 6) activates children at random instead. Here each child of an active node turns on
independently with probability ``child_prob`` (noisy-OR over parents, since latents share
children), so sequences vary within a class, a latent can be active with some of its leaves
missing, and features that compose leaves into latents could pay off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .hierarchy import HierTransformer, LatentTree, authors_corr

from attnlab.errors import AttnlabError


def _edges(tree: LatentTree) -> list[torch.Tensor]:
    """Per level (bottom-up, as ``tree.children``): (parents, kids) bool adjacency."""
    out = []
    for lower, level in zip(tree.sizes[:-1], tree.children):
        m = torch.zeros(len(level), lower, dtype=torch.bool)
        for parent, kids in enumerate(level):
            m[parent, kids] = True
        out.append(m)
    return out


def sample_random(tree: LatentTree, labels: torch.Tensor, child_prob: float, gen: torch.Generator):
    """Top-down draw for classes ``labels`` (B,): (tokens (B, seq_len), [level-0 (B, 10), level-1
    (B, 20)] float indicators of the latents that came out active).

    Each (active parent, child) edge fires with probability ``child_prob``; a child is active if
    any edge into it fires. Tokens are the sorted active leaves, right-aligned, padded as in
    ``LatentTree``; a draw may have no leaf at all (an all-pad sequence)."""
    if not 0.0 < child_prob <= 1.0:
        raise AttnlabError(f"child probability must be in (0, 1], got {child_prob}")
    cur = F.one_hot(labels, tree.num_classes).bool()
    ind = []
    for edges in reversed(_edges(tree)):  # class -> level 1 -> level 0 -> leaves
        fire = torch.rand(len(labels), *edges.shape, generator=gen) < child_prob
        cur = (cur.unsqueeze(2) & edges & fire).any(1)
        ind.insert(0, cur.float())
    leaves, ind = ind[0], ind[1:]
    key = torch.where(leaves > 0, torch.arange(tree.sizes[0]), -1).sort(1).values[:, -tree.seq_len:]
    tokens = torch.where(key >= 0, key, tree.pad)
    return tokens, ind


def _compact(tree: LatentTree, tokens: torch.Tensor):
    """A random draw has a subset of its class's leaves, so the class sequences' compact width
    (``LatentTree.compact_sequences``) holds every draw: same outputs, ~3x fewer positions."""
    keep = tree.compact_sequences()[0].shape[1]
    return tokens[:, -keep:], tree.seq_len - keep + 1


@torch.no_grad()
def random_measure(model: HierTransformer, tree: LatentTree, child_prob: float, n: int,
                   shuffle: torch.Tensor, gen: torch.Generator) -> dict:
    """``authors_corr`` per block l = 0, 1 on ``n`` fresh draws, against the latents that were
    active in each draw ('true') and against those of an independent draw of the class
    ``shuffle[y]`` ('shuffled'); plus the accuracy on the draws."""
    labels = torch.randint(0, tree.num_classes, (n,), generator=gen)
    tokens, ind = sample_random(tree, labels, child_prob, gen)
    _, ind_sh = sample_random(tree, shuffle[labels], child_prob, gen)
    logits, hiddens = model(*_compact(tree, tokens))
    out = {"true": [], "shuffled": [], "accuracy": float((logits.argmax(-1) == labels).float().mean())}
    for lvl in range(min(2, len(hiddens))):
        h = hiddens[lvl].amax(1)
        out["true"].append(authors_corr(h, ind[lvl]))
        out["shuffled"].append(authors_corr(h, ind_sh[lvl]))
    return out


def train_random(model: HierTransformer, tree: LatentTree, child_prob: float, steps: int, batch: int,
                 lr: float, weight_decay: float, gen: torch.Generator, progress=None) -> list[float]:
    """Adam on fresh random draws each step (the authors' optimiser settings); returns the losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for _ in range(steps):
        y = torch.randint(0, tree.num_classes, (batch,), generator=gen)
        tokens, _ = sample_random(tree, y, child_prob, gen)
        loss = F.cross_entropy(model(*_compact(tree, tokens))[0], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress.update(1)
    return losses


def authors_references(tree: LatentTree, child_prob: float, n: int, gen: torch.Generator) -> dict:
    """``authors_corr`` of ideal features on ``n`` draws, to put a layer's score on a scale:
    level-1 latents against the draw's leaves (what the input gives), a perfect level-0 code and
    a perfect class detector (what the loss trains for); level-0 latents against the leaves.
    ``gen`` in the state ``random_measure`` gets it, so the draws are the measured ones."""
    labels = torch.randint(0, tree.num_classes, (n,), generator=gen)
    tokens, ind = sample_random(tree, labels, child_prob, gen)
    leaves = F.one_hot(tokens, tree.vocab).amax(1).float()[:, : tree.pad]
    cls = F.one_hot(labels, tree.num_classes).float()
    return {"level1_from_leaves": authors_corr(leaves, ind[1]), "level1_from_level0_code": authors_corr(ind[0], ind[1]),
            "level1_from_class": authors_corr(cls, ind[1]), "level0_from_leaves": authors_corr(leaves, ind[0])}


def main(argv=None) -> int:
    """``python -m attnlab.dynamics.hierarchy_random OUT.json [P ...]``: the references for
    seeds 0-5 of ``run_hierarchy`` at child probabilities P (default 1 and 0.8), written atomically."""
    import sys

    from attnlab.io import provenance, write_json

    from .common import make_generator
    args = sys.argv[1:] if argv is None else argv
    probs = [float(p) for p in args[1:]] or [1.0, 0.8]
    out = {}
    for p in probs:
        rows = []
        for s in range(6):
            tree = LatentTree(make_generator(s))
            # p = 1: run_hierarchy's sample is drawn from the seed's generator after the tree and
            # the shuffle; p < 1: from make_generator(10_000 + seed) (``_random_seed``)
            if p >= 1.0:
                g = make_generator(s)
                LatentTree(g)
                torch.randperm(tree.num_classes, generator=g)
            else:
                g = make_generator(10_000 + s)
            rows.append({"seed": s, **authors_references(tree, p, 1280, g)})
        out[str(p)] = rows
    record = provenance([])  # commit and dirty flag; the command is this module's, not the CLI's
    record["command"] = "python -m attnlab.dynamics.hierarchy_random " + " ".join(args)
    print(write_json(args[0], {**record, "seed": "0-5 (as run_hierarchy's seeds 0-5)", "references": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
