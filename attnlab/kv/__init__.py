"""KV cache and the eviction policies that bound it (StreamingLLM sinks, H2O heavy hitters, ...)."""
from attnlab.kv.cache import KVCache
from attnlab.kv.slots import CacheFullError, LayerKV
from attnlab.kv.press import PRESSES, Press, make_press
from attnlab.kv.policies import (H2O, POLICIES, TOVA, Full, Policy, Sink, SinkH2O, SnapKV, Window, make_policy,
                                 parse_budget, select)

__all__ = ["CacheFullError", "KVCache", "LayerKV", "Policy", "Full", "Window", "Sink", "H2O", "SinkH2O", "TOVA",
           "SnapKV", "POLICIES", "make_policy", "parse_budget", "select", "Press", "PRESSES", "make_press"]
