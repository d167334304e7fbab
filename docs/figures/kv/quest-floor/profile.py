# One variant decoded at depth 16,384 from a cache kept by `quest_speed.py --keep /tmp/qkeep` (1 thread unless T is set;
# HUGE=1 copies the cache into huge-page maps), for `perf record -e cpu-clock -F 4000 python profile.py quest:1024 640`.
import sys, os, time, mmap, statistics, torch, attnlab
from attnlab.kv.pages import QuestSpec
spec = sys.argv[1]; steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
torch.set_num_threads(int(os.environ.get("T", "1")))
lm = attnlab.load("smollm2-135m", kv_dtype="float16", rope="yarn:4", tokenizer=False, attention=QuestSpec(32, 16, 0, 16))
cache = torch.load("/tmp/qkeep/smollm2-135m-float16-yarn:4-16384-16.pt", weights_only=False)
keep = []
def huge(t):
    m = mmap.mmap(-1, t.numel() * t.element_size()); m.madvise(mmap.MADV_HUGEPAGE); keep.append(m)
    out = torch.frombuffer(m, dtype=t.dtype).view(t.shape); out.copy_(t); return out
if os.environ.get("HUGE"):
    for layer in cache.layers:
        for name in ("k", "v", "pages_lo", "pages_hi", "keys_t", "keys_s"):
            if getattr(layer, name, None) is not None: setattr(layer, name, huge(getattr(layer, name)))
view = lm.with_attention(None if spec == "full" else spec)
tok = torch.tensor([[7]]); n = 16384
res = []
for rep in range(steps // 16):
    cache.truncate(n); view.forward(tok, cache)
    t = time.perf_counter()
    for _ in range(15): view.forward(tok, cache)
    res.append((time.perf_counter() - t) / 15 * 1e3)
print(spec, os.environ.get("HUGE"), "ms/step median", round(statistics.median(res), 2), [round(r, 1) for r in res], [l.strip() for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
