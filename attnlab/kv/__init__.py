"""KV cache, the KV methods (`scorers`: one scorer each) and the two ways they are used: eviction policies that bound
the cache while it streams (StreamingLLM sinks, H2O heavy hitters, ...) and presses that compress it once."""
from attnlab.kv.cache import KVCache
from attnlab.kv.slots import CacheFullError, LayerKV
from attnlab.kv.press import PRESSES, Press, make_press
from attnlab.kv.policies import (H2O, POLICIES, TOVA, Full, Knorm, Policy, Sink, SinkH2O, SnapKV, Window, make_policy,
                                 parse_budget, select)

__all__ = ["CacheFullError", "KVCache", "LayerKV", "Policy", "Full", "Window", "Sink", "H2O", "SinkH2O", "TOVA",
           "SnapKV", "Knorm", "POLICIES", "make_policy", "parse_budget", "select", "Press", "PRESSES", "make_press"]
