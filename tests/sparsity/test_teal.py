"""TEAL: the column-sparse op against dense products, the plan against dense logits, the calibration's reach."""
import contextlib

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.quant import QuantSpec
from attnlab.quant.kinds import FLOAT32, KINDS
from attnlab.sparsity.plan import make_plan, parse, plan_from_spec
from attnlab.sparsity.teal import PROJ, Calibration, calibrate, measure
from tests.conftest import tiny_lm


def decode(lm, ids):
    cache = lm.new_cache(capacity=len(ids))
    return torch.cat([lm.forward(ids[t:t + 1][None], cache)[0] for t in range(len(ids))])


# the column layouts by the table's names: a float matrix, an int8 / int4 one requantised along the outputs, and int4 /
# int8 weights in their own groups of inputs, by input channel (`columns`)
SPARSE = {"float32": FLOAT32, "int8": KINDS["int8"].sparse, "int4": KINDS["int4"].sparse,
          "int4 own": KINDS["int4"].own_columns, "int8 own": KINDS["int8"].own_columns, "int8 own:16": KINDS["int8"].own_columns}


def operands(kind, wt):
    """wt [K, N] in the column format of `kind`, the float matrix it stands for, and (own groups) the dense integer
    kernel's product of a zeroed input, which the op must equal up to summation order."""
    if kind == "float32":
        return (wt,), wt, None
    if kind.endswith(("own", "own:16")):
        from attnlab.quant import formats
        from attnlab.sparsity.columns import _own
        w = wt.T.contiguous()
        p = formats.quantize_int4(w, 32) if kind == "int4 own" else formats.quantize_int8(w, 16 if "16" in kind else 32)
        piece = _own(p, 0)
        dense = (lambda xm: ops.q4_mm(xm, p.qs, p.scale, p.min, 32)) if kind == "int4 own" else \
            (lambda xm: ops.q8_mm(xm, p.q, p.scale, p.group)) if p.group % 32 == 0 else None  # q8_mm: groups of 32
        return piece.operands, p.dequantize().T, dense
    p = QuantSpec.parse(f"{kind}:32").quantize(wt)
    t = p.tensors()
    ops_ = tuple(t[n] for n in KINDS[kind].operands) + (32,)
    return ops_, p.dequantize(), None


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("kind", list(SPARSE))
@pytest.mark.parametrize("K,N", [(64, 128), (576, 960), (96, 64)])
def test_cols_equal_dense_on_zeroed_inputs(kind, K, N, fallback):
    g = torch.Generator().manual_seed(K + N)
    wt = torch.randn(K, N, generator=g)
    args, w, dense = operands(kind, wt)
    x = torch.randn(K, generator=g)
    for tau in (-1.0, 0.0, 0.3, 0.8, 1.5, 100.0):
        want = (x * (x.abs() > tau)) @ w
        with ops.disabled() if fallback else contextlib.nullcontext():
            got = ops.cols_mv(SPARSE[kind], x, tau, args)
        if dense is not None and ops.enabled() and not fallback:  # the dense integer kernel's rounding of x
            xm = (x * (x.abs() > tau))[None].contiguous()
            torch.testing.assert_close(got, dense(xm)[0], atol=1e-3, rtol=1e-4)
            assert (got - want).norm() <= 2e-2 * want.norm() + 1e-6
        elif kind in ("int4", "int8 own:16") and not fallback:  # integer kernel: each 8 rows' coefficients rounded to int8 per block
            assert (got - want).norm() <= 2e-2 * want.norm() + 1e-6, (tau, (got - want).norm() / want.norm())
        else:
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)  # float sums of up to 576 products


@pytest.mark.parametrize("kind", ["float32", "int4 own", "int8 own", "int8 own:16"])
def test_skipped_channels_are_never_read(kind):
    """A channel under the threshold is not read: NaN (float) or random bytes (codes) in its row change nothing."""
    g = torch.Generator().manual_seed(7)
    args, _, _ = operands(kind, torch.randn(256, 960, generator=g))
    x = torch.randn(256, generator=g)
    tau = float(x.abs().quantile(0.5))
    clean = ops.cols_mv(SPARSE[kind], x, tau, args)
    skipped = (x.abs() <= tau).nonzero().flatten()
    rows = args[0].clone()
    if kind == "float32":
        rows[skipped] = float("nan")
    else:
        rows[skipped] = torch.randint(0, 256, (len(skipped), rows.shape[1]), generator=g, dtype=torch.uint8)
    assert torch.equal(ops.cols_mv(SPARSE[kind], x, tau, (rows, *args[1:])), clean)


