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


# the column layouts by the table's names: a float matrix, an int8 / int4 one requantised along the outputs, and an
# int4 weight in its own groups of 32 inputs
SPARSE = {"float32": FLOAT32, "int8": KINDS["int8"].sparse, "int4": KINDS["int4"].sparse,
          "int4 own groups": KINDS["int4"].own_columns}


def operands(kind, wt):
    """wt [K, N] in the column format of `kind`, and the float matrix it stands for."""
    if kind == "float32":
        return (wt,), wt
    if kind == "int4 own groups":  # an int4 weight [N, K] in its own groups of 32 inputs, by columns
        from attnlab.kernels.reference import pack4, unpack4
        p = QuantSpec.parse("int4:32").quantize(wt.T.contiguous())
        return (pack4(unpack4(p.qs).T.contiguous()), p.scale.T.contiguous(), p.min.T.contiguous()), p.dequantize().T
    p = QuantSpec.parse(f"{kind}:32").quantize(wt)
    t = p.tensors()
    ops_ = tuple(t[n] for n in KINDS[kind].operands) + (32,)
    return ops_, p.dequantize()


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("kind", list(SPARSE))
@pytest.mark.parametrize("K,N", [(64, 96), (576, 1536), (37, 32)])
def test_cols_equal_dense_on_zeroed_inputs(kind, K, N, fallback):
    if kind == "int4 own groups" and K % 32:
        pytest.skip("int4 in its own groups keeps groups of 32 inputs")
    g = torch.Generator().manual_seed(K + N)
    wt = torch.randn(K, N, generator=g)
    args, w = operands(kind, wt)
    x = torch.randn(K, generator=g)
    for tau in (-1.0, 0.0, 0.3, 0.8, 1.5, 100.0):
        want = (x * (x.abs() > tau)) @ w
        if fallback:
            with ops.disabled():
                got = ops.cols_mv(SPARSE[kind], x, tau, args)
        else:
            got = ops.cols_mv(SPARSE[kind], x, tau, args)
        if kind == "int4 own groups" and not fallback:  # the dense int4 kernel on the zeroed input: the same rounding of x
            p = QuantSpec.parse("int4:32").quantize(wt.T.contiguous())
            xm = (x * (x.abs() > tau))[None].contiguous()
            torch.testing.assert_close(got, ops.q4_mm(xm, p.qs, p.scale, p.min, 32)[0], atol=1e-3, rtol=1e-4)
            assert (got - want).norm() <= 2e-2 * want.norm() + 1e-6  # the rounding of x, as dense
        elif kind == "int4" and not fallback:  # integer kernel: each 8 rows' coefficients rounded to int8 per block
            assert (got - want).norm() <= 2e-2 * want.norm() + 1e-6, (tau, (got - want).norm() / want.norm())
        else:
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)  # float sums of up to 576 products


def test_cols_threads_agree():
    g = torch.Generator().manual_seed(3)
    args, w = operands("int4", torch.randn(512, 1024, generator=g))
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
