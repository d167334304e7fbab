"""Decode and prefill speed: attnlab's engine against transformers on the same weights.

Both engines run in one process, at the same thread count, on the same dequantised
SmolLM2 weights. Runs are interleaved (ours, theirs, ours, ...) and repeated; medians are
printed with their ratio and with the memory-bandwidth bound of batch-1 decoding:
bytes read per token (weights + KV cache at that length) / measured bandwidth.

    python benchmarks/decode_speed.py --threads 1 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def bandwidth_gbs(repeats: int = 5) -> float:
    """Read bandwidth seen by a large fp32 matrix-vector product (what decoding does), GB/s."""
    w, v = torch.randn(8192, 16384), torch.randn(16384)
    w @ v
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        w @ v
        times.append(time.perf_counter() - t)
    return w.numel() * 4 / statistics.median(times) / 1e9


def crop(cache, length: int) -> None:
    """Roll an attnlab cache back to its first `length` tokens (benchmark reuse of one prefill)."""
    for layer in cache.layers:
        layer.pos[:, :, length:layer.n] = -1
        layer.n = length
    cache.seen = length


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    p.add_argument("--lengths", default="128,1024,4096")
    p.add_argument("--prefill", type=int, default=512, help="prompt length for the prefill timing")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import attnlab
    from transformers import AutoModelForCausalLM, DynamicCache

    lm = attnlab.LM.load("smollm2-135m", tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(str(lm.source.parent), gguf_file=lm.source.name,
                                              dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    weight_bytes = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values()
                       if t.data_ptr() != lm.model.embed.weight.data_ptr()) + lm.model.lm_head.weight.numel() * 4
    kv_per_token = 2 * lm.cfg.n_layers * lm.cfg.n_kv_heads * lm.cfg.head_dim * 4
    bw = bandwidth_gbs()
    print(f"threads={args.threads}  repeats={args.repeats}  steps/run={args.steps}  "
          f"measured bandwidth {bw:.1f} GB/s  weights read per token {weight_bytes / 1e6:.0f} MB")

    @torch.inference_mode()
    def ours_decode(cache, length):
        crop(cache, length)
        tok = torch.tensor([[7]])
        t = time.perf_counter()
        for _ in range(args.steps):
            lm.forward(tok, cache)
        return args.steps / (time.perf_counter() - t)

    @torch.inference_mode()
    def hf_decode(cache, length):
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)  # transformers 5: a negative count removes that many tokens
        tok = torch.tensor([[7]])
        t = time.perf_counter()
        for i in range(args.steps):
            hf(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([length + i]))
        return args.steps / (time.perf_counter() - t)

    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, lm.cfg.vocab_size, (1, length), generator=gen)
        ours_cache = lm.new_cache(capacity=length + args.steps)
        lm.prefill(ids, ours_cache)
        hf_cache = DynamicCache(config=hf.config)
        with torch.inference_mode():
            for s in range(0, length, 512):
                hf(ids[:, s:s + 512], past_key_values=hf_cache, use_cache=True)
        ours_decode(ours_cache, length), hf_decode(hf_cache, length)  # warm-up
        a, b = [], []
        for r in range(args.repeats):  # interleaved, alternating who goes first
            if r % 2:
                b.append(hf_decode(hf_cache, length)); a.append(ours_decode(ours_cache, length))
            else:
                a.append(ours_decode(ours_cache, length)); b.append(hf_decode(hf_cache, length))
        bound = bw * 1e9 / (weight_bytes + kv_per_token * length)
        rows.append((f"decode @ {length}", statistics.median(a), statistics.median(b), bound))
        del ours_cache, hf_cache

    ids = torch.randint(0, lm.cfg.vocab_size, (1, args.prefill), generator=gen)

    @torch.inference_mode()
    def ours_prefill():
        t = time.perf_counter()
        lm.prefill(ids, lm.new_cache(capacity=args.prefill), chunk=args.prefill)
        return args.prefill / (time.perf_counter() - t)

    @torch.inference_mode()
    def hf_prefill():
        t = time.perf_counter()
        hf(ids, use_cache=True, logits_to_keep=1)
        return args.prefill / (time.perf_counter() - t)

    ours_prefill(), hf_prefill()
    a, b = [], []
    for r in range(args.repeats):
        if r % 2:
            b.append(hf_prefill()); a.append(ours_prefill())
        else:
            a.append(ours_prefill()); b.append(hf_prefill())
    rows.append((f"prefill {args.prefill}", statistics.median(a), statistics.median(b), None))

    print(f"\n| run | attnlab tok/s | transformers tok/s | ratio | bandwidth bound tok/s | attnlab % of bound |")
    print("|---|---|---|---|---|---|")
    for name, ours, theirs, bound in rows:
        b = f"{bound:.1f}" if bound else "-"
        pct = f"{100 * ours / bound:.0f}%" if bound else "-"
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {b} | {pct} |")


if __name__ == "__main__":
    main()