def test_cols_threads_agree():
    g = torch.Generator().manual_seed(3)
    args, w, _ = operands("int4", torch.randn(512, 1024, generator=g))
    x = torch.randn(512, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.cols_mv(SPARSE["int4"], x, 0.5, args)
        torch.set_num_threads(2)
        two = ops.cols_mv(SPARSE["int4"], x, 0.5, args)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)
    want = (x * (x.abs() > 0.5)) @ w
    assert (one - want).norm() <= 1e-2 * want.norm()


@pytest.fixture(scope="module")
def tiny_teal():
    lm = tiny_lm(seed=2)
    ids = torch.randint(0, 97, (900,), generator=torch.Generator().manual_seed(0))
    return lm, calibrate(lm, ids[:600], greedy_tokens=64, max_sparsity=0.75, step=0.1, window=200), ids[600:]


IDS = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(5))


def close(got, want, quant):
    torch.testing.assert_close(got, want, atol=1e-4 if quant is None else 1e-3, rtol=1e-3)


def exact(quant):
    """Quantized models run on the float fallbacks here: the integer kernels round activations to int8 per 32
    values, a discontinuity that a random tiny network amplifies from 1e-6 summation differences; the column
    ops are checked against the dense integer kernels on the same zeroed inputs above."""
    return ops.disabled() if quant else contextlib.nullcontext()


@torch.inference_mode()
@pytest.mark.parametrize("quant", [None, "int8:32", "int4:32"])
def test_zero_thresholds_equal_dense(tiny_teal, quant):
    """Sparsity 0 keeps every channel: the sparse decode path gives the dense logits (fp32: the model's own;
    quantized: those of the transposed copies, through the masked path)."""
    lm, calib, _ = tiny_teal
    if quant:
        from attnlab.quant import quantize_model
        lm = tiny_lm(seed=2)
        quantize_model(lm.model, quant)
    with exact(quant):
        plan = make_plan("teal", 0.0, 0.0, calib).bind(lm.model)
        assert all(t < 0 for row in plan.taus for t in row)
        sp = lm.with_sparsity(plan)
        got = decode(sp, IDS)
        if quant != "int8:32":  # fp32 and int4 (its own codes, by columns) are the dense model itself
            close(got, decode(lm, IDS), quant)
        plan.sparse_exec = False  # the masked path (int8: on the transposed copies' float values)
        close(got, decode(sp, IDS), quant)


@torch.inference_mode()
@pytest.mark.parametrize("quant", [None, "int8:32", "int4:32"])
def test_sparse_decode_equals_masked(tiny_teal, quant):
    """At 50% the fused column-sparse step computes what the masked (evaluation) path computes."""
    lm, calib, _ = tiny_teal
    if quant:
        from attnlab.quant import quantize_model
        lm = tiny_lm(seed=2)
        quantize_model(lm.model, quant)
    with exact(quant):
        plan = make_plan("teal", 0.5, 0.0, calib).bind(lm.model)
        sp = lm.with_sparsity(plan)
        got = decode(sp, IDS)
        plan.sparse_exec = False
        masked = decode(sp, IDS)
        close(got, masked, quant)
    if quant is None:  # and chunked (prefill-sparse, evaluation) computes the same
        plan.prefill_sparse = True
        torch.testing.assert_close(got, sp.logits(IDS[None])[0], atol=2e-3, rtol=2e-3)
    with exact(quant):
        dense = decode(lm, IDS)  # and it is not the dense model: much nearer the masked path than to dense
    assert (got - masked).norm() < 0.25 * (got - dense).norm()


def test_calibration_hits_target_on_heldout(tiny_teal, tmp_path):
    lm, calib, held = tiny_teal
    for s in (0.3, 0.5, 0.7):
        plan = make_plan("teal", s, 0.0, calib).bind(lm.model)
        plan.prefill_sparse = True
        got = measure(lm, plan, held, window=150)["model_wide"]
        assert abs(got - s) < 0.05, (s, got)
    # the greedy allocation is not uniform, and it is saved and loaded exactly (atomically, by path)
    a = calib.allocation(1, 0.5)
    assert len(a) == len(PROJ) and max(a) - min(a) > 0.05
    calib.save(tmp_path / "teal.safetensors")
    back = Calibration.load(tmp_path)
    assert back.thresholds(1, 0.4) == calib.thresholds(1, 0.4)
    plan = plan_from_spec(f"teal@{tmp_path}:0.4", lm.model)
    assert plan.taus == [calib.thresholds(i, 0.4) for i in range(lm.cfg.n_layers)]


