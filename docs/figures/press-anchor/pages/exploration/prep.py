"""Exploration only: prefill each Qwen sample once (context; context+question-but-last), keep window-64 queries, save."""
import copy, json, sys, time, torch
from dataclasses import dataclass
from typing import ClassVar
import attnlab
from attnlab.kv.press import Press, PressRecorder

@dataclass
class Win(Press):
    name: ClassVar[str] = "win"
    @property
    def window(self): return 128

torch.set_num_threads(int(sys.argv[2]))
lm = attnlab.load(sys.argv[1], dtype="float32")
samples = json.load(open("/work/main/docs/figures/press-anchor/qwen2.5-0.5b-14/samples.json"))
for i, s in enumerate(samples):
    t = time.time()
    n = s["context_tokens"]
    cache = lm.new_cache(1, capacity=len(s["ids"]) + 64)
    rec = PressRecorder(Win(0.5), cache.layers)
    logits = lm.prefill(torch.tensor([s["ids"][:n]]), cache, chunk=512, observers=[rec])
    c2, r2 = copy.deepcopy((cache, rec))
    lm.prefill(torch.tensor([s["ids"][n:-1]]), c2, chunk=512, observers=[r2])
    torch.save({"out": (cache, rec, logits, s["ids"][n:]), "in": (c2, r2, logits, s["ids"][-1:])}, f"/tmp/s54/states/{i}.pt")
    print(i, s["task"], round(time.time() - t, 1), flush=True)
