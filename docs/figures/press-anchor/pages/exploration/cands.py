"""Exploration only: candidate scorers on the saved prefills (see prep.py)."""
import copy, json, math, sys, time, torch
import torch.nn.functional as F
from dataclasses import dataclass
from typing import ClassVar
import attnlab
from attnlab.eval.ruler_run import answer_batch
from attnlab.kv.press import Press, compress, _window_probs

INF = float("inf")

@dataclass
class Cand(Press):
    w: int = 64          # window queries used (last w); 0 = the question only (in) -> qlen
    wagg: str = "mean"
    gagg: str = "mean"   # 'all' = mean over all heads (tova)
    pool: str = "avg5"   # avgK, maxK, avgK+maxM, pageP (max in page), none
    keep_win: bool = True
    name: ClassVar[str] = "cand"
    @property
    def window(self): return 128
    def score(self, o):
        n = o.keys.shape[2]
        w = self.w if self.w > 0 else int((o.q_pos >= self.ctx).sum())
        q, qp = o.queries[:, :, -w:], o.q_pos[:, -w:]

        oo = copy.copy(o); oo.queries, oo.q_pos = q, qp
        p = _window_probs(oo)  # B H G W n
        p = p.mean(3) if self.wagg == "mean" else p.amax(3)
        if self.gagg == "all":
            B, H = p.shape[:2]
            p = p.mean((1, 2), keepdim=True).expand(B, H, 1, n)[:, :, 0]
        else:
            p = p.mean(2) if self.gagg == "mean" else p.amax(2)
        B, H, _ = p.shape
        m = n - w if self.keep_win else n
        s = p[..., :m].reshape(B * H, 1, m)
        for step in self.pool.split("+"):
            if step.startswith("avg"):
                k = int(step[3:]); s = F.avg_pool1d(s, k, 1, k // 2)
            elif step.startswith("max"):
                k = int(step[3:]); s = F.max_pool1d(s, k, 1, k // 2)
            elif step.startswith("chunk"):  # kvpress ChunkKV: chunk mean (heads already shared)
                P = int(step[5:]); pad = (-m) % P
                x = F.pad(s, (0, pad), value=0).view(B * H, 1, -1, P)
                cnt = F.pad(torch.ones(m), (0, pad)).view(-1, P).sum(-1)
                x = (x.sum(-1, keepdim=True) / cnt[:, None]).expand(-1, -1, -1, P).reshape(B * H, 1, -1)[..., :m]
                s = x - 1e-9 * torch.arange(m)
            elif step.startswith("page"):
                P = int(step[4:]); pad = (-m) % P
                x = F.pad(s, (0, pad), value=0).view(B * H, 1, -1, P)
                x = x.amax(-1, keepdim=True).expand(-1, -1, -1, P).reshape(B * H, 1, -1)[..., :m]
                s = x - 1e-9 * torch.arange(m)  # earlier slot wins a page tie: whole pages in order
        s = s.view(B, H, m)
        return F.pad(s, (0, n - m), value=INF)

@dataclass
class Win(Press):
    name: ClassVar[str] = "win"
    @property
    def window(self): return 128

CANDS = {
 "snapkv": dict(w=64),
 "tova": dict(w=1, gagg="all", pool="none"),
 "snap_max9": dict(w=64, pool="avg5+max9"),
 "tova_max9": dict(w=1, gagg="all", pool="max9"),
 "snap_page16": dict(w=64, pool="page16"),
 "snap_page8": dict(w=64, pool="page8"),
 "tova_page16": dict(w=1, gagg="all", pool="page16"),
 "snap_gmax": dict(w=64, gagg="max"),
 "snap_w32": dict(w=32),
 "snap_w32_page16": dict(w=32, pool="page16"),
 "snap_w32_max9": dict(w=32, pool="avg5+max9"),
 "snap_qonly": dict(w=-1),
 "snap_qonly_page16": dict(w=-1, pool="page16"),
 "tova_page32": dict(w=1, gagg="all", pool="page32"),
 "tova_page8": dict(w=1, gagg="all", pool="page8"),
 "tova_chunk20": dict(w=1, gagg="all", pool="chunk20"),
 "snap_chunk20": dict(w=64, gagg="all", pool="avg5+chunk20"),
 "tova_hpage16": dict(w=1, gagg="mean", pool="page16"),
}
torch.set_num_threads(int(sys.argv[2]))
lm = attnlab.load(sys.argv[1], dtype="float32")
samples = json.load(open("/work/main/docs/figures/press-anchor/qwen2.5-0.5b-14/samples.json"))
names = sys.argv[3].split(","); qs = sys.argv[4].split(","); idx = [int(x) for x in sys.argv[5].split(",")] if len(sys.argv) > 5 else range(14)
for i in idx:
    s = samples[i]
    st = torch.load(f"/tmp/s54/states/{i}.pt", weights_only=False)
    for q in qs:
        for name in names:
            t = time.time()
            cache, rec, logits, rest = st[q]
            c = copy.deepcopy(cache)
            Cand.ctx = s["context_tokens"]
            compress(c, Cand(0.5, **CANDS[name]), rec)
            pred = answer_batch(lm, c, logits, [list(rest)], [s["max_new"]])[0]
            score = 100 * sum(a.lower() in pred.lower() for a in s["answers"]) / len(s["answers"])
            print(json.dumps({"cand": name, "q": q, "i": i, "task": s["task"], "score": score, "pred": pred[:50], "s": round(time.time() - t, 1)}), flush=True)
