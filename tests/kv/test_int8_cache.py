"""The int8 KV cache: what it stores, how eviction moves it, and that a saved stream resumes exactly."""
import pytest
import torch

from attnlab.kv import make_policy
from attnlab.kv.cache import cache_state, load_cache_state
from attnlab.kernels.reference import dequantize_int8_blocks, int8_blocks
from tests.conftest import tiny_lm


@pytest.fixture
def lm():
    lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32)
    lm.kv_dtype = torch.int8
    return lm


def _kv(layer):
    return dequantize_int8_blocks(layer.k[:, :, :layer.n], layer.k_scale[:, :, :layer.n])


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_eviction_moves_codes_and_rerotates_keys(lm, positions):
    """`original`: kept slots keep their very codes and scales. `cache`: a key moved down d slots is its
    old key rotated by -d, rounded again (within one code step of each block's scale)."""
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    cache = lm.new_cache(capacity=32, positions=positions)
    lm.prefill(ids, cache)
    layer = cache.layers[1]
    before = {name: getattr(layer, name)[:, :, :layer.n].clone() for name in layer.buffers()}
    keys = _kv(layer)
    idx = torch.tensor([0, 1, 5, 9, 17, 23]).expand(1, layer.k.shape[1], -1).contiguous()
    layer.keep(idx)
    assert layer.n == 6
    v_now = dequantize_int8_blocks(layer.v[:, :, :6], layer.v_scale[:, :, :6])
    torch.testing.assert_close(v_now, dequantize_int8_blocks(before["v"], before["v_scale"])[:, :, idx[0, 0]])
    if positions == "original":
        for name, t in before.items():
            assert torch.equal(getattr(layer, name)[:, :, :6], t[:, :, idx[0, 0]])
    else:
        turn = lm.model.rope.tables(idx - torch.arange(6)).conj() / lm.model.rope.attention_factor
        from attnlab.rope import apply as rope_apply
        want = rope_apply(keys[:, :, idx[0, 0]], turn)
        step = layer.k_scale[:, :, :6].repeat_interleave(32, -1)
        assert ((_kv(layer) - want).abs() <= 0.5 * step + 1e-6).all()
        assert not torch.equal(layer.k[:, :, :6], before["k"][:, :, idx[0, 0]])  # moved keys really turned


def test_saved_int8_stream_resumes_exactly(lm):
    """cache_state keeps codes and scales: a stream restored into a fresh cache decodes the same logits;
    a float cache refuses the int8 state."""
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))

    def cache():
        return lm.new_cache(policy=make_policy("sink", 12, positions="cache", n_sink=2, chunk=8, block=4))
    a = cache()
    lm.prefill(ids[:, :20], a)
    state = cache_state(a)
    b = cache()
    load_cache_state(b, state)
    go = [torch.cat([lm.forward(ids[:, t:t + 1], c) for t in range(20, 40)], 1) for c in (a, b)]
    assert torch.equal(go[0], go[1])
    lm.kv_dtype = torch.float32
    with pytest.raises(ValueError, match="KV dtype"):
        load_cache_state(cache(), state)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_per_token_sink_eviction_rounds_each_sink_once(dtype):
    """StreamingLLM evicting one token per step turns its sinks at every step (keys sit at slot + shift, and the
    window keeps its rotation). Turned from one float32 copy, a float16 or int8 sink stays one rounding away from
    the float32 cache's; turned step after step, the roundings would pile up over the 300 evictions."""
    ids = torch.randint(0, 97, (1, 340), generator=torch.Generator().manual_seed(2))
    caches = {}
    for kv_dtype in (torch.float32, dtype):
        lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32)
        lm.kv_dtype = kv_dtype
        cache = caches[kv_dtype] = lm.new_cache(policy=make_policy("sink", 24, n_sink=4, chunk=8))
        lm.prefill(ids[:, :32], cache, chunk=8)
        for t in range(32, ids.shape[1]):
            lm.forward(ids[:, t:t + 1], cache)
    ref, low = caches[torch.float32], caches[dtype]
    assert low.shift == ref.shift and 0 < ref.shift <= ref.layers[0].capacity  # folded back, never past the capacity
    a, b = ref.layers[0], low.layers[0]  # the first layer's keys depend on the tokens alone, not on the KV dtype
    f = b.first  # the sinks' slots (`LayerKV.slide` moves them up)
    assert a.first == f and torch.equal(b.pos[:, :, f:f + 4], torch.arange(4).expand_as(b.pos[:, :, f:f + 4]))
    want = a.k[:, :, f:f + 4]
    if dtype == torch.int8:  # half a code step when written, half when turned
        err, step = _kv(b)[:, :, f:f + 4] - want, b.k_scale[:, :, f:f + 4].repeat_interleave(32, -1)
        bound = 1.5 * step
    else:  # half an ulp when written, half when turned (a turn keeps each pair's error's length)
        err, bound = b.k[:, :, f:f + 4].float() - want, 2 ** -9 * want.abs().view(*want.shape[:3], -1, 2).norm(dim=-1)
        err = err.view(*err.shape[:3], -1, 2).norm(dim=-1)
    assert (err.abs() <= bound + 1e-6).all(), (err.abs() / bound).max()
