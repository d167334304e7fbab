"""The compiled decode step, called without dynamo's per-step guard checks.

Every decode step runs the same graph: only the token, its RoPE row, the write slot and the
cache's buffers change, and the engine's step (`attnlab.engine.LM.forward`) decides which steps
may take the compiled path and runs the cache's bookkeeping around it. Dynamo still traces, guards and compiles:
a step in a new situation (first step, new cache, grown cache) goes
through it, and the backend records which graph input is which tensor: a parameter or buffer of
the model (by its path), the token ids, a RoPE table or a cache buffer. Later steps in the same
situation build that input list directly and call the compiled graph. For SmolLM2-135M int4 the
graph has ~500 tensor inputs; checking dynamo's guards on them cost about a fifth of a step.

A situation is what the recorded graph specialised on and the input list does not re-derive:
token count, dtypes, cache geometry (capacity, heads, dtype, position convention, window,
padding), the step's start slot if the graph took it as a constant and grad mode (a step with a
sparsity plan or observers never comes here). The model's tensors must be the very objects recorded (a swapped module, e.g.
quantized after compiling, sends the step back through dynamo), and its dtype is part of the
situation, so inductor's per-input size asserts are redundant here as they are under dynamo's
guards, and are off by default. Anything the recorder cannot name (an input that is not a model
tensor, a step table or a cache buffer; a step split into several graphs) leaves that situation on
dynamo's path.
"""
from __future__ import annotations

import operator

import torch
from torch._inductor.compile_fx import compile_fx


def _param_paths(model: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> an expression reading it from `m` through the modules' own dicts (no __getattr__)."""
    paths = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        expr = "m" + "".join(f"._modules[{p!r}]" for p in name.split(".") if p)
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(mod, kind).items():
                if t is not None:
                    paths.setdefault(id(t), f"{expr}.{kind}[{key!r}]")
    return paths


def _step_paths(ids: torch.Tensor, ctx) -> dict[int, str]:
    """id(tensor) -> expression for what a decode step passes in: ids, the step's tables, cache buffers."""
    paths = {id(ids): "ids", id(ctx.rot): "ctx.rot", id(ctx.step.pos): "ctx.step.pos",
             id(ctx.step.q_pos): "ctx.step.q_pos"}
    for i, layer in enumerate(ctx.kvs):
        for name in (*layer.buffers(), "pos"):
            paths.setdefault(id(getattr(layer, name)), f"kvs[{i}].{name}")
    return paths


# The write slot is traced as a size from the first step on: left to dynamo's automatic dynamic shapes a
# model compiles twice (the first step static, the next one dynamic), a minute or more each. The cache's
# capacity stays static until a cache of another capacity arrives (then dynamo makes it dynamic): marking
# it dynamic from the start too would save that compile, but its step measured 0.86-0.87x at depth 128 in
# two in-process runs (both load orders; a third saw 0.86x between two identical graphs: not settled).
DYNAMIC = r"L\['ctx'\]\.step\.start"


class DecodeStep:
    """`torch.compile(model.forward)` for single-token steps, with a guard-free fast path per situation."""

    def __init__(self, model: torch.nn.Module, fullgraph: bool = False, options: dict | None = None):
        self.model, self.options = model, {"size_asserts": False, "cpp_wrapper": True, **(options or {})}
        self.dynamo = torch.compile(model.forward, backend=self._backend, dynamic=None, fullgraph=fullgraph,
                                    isolate_recompiles=True)
        self.recipes: dict[tuple, tuple] = {}  # situation -> (graph, input builder, static start, model tensors)
        self.calls = {"dynamo": 0, "direct": 0, "compiles": 0}
        self._seen: list = []  # (compiled graph, real inputs, outputs) per graph run in a dynamo call

    def _backend(self, gm, example_inputs):
        self.calls["compiles"] += 1
        fn = compile_fx(gm, example_inputs, config_patches=self.options)

        def graph(*args):
            out = fn(*args)
            self._seen.append((fn, args, out))
            return out
        return graph

    def situation(self, ids: torch.Tensor, ctx, last_only: bool) -> tuple:
        k, kv0 = ctx.kvs[0].k, ctx.kvs[0]
        return (tuple(ids.shape), ids.dtype, last_only, len(ctx.kvs), tuple(k.shape), k.stride(), k.dtype,
                kv0.pos.shape[2], tuple(ctx.rot.shape), ctx.rot.dtype, kv0.positions, kv0.window,
                any(layer.padded for layer in ctx.kvs), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                self.model.norm.weight.dtype)

    def __call__(self, ids: torch.Tensor, ctx, last_only: bool = False) -> torch.Tensor:
        key = self.situation(ids, ctx, last_only)
        recipe = self.recipes.get(key)
        start = ctx.step.start
        if recipe is not None and (start == recipe[2] if recipe[2] is not None else start >= 2):
            fn, build, _, (pick, tensors) = recipe
            try:
                args = build(self.model, ids, ctx, ctx.kvs, start)
            except (KeyError, AttributeError, IndexError):  # a module swapped for one of another kind
                args = None
            if args is not None and all(map(operator.is_, pick(args), tensors)):
                self.calls["direct"] += 1
                return fn(*args)[0]
        self._seen.clear()
        with torch.compiler.config.patch(dynamic_sources=DYNAMIC):
            out = self.dynamo(ids, ctx, last_only)
        self.calls["dynamo"] += 1
        if len(self._seen) == 1 and self._seen[0][2][0] is out:
            self._record(key, ids, ctx)
        self._seen.clear()
        return out

    def _record(self, key: tuple, ids: torch.Tensor, ctx) -> None:
        """Name every input of the graph just run; store a builder for its input list, or nothing."""
        fn, args, _ = self._seen[0]
        paths = {**_param_paths(self.model), **_step_paths(ids, ctx)}
        exprs, symbolic, static = [], False, []
        for a in args:
            if isinstance(a, torch.Tensor):
                if id(a) not in paths:
                    return
                exprs.append(paths[id(a)])
                if exprs[-1].startswith("m."):
                    static.append(len(exprs) - 1)
            elif isinstance(a, int) and (a == ctx.step.start) != (a == ctx.kvs[0].k.shape[2]):
                symbolic |= a == ctx.step.start  # the start slot, or the capacity once it has grown
                exprs.append("start" if a == ctx.step.start else "kvs[0].k.shape[2]")
            else:
                return  # a size or constant the builder could not tell apart: keep dynamo's guards
        if len(static) < 2:
            return  # (the identity check below wants a tuple from itemgetter)
        src = f"def build(m, ids, ctx, kvs, start):\n    return [{', '.join(exprs)}]\n"
        scope: dict = {}
        exec(compile(src, "<attnlab decode step inputs>", "exec"), scope)
        tensors = tuple(args[i] for i in static)
        self.recipes[key] = (fn, scope["build"], None if symbolic else ctx.step.start,
                             (operator.itemgetter(*static), tensors))
