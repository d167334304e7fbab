"""One layer's KV slots: preallocated buffers written in place, and the moves an eviction makes.

Each layer owns fixed buffers written in place (no per-step concatenation, as in
gpt-fast). Every slot also records the absolute position of the token it holds,
so attention masks are derived from positions alone: that one rule covers
causal prefill chunks, left padding (position -1) and caches whose slots were
evicted and compacted, and it is what lets a policy drop tokens for real.

Two position conventions (StreamingLLM section 3.2):
- ``original``: keys are rotated at their absolute position when stored.
- ``cache``: keys sit at their *rank* in the cache (slot index), so distances never exceed
  the cache size. StreamingLLM stores keys before RoPE and rotates the whole
  cache at every step; here a key is rotated when written and, when eviction
  moves it, rotated on by the distance moved (rotations compose). Only distances
  matter to attention, so keys and queries are rotated at slot + `KVCache.shift`,
  and an eviction adds the tokens it removed to the shift: a key behind every
  evicted one keeps its rotation, and StreamingLLM's per-token eviction turns only
  the sinks (not the whole window) at each step. The shift folds back to 0 (every
  key turned once) before it exceeds the capacity, so angles stay small. Such an
  eviction does not even move the window: the sinks move up onto the evicted slot
  (`LayerKV.slide`) and the slots before them are compacted only when their room is
  needed (`KVCache.begin`).

An int8 cache (dtype torch.int8) stores each key and value row as int8 codes with one float32
scale per 32 dimensions (the rule of `int8` weights, llama.cpp's q8_0 KV cache): 1.125 bytes per
number instead of 2 (float16) or 4, and decode attention reads the codes directly (see
`attnlab/kernels/attend.cpp`). `update` then returns K and V as (codes, scales) pairs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.kernels.reference import dequantize_int8_blocks
from attnlab.kv.pages import channel_codes, summarize
from attnlab.rope import Rope, apply as rope_apply

POSITIONS = ("original", "cache")


@dataclass
class Step:
    """What every layer needs to know about the chunk being fed (shared, computed once)."""
    pos: torch.Tensor        # [B, T] absolute positions, -1 = left padding
    q_pos: torch.Tensor      # [B, T] positions queries and new keys are rotated at (slots in `cache` mode)
    rot: torch.Tensor        # RoPE tables for q_pos: complex [B, 1, T, D/2] or real [B, 1, T, D/2, 2]
    padded: bool             # the chunk contains left padding
    start: int               # first slot the chunk is written to (equal in every layer)


class CacheFullError(AttnlabError, RuntimeError):
    """Raised when a bounded cache has no room and no policy to make room."""


def _move(t: torch.Tensor, src: int, dst: int, count: int) -> None:
    """t[:, :, dst:dst + count] = t[:, :, src:src + count] for a per-slot buffer [B, H, C, ...]: one memmove per
    row and head (a slot's data is contiguous there), a single pass where torch's copy would need a clone first
    (the two ranges may overlap)."""
    if count <= 0 or src == dst:
        return
    if not t.is_contiguous():
        t[:, :, dst:dst + count] = t[:, :, src:src + count].clone()
        return
    size = t.element_size()
    slot, head, base = t.stride(2) * size, t.stride(1) * size, t.data_ptr()
    for row in range(base, base + t.shape[0] * t.shape[1] * head, head):
        ctypes.memmove(row + dst * slot, row + src * slot, count * slot)


class LayerKV:
    """One layer's slots. k, v: [B, H_kv, C, D]; pos: [B, H_kv, C] (absolute position, -1 = empty);
    an int8 cache adds k_scale, v_scale: [B, H_kv, C, D/32] (None otherwise). page: Quest's page size; the
    layer then keeps page_min, page_max [B, H_kv, ceil(n/page), D] (float16, rounded outward) of its stored keys (`attnlab.kv.pages`): views
    of buffers preallocated for the capacity (`pages_lo`, `pages_hi`), which the native step binds and updates.
    channel_keys: also keep keys_t [B, H_kv, D, capacity], the stored keys channel-major in int8, and keys_s
    [B, H_kv, capacity], each key's float32 scale (`attnlab.kv.pages.channel_codes`; zeros at padding), from which
    Quest with CHANNELS > 0 scores every key on a few channels (`attnlab.model.quest`)."""

    def __init__(self, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 rope: Rope, positions: str = "original", max_capacity: int | None = None,
                 window: int | None = None, page: int | None = None, channel_keys: bool = False):
        self.rope, self.positions, self.max_capacity = rope, positions, max_capacity
        self.page, self.paged = page, 0  # paged: the slots the page summaries cover
        self.window = window  # sliding-window attention: keys more than window - 1 tokens back are masked
        if dtype == torch.int8 and head_dim % 32:
            raise AttnlabError(f"an int8 KV cache needs a head size that is a multiple of 32, not {head_dim}")
        self.k = torch.zeros(batch, heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale = torch.zeros(batch, heads, capacity, head_dim // 32)
            self.v_scale = torch.zeros_like(self.k_scale)
        self.pos = torch.full((batch, heads, capacity), -1, dtype=torch.long)
        if page:
            self.pages_lo = torch.zeros(batch, heads, -(-capacity // page), head_dim, dtype=torch.float16)
            self.pages_hi = torch.zeros_like(self.pages_lo)
        self.keys_t = self.keys_s = None
        if page and channel_keys:
            self.keys_t = torch.zeros(batch, heads, head_dim, capacity, dtype=torch.int8)
            self.keys_s = torch.zeros(batch, heads, capacity)
        self.n = 0            # filled slots, equal for every row and head
        self.first = 0        # slots before it were evicted and are not read (`slide`); `KVCache.begin` compacts
        self.natural = True   # slot j holds the j-th token of every row (no padding, no eviction)
        self.padded = False   # some slot holds left padding (position -1)
        self._home = None  # `drop`: the sinks' keys in float32 and the shift they are rotated at
        self.policy_state: dict = {}  # per-layer bookkeeping of a cache policy (scores, ...); per-slot
        # tensors [..., capacity] follow their tokens when the cache is compacted

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def page_min(self) -> torch.Tensor | None:
        return self.pages_lo[:, :, :-(-self.paged // self.page)] if self.page else None

    @property
    def page_max(self) -> torch.Tensor | None:
        return self.pages_hi[:, :, :-(-self.paged // self.page)] if self.page else None

    def buffers(self) -> tuple[str, ...]:
        """Names of the per-slot tensors indexed [B, H_kv, slot, ...] (all grow, compact and save alike)."""
        return ("k", "v", "k_scale", "v_scale") if self.k_scale is not None else ("k", "v")

    def _reserve(self, need: int, exact: bool = False) -> None:
        if need <= self.capacity:
            return
        if self.max_capacity is not None and need > self.max_capacity:
            raise CacheFullError(f"KV cache full ({self.max_capacity} slots); use a cache policy to stream further")
        new = need if exact else max(need, 2 * self.capacity)
        if self.max_capacity is not None:
            new = min(new, self.max_capacity)
        grow = new - self.capacity
        for name in self.buffers():
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, t.new_zeros(*t.shape[:2], grow, t.shape[3])], dim=2))
        self.pos = torch.cat([self.pos, self.pos.new_full((*self.pos.shape[:2], grow), -1)], dim=2)
        if self.page:
            more = -(-new // self.page) - self.pages_lo.shape[2]
            self.pages_lo, self.pages_hi = (torch.cat([t, t.new_zeros(*t.shape[:2], more, t.shape[3])], dim=2)
                                            for t in (self.pages_lo, self.pages_hi))
        if self.keys_t is not None:
            self.keys_t = torch.cat([self.keys_t, self.keys_t.new_zeros(*self.keys_t.shape[:3], grow)], dim=3)
            self.keys_s = torch.cat([self.keys_s, self.keys_s.new_zeros(*self.keys_s.shape[:2], grow)], dim=2)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: "Step"):
        """Store a chunk and return what its queries attend to.

        k, v: [B, H_kv, T, D] keys (already rotated at step.q_pos) and values of the chunk.
        Returns (K, V, mask): K, V [B, H_kv, n - first, D], the slots from `first` (an int8 cache: (codes, scales)
        pairs) and mask None (attend to all), "causal" (a natural cache: query i of the chunk sees slots 0 .. n - T + i)
        or bool [B, H_kv, T, n - first].
        """
        T = k.shape[2]
        if step.padded:
            self.padded, self.natural = True, False
        s = slice(step.start, step.start + T)
        n, lo = step.start + T, self.first
        if self.k_scale is None:
            self.k[:, :, s] = k
            self.v[:, :, s] = v
            K, V = self.k[:, :, lo:n], self.v[:, :, lo:n]
        else:
            self.k[:, :, s], self.k_scale[:, :, s] = ops.quantize_kv(k)
            self.v[:, :, s], self.v_scale[:, :, s] = ops.quantize_kv(v)
            K, V = (self.k[:, :, lo:n], self.k_scale[:, :, lo:n]), (self.v[:, :, lo:n], self.v_scale[:, :, lo:n])
        self.pos[:, :, s] = step.pos[:, None, :]
        if self.page:
            self._summarize(step.start, n)
        windowed = self.window is not None and int(step.pos.max()) - int(self.pos[:, :, :n].clamp_min(0).min()) >= self.window
        if T == 1 and not self.padded and not windowed:
            return K, V, None
        if self.natural and not windowed:  # slot j is token j: query i sees slots 0 .. n - T + i
            return K, V, "causal"
        k_pos = self.pos[:, :, lo:n]
        q_pos = step.q_pos
        if self.positions == "cache":  # by slot: the shift is the same for keys and queries
            k_pos = torch.where(k_pos >= 0, torch.arange(lo, n), -1)
            q_pos = torch.arange(step.start, n).expand_as(q_pos)
        mask = (k_pos[:, :, None, :] <= q_pos[:, None, :, None]) & (k_pos[:, :, None, :] >= 0)
        if windowed:  # by absolute token distance, whatever the position convention or evictions
            mask &= self.pos[:, :, None, lo:n] > step.pos[:, None, :, None] - self.window
        mask |= ~mask.any(-1, keepdim=True)  # padding queries see everything; their output is unused
        return K, V, mask

    def _rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx [B, H_kv, m] of the per-slot buffer `name`: whole rows by index_select on a flat view,
        several times faster than an elementwise gather."""
        t = getattr(self, name)
        B, H, C = t.shape[:3]
        flat = (idx + torch.arange(B * H).view(B, H, 1) * C).reshape(-1)
        return t.flatten(0, 2).index_select(0, flat).view(B, H, idx.shape[-1], -1)

    def read(self, slots: torch.Tensor):
        """K, V at slots [B, H_kv, m], in `update`'s form (int8: (codes, scales) pairs): what a decode step that
        reads only some slots attends to (Quest, `attnlab.model.quest`)."""
        k, v = (self._rows(name, slots) for name in ("k", "v"))
        if self.k_scale is None:
            return k, v
        return (k, self._rows("k_scale", slots)), (v, self._rows("v_scale", slots))

    def keep(self, idx: torch.Tensor, shift: int = 0, new_shift: int = 0) -> None:
        """Compact the cache to the slots idx: [B, H_kv, m] (ascending), freeing the rest for reuse.
        `cache` positions: keys were rotated at slot + shift and are turned to their new slot + new_shift."""
        m = idx.shape[-1]
        kept = {name: self._rows(name, idx) for name in self.buffers()}
        for name, t in kept.items():
            getattr(self, name)[:, :, :m] = t
        self.pos[:, :, :m] = torch.gather(self.pos[:, :, :self.n], 2, idx)
        self.pos[:, :, m:self.n] = -1
        for value in self._slot_states():
            kept = torch.gather(value[..., :self.n], -1, idx.view(*idx.shape[:2], *[1] * (value.dim() - 3), -1)
                                .expand(*value.shape[:-1], m))
            value.zero_()
            value[..., :m] = kept
        self.n = m
        self.natural = False
        self._home = None
        if self.positions == "cache":  # a key moved from slot idx to slot j: rotate it on by j + new_shift - idx - shift
            turn = torch.arange(m) + new_shift - idx - shift
            moved = (turn != 0).flatten(0, 1).any(0).nonzero()
            if len(moved):  # keys from slot r on (behind every evicted one) keep their rotation
                r = int(moved[-1]) + 1
                self._turn(0, r, turn[..., :r])
        if self.page:  # slots moved (and `cache` keys turned): every page changed
            self._summarize(0, m)

    def drop(self, a: int, b: int, shift: int = 0, new_shift: int = 0) -> None:
        """Evict the slots [a, b) (a policy that keeps sinks and recent tokens, in an unpadded cache): the later
        slots move down in one block copy, no gather. `cache` positions: as `keep`, but the first a keys (the
        sinks), turned again at every eviction, are turned from one float32 copy of them (`_home`), so repeated
        turns do not pile up rounding errors in a float16 or int8 cache."""
        n, e = self.n, b - a
        m = n - e
        self._move_slots(b, a, n - b)
        self._clear(m, n)
        self.n, self.first = m, 0
        self.natural = False
        if self.positions == "cache":
            if a and new_shift != shift:
                self._turn(0, a, new_shift - self._sinks(0, a, shift), self._home[0])
            if new_shift != shift + e:  # the shift folded back: the keys behind the evicted ones turn too
                self._turn(a, m, new_shift - shift - e)
        if self.page:
            self._summarize(0, m)

    def slide(self, a: int, b: int, shift: int = 0) -> None:
        """Evict the slots [a, b) as `drop` does, without moving the window: the sinks, slots [first, a), move up
        to end at b (a few rows), and the slots before them are left unread (position -1, `first`), until the
        cache needs their room (`KVCache.begin` compacts, once per `Policy.chunk` tokens or so). `cache`
        positions: the sinks, s slots further on, turn by s (from their float32 copy); nothing else turns."""
        s = a - self.first
        t = b - s
        if self.positions == "cache" and s:
            at = self._sinks(self.first, a, shift)
        self._move_slots(self.first, t, s)
        self._clear(self.first, t)
        self.first = t
        self.natural = False
        if self.positions == "cache" and s:
            self._turn(t, b, t + shift - at, self._home[0])

    def _move_slots(self, src: int, dst: int, count: int) -> None:
        """Slots [src, src + count) to [dst, dst + count): keys, values, scales, positions and per-slot policy state."""
        for name in (*self.buffers(), "pos"):
            _move(getattr(self, name), src, dst, count)
        for value in self._slot_states():
            value[..., dst:dst + count] = value[..., src:src + count].clone()

    def _clear(self, lo: int, hi: int) -> None:
        """Slots [lo, hi) hold nothing any more: position -1, no policy state."""
        self.pos[:, :, lo:hi] = -1
        for value in self._slot_states():
            value[..., lo:hi] = 0

    def _slot_states(self):
        """The policy's per-slot tensors [..., capacity] (they follow their tokens when slots move)."""
        return [v for v in self.policy_state.values() if isinstance(v, torch.Tensor) and v.shape[-1] == self.capacity]

    def _sinks(self, r0: int, r1: int, shift: int) -> int:
        """Keep the float32 copy of the sinks, slots [r0, r1) (`_home`: made once, while they are these rows);
        returns the position its first row is rotated at (its rows follow)."""
        if self._home is None or self._home[0].shape[2] != r1 - r0:
            self._home = (self._keys(r0, r1).clone(), r0 + shift)  # clone: float32 keys are a view of the buffer
        return self._home[1]

    def _keys(self, r0: int, r1: int) -> torch.Tensor:
        """The stored keys of slots [r0, r1) in float32 (int8: dequantised)."""
        if self.k_scale is None:
            return self.k[:, :, r0:r1].float()
        return dequantize_int8_blocks(self.k[:, :, r0:r1], self.k_scale[:, :, r0:r1])

    def _turn(self, r0: int, r1: int, turn, keys: torch.Tensor | None = None) -> None:
        """Store the keys of slots [r0, r1) (float32 `keys`, default the stored ones) rotated on by `turn` positions:
        an int or [B, H_kv, r1 - r0], either sign (an int8 cache rounds the rotated keys again)."""
        if isinstance(turn, int):  # one turn for every key (the same in every layer: tables kept by the Rope)
            cis = self.rope.turn(turn)
        else:
            cis = self.rope.tables(turn.abs()) / self.rope.attention_factor  # unit rotations
            cis = torch.where(turn[..., None] < 0, cis.conj(), cis)
        keys = rope_apply(self._keys(r0, r1) if keys is None else keys, cis)
        if self.k_scale is None:
            self.k[:, :, r0:r1] = keys
        else:
            self.k[:, :, r0:r1], self.k_scale[:, :, r0:r1] = ops.quantize_kv(keys)

    def keep_channel_keys(self) -> None:
        """Start keeping keys_t (a cache built for Quest's bound, read under CHANNELS > 0)."""
        if self.keys_t is None:
            B, H, C, D = self.k.shape
            self.keys_t = torch.zeros(B, H, D, C, dtype=torch.int8)
            self.keys_s = torch.zeros(B, H, C)
            self._summarize(0, self.paged)

    def _summarize(self, first: int, n: int) -> None:
        """Recompute the page summaries (and keys_t) from the page holding slot `first` up to slot n (pages before
        stay)."""
        p0 = first // self.page
        a = p0 * self.page
        self.paged = n
        if n <= a:
            return
        keys, valid = self._keys(a, n), self.pos[:, :, a:n] >= 0
        if self.keys_t is not None:
            self.keys_t[:, :, :, a:n], self.keys_s[:, :, a:n] = channel_codes(keys, valid)
        lo, hi = summarize(keys, valid, self.page)
        self.pages_lo[:, :, p0:p0 + lo.shape[2]] = lo
        self.pages_hi[:, :, p0:p0 + hi.shape[2]] = hi

    def nbytes(self) -> int:
        """Bytes of the key/value data: the per-slot buffers (scales included) and Quest's page summaries and
        channel-major copy; `held_bytes` is everything the layer holds."""
        pages = (self.pages_lo, self.pages_hi) if self.page else ()
        pages += (self.keys_t, self.keys_s) if self.keys_t is not None else ()
        return sum(t.numel() * t.element_size() for t in (*(getattr(self, name) for name in self.buffers()), *pages))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds: buffers, positions, Quest's summaries and channel-major copy, the sinks'
        float32 copy, the policy's state. Read from the layer's own attributes (and the dicts, lists and tuples
        in them), so a buffer added later is counted without naming it here; the shared RoPE tables are not
        the layer's (an object, not a container) and are left out."""
        return list(held_tensors(vars(self)))

    def held_bytes(self) -> int:
        """Every byte this layer holds (what a server counts against its cache limit): each storage `tensors`
        reach, once (a view adds nothing). Unlike `nbytes`, positions and the policy's state are included."""
        return storage_bytes(self.tensors())


def held_tensors(value):
    """The tensors in value, a tensor or a dict / list / tuple of them (nested), other objects left out."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from held_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from held_tensors(v)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under these tensors (views of one buffer count it once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
