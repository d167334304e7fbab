"""Trainer: loss goes down, checkpoints reload exactly, resumed runs continue bit for bit."""
import json

import pytest
import torch

from attnlab.train import TrainConfig, Trainer, load_checkpoint


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    from attnlab.data import corpus
    d = tmp_path_factory.mktemp("text")
    (d / "train.txt").write_text(corpus("shakespeare:hamlet")[:60000])
    (d / "val.txt").write_text(corpus("shakespeare:macbeth")[:8000])
    return str(d / "train.txt"), str(d / "val.txt")


def cfg(texts, **kw):
    base = dict(corpus=texts[0], val_corpus=texts[1], vocab_size=300, dim=32, hidden_dim=32, n_layers=2, n_heads=2,
                context=16, batch=8, steps=6, lr=3e-3, eval_every=3, eval_batches=2, ckpt_every=3)
    base.update(kw)
    return TrainConfig(**base)


def test_loss_drops_and_checkpoint_reloads_identically(texts, tmp_path):
    tr = Trainer(cfg(texts, steps=30, eval_every=15, ckpt_every=0), tmp_path)
    rows = tr.run()
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 30
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.5
    model, tok, state = load_checkpoint(tmp_path)
    assert state["step"] == 30 and tok.vocab == tr.tokenizer.vocab
    x, _ = tr.batch(123)
    with torch.no_grad():
        assert torch.equal(model(x), tr.model.eval()(x))
    assert not list(tmp_path.rglob("*.tmp"))
    assert (tmp_path / "checkpoints/step-0000030/optimizer.safetensors").stat().st_size > 1000


def test_resume_continues_exactly(texts, tmp_path):
    full = Trainer(cfg(texts), tmp_path / "full")
    full.run()
    part = Trainer(cfg(texts, steps=3), tmp_path / "part")
    part.run()
    resumed = Trainer(cfg(texts), tmp_path / "part", resume=True)
    assert resumed.step == 3
    resumed.run()
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(full.log_rows()) == strip(resumed.log_rows())
    assert [r["step"] for r in resumed.log_rows()] == [0, 3, 6]


def test_resume_rejects_changed_config_and_fresh_run_refuses_old_folder(texts, tmp_path):
    Trainer(cfg(texts, steps=3), tmp_path).run()
    with pytest.raises(ValueError, match="lr"):
        Trainer(cfg(texts, lr=1e-4), tmp_path, resume=True)
    with pytest.raises(ValueError, match="resume"):
        Trainer(cfg(texts), tmp_path)


def test_lr_schedules():
    c = TrainConfig(steps=110, warmup=10, lr=1.0, schedule="cosine", min_lr_ratio=0.1)
    assert c.lr_at(0) == pytest.approx(0.1) and c.lr_at(9) == pytest.approx(1.0)
    assert c.lr_at(10) == pytest.approx(1.0) and c.lr_at(110) == pytest.approx(0.1)
    assert TrainConfig(steps=100, schedule="linear", lr=1.0, min_lr_ratio=0.0).lr_at(50) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        TrainConfig(schedule="exp")


def test_tied_embeddings_and_rope_options_round_trip(texts, tmp_path):
    tr = Trainer(cfg(texts, steps=2, tie_embeddings=True, rope_base=500.0,
                     rope_scaling={"rope_type": "linear", "factor": 2.0}, tokenizer="char"), tmp_path)
    tr.run()
    model, tok, _ = load_checkpoint(tmp_path)
    assert model.lm_head.weight is model.embed.weight and tok.kind == "char"
    x, _ = tr.batch(0)
    with torch.no_grad():
        assert torch.equal(model(x), tr.model.eval()(x))


def test_train_cli(texts, tmp_path, capsys):
    from attnlab.cli import main
    args = ["train", "--corpus", texts[0], "--val-corpus", texts[1], "--vocab-size", "200", "--dim", "16",
            "--hidden", "16", "--layers", "1", "--context", "12", "--batch", "4", "--eval-every", "2",
            "--eval-batches", "1", "--out", str(tmp_path), "--threads", "1"]
    assert main(args + ["--steps", "2"]) == 0
    assert main(args + ["--steps", "2"]) == 2  # folder holds a run: needs --resume
    assert main(["train", "--out", str(tmp_path), "--steps", "4", "--resume", "--threads", "1"]) == 0
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 4
    assert main(["train", "--out", str(tmp_path), "--steps", "5", "--lr", "0.5", "--resume"]) == 2
    assert "only --steps" in capsys.readouterr().err