def test_spec_and_errors(tiny_teal, tmp_path):
    assert parse("teal:0.4") == ("teal", None, 0.4, 0.0)
    assert parse("teal@runs/x:0.3")[:3] == ("teal", "runs/x", 0.3)
    with pytest.raises(AttnlabError, match="one sparsity"):
        parse("teal:0.4:0.2")
    with pytest.raises(AttnlabError, match="no TEAL calibration"):
        plan_from_spec(f"teal@{tmp_path}:0.4", None)
    lm, calib, _ = tiny_teal
    with pytest.raises(AttnlabError, match="reaches"):
        make_plan("teal", 0.95, 0.0, calib).bind(lm.model)


def test_spec_reads_the_cache_the_explicit_step_made(tmp_path, monkeypatch):
    """`teal:S` without a path never calibrates inside a load: it reads what `make_cached` (the explicit step,
    also behind `attnlab dejavu calibrate`) cached, and says how to make it when missing."""
    from attnlab.sparsity import teal

    class Tok:  # characters as token ids: enough text for a tiny model
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 97 for c in text[:3000]]
    monkeypatch.setattr(teal, "CACHE", tmp_path)
    lm = tiny_lm(seed=4)
    with pytest.raises(AttnlabError, match="no cached TEAL calibration.*dejavu calibrate"):
        plan_from_spec("teal:0.3", lm.model)
    assert not list(tmp_path.glob("*"))
    teal.make_cached(lm.model, Tok())
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and files[0].stem == teal.fingerprint(lm.model)
    plan = plan_from_spec("teal:0.3", lm.model)
    assert min(min(t) for t in plan.taus) > 0


@torch.inference_mode()
@pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")
@pytest.mark.parametrize("quant,threads", [(None, 1), ("int4:32", 1), ("int8:32", 1), ("int4:32", 2), ("int8:32", 2)])
def test_the_native_step_runs_teal(tiny_teal, quant, threads):
    """The native step runs TEAL's projections by input channel (`columns`, one copy each). Below-zero thresholds
    give the dense step: float weights to rounding; int4/int8 up to the order of the dense integer kernels' sums (each
    op equal to ~1e-7, checked above), which the network's int8 activation codes amplify. At 50% it computes what the
    eager column path computes."""
    _, calib, _ = tiny_teal
    lm = tiny_lm(seed=2)
    if quant:
        from attnlab.quant import quantize_model
        quantize_model(lm.model, quant)
    lm.compile_decode()
    lm = lm.with_threads(threads)  # a team: each piece cut into one slice of outputs per thread (`_cuts`)
    dense, ids = lm.new_cache(capacity=64), IDS[None]
    lm.prefill(ids[:, :8], dense)
    dense_logits = torch.cat([lm.forward(ids[:, t:t + 1], dense) for t in range(8, 16)], 1)
    for s in (0.0, 0.5):
        plan = make_plan("teal", s, 0.0, calib).bind(lm.model)
        sp = lm.with_sparsity(plan)
        assert sp.compiled is not None and sp.compiled.sparsity is plan
        eager = lm.with_sparsity(plan)
        eager.compiled = None
        got, want = [], []
        for run, out in ((sp, got), (eager, want)):
            cache = run.new_cache(capacity=64)
            run.prefill(ids[:, :8], cache)
            out += [run.forward(ids[:, t:t + 1], cache) for t in range(8, 16)]
        got, want = torch.cat(got, 1), torch.cat(want, 1)
        assert sp.compiled.calls["native"] >= 8
        ref = dense_logits if s == 0 else want
        rel = float((got - ref).norm() / ref.norm())
        if quant is None:
            assert rel < 1e-5, (s, rel)
        else:
            assert rel < 0.05 and (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9, (s, rel)
    assert (got - dense_logits).norm() > 10 * (got - want).norm()  # 50% is not the dense model
