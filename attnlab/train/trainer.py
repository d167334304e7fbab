"""Train the engine's `Transformer` on a corpus, from scratch or from a loaded pretrained
model (fine-tuning, e.g. context extension), with exact resume.

Determinism: the model is initialised from `seed`, and minibatch `s` is drawn from a
generator seeded with (seed, s) alone, so a run resumed at step s sees exactly the
batches a continuous run would (no data-loader state to save). The learning rate is a
pure function of the step. With the same thread count, a resumed run reproduces the
continuous one bit for bit.

Checkpoints (nothing is pickled):
    OUT/checkpoints/step-000500/model.safetensors      weights
    OUT/checkpoints/step-000500/optimizer.safetensors  AdamW moments and step counts
    OUT/checkpoints/step-000500/state.json             TrainConfig, model config, step, tokenizer
    OUT/latest.json                                    {"checkpoint": ..., "step": ...}
    OUT/metrics.jsonl                                  one JSON row per evaluation
A checkpoint folder is written under a temporary name and renamed into place, then
latest.json is replaced atomically: a crash leaves the previous checkpoint current.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from attnlab.errors import AttnlabError
from attnlab.io import write_json, write_text
from attnlab.train import ddp
from attnlab.model.llama import ModelConfig, Transformer
from attnlab.train.tokenizers import make_tokenizer, tokenizer_from_dict

SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class TrainConfig:
    corpus: str = "shakespeare:train"
    val_corpus: str = "shakespeare:validation"
    tokenizer: str = "word"            # word | char | smollm2 (see attnlab.train.tokenizers)
    vocab_size: int = 8000             # word tokenizer only
    dim: int = 200
    n_layers: int = 2
    n_heads: int = 1
    n_kv_heads: int = 0                # 0 = n_heads
    hidden_dim: int = 200
    context: int = 35                  # training sequence length (bptt)
    batch: int = 20
    steps: int = 1000
    lr: float = 1e-3
    schedule: str = "constant"         # constant | cosine | linear (decay to min_lr_ratio * lr)
    warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 0.5
    beta1: float = 0.9
    beta2: float = 0.999
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 10
    eval_at: list[int] = field(default_factory=list)  # extra evaluation steps (e.g. dense early on)
    ckpt_every: int = 500              # 0 = only at the end
    keep_checkpoints: int = 2
    lora_rank: int = 0  # fine-tuning a pretrained model: train rank-r adapters only (0 = every weight)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise AttnlabError(f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}")
        for name in ("dim", "n_layers", "n_heads", "hidden_dim", "context", "batch", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise AttnlabError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or self.warmup < 0 or self.lr <= 0:
            raise AttnlabError("steps and warmup must be >= 0 and lr > 0")

    def lr_at(self, step: int) -> float:
        """Learning rate of update number `step` (0-based)."""
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule == "constant" or self.steps <= self.warmup:
            return self.lr
        frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if self.schedule == "cosine" else 1 - frac
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * decay)

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads or self.n_heads, hidden_dim=self.hidden_dim,
                           rope_base=self.rope_base, rope_scaling=self.rope_scaling, context_length=self.context,
                           tie_embeddings=self.tie_embeddings, arch="llama")


def _seed_of(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 12_345) % (2 ** 63)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict without tied duplicates, contiguous (safetensors refuses shared storage)."""
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def _write_dir_atomic(final: Path, write: Callable[[Path], None]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint(path: str | Path):
    """A checkpoint folder (or a run folder: its latest) -> (model, tokenizer, state dict)."""
    path = Path(path)
    if (path / "latest.json").exists():
        path = path / json.loads((path / "latest.json").read_text())["checkpoint"]
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"no checkpoint in {path} (expected state.json or latest.json)")
    state = json.loads((path / "state.json").read_text())
    model = Transformer(ModelConfig(**state["model_config"]))
    if state["train_config"].get("lora_rank"):
        from attnlab.train.lora import add_lora
        add_lora(model, state["train_config"]["lora_rank"], seed=state["train_config"]["seed"])
    missing, unexpected = model.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    if unexpected or [m for m in missing if not (m == "lm_head.weight" and model.cfg.tie_embeddings)]:
        raise AttnlabError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    model.eval()
    return model, tokenizer_from_dict(state["tokenizer"]), state


class Trainer:
    """Causal-LM training of a `Transformer` on `cfg.corpus`, evaluated on `cfg.val_corpus`.

    probe(model, val_batches) -> dict, if given, is called at every evaluation (step 0,
    every eval_every steps and at the end) and its numbers are logged with the losses.
    model: a pretrained `Transformer` to fine-tune instead of a fresh one from cfg's sizes
    (loaded weights come frozen for inference: they are unfrozen here); on resume the
    checkpoint's weights replace it.
    """

    def __init__(self, cfg: TrainConfig, out: str | Path, probe: Callable | None = None,
                 resume: bool = False, tokenizer=None, model: Transformer | None = None):
        from attnlab.data import corpus

        self.cfg, self.out, self.probe = cfg, Path(out), probe
        latest = self.out / "latest.json"
        state = None
        if resume and latest.exists():
            model, tok, state = load_checkpoint(self.out)
            saved = TrainConfig(**state["train_config"])
            if dataclasses.replace(saved, steps=cfg.steps) != cfg:
                diff = [f.name for f in dataclasses.fields(cfg)
                        if f.name != "steps" and getattr(saved, f.name) != getattr(cfg, f.name)]
                raise AttnlabError(f"--resume with a different configuration ({', '.join(diff)}); "
                                 "only --steps may change")
            self.tokenizer, self.model = tok, model
        elif latest.exists() and not resume:
            raise AttnlabError(f"{self.out} already holds a run; pass --resume or choose another --out")
        elif model is not None:
            if tokenizer is None:
                raise AttnlabError("fine-tuning a pretrained model needs its tokenizer")
            if tokenizer.vocab_size > model.cfg.vocab_size:
                raise AttnlabError(f"tokenizer has {tokenizer.vocab_size} ids, the model {model.cfg.vocab_size}")
            self.tokenizer, self.model = tokenizer, model.float().requires_grad_(True)
            if cfg.lora_rank:
                from attnlab.train.lora import add_lora
                add_lora(self.model, cfg.lora_rank, seed=cfg.seed)
        else:
            self.tokenizer = tokenizer or make_tokenizer(cfg.tokenizer, corpus(cfg.corpus), cfg.vocab_size)
            with torch.random.fork_rng():
                torch.manual_seed(cfg.seed)
                self.model = Transformer(cfg.model_config(self.tokenizer.vocab_size))
        self.train_ids = torch.tensor(self.tokenizer.encode(corpus(cfg.corpus)), dtype=torch.long)
        self.val_ids = torch.tensor(self.tokenizer.encode(corpus(cfg.val_corpus)), dtype=torch.long)
        need = cfg.context + 2
        if self.train_ids.numel() < need or self.val_ids.numel() < cfg.context + 1:
            raise AttnlabError(f"corpus too short for context {cfg.context}")
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     weight_decay=cfg.weight_decay)
        self.step = 0
        if state is not None:
            self.step = state["step"]
            self._load_optimizer(self.out / json.loads(latest.read_text())["checkpoint"] / "optimizer.safetensors")
        # under torchrun: each rank trains on its slice of the global batch, gradients averaged (ddp.py)
        self.world, self.rank, self.main = ddp.world_size(), ddp.rank(), ddp.is_main()
        self.net = self.model
        if self.world > 1:
            if cfg.batch % self.world:
                raise AttnlabError(f"batch {cfg.batch} does not split over {self.world} processes")
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
        if self.main:
            self._trim_log()
        ddp.barrier()

    # ---------------------------------------------------------------- data

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Minibatch `step`: inputs and targets [batch, context], a function of (seed, step) only."""
        g = torch.Generator().manual_seed(_seed_of(self.cfg.seed, step))
        n = self.train_ids.numel() - self.cfg.context - 1
        starts = torch.randint(0, n + 1, (self.cfg.batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.cfg.context + 1)
        seq = self.train_ids[idx]
        return seq[:, :-1], seq[:, 1:]

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first eval_batches x batch consecutive validation sequences (the same every time)."""
        c, b = self.cfg.context, self.cfg.batch
        n_seq = min(self.cfg.eval_batches * b, (self.val_ids.numel() - 1) // c)
        x = self.val_ids[:n_seq * c].view(n_seq, c)
        y = self.val_ids[1:n_seq * c + 1].view(n_seq, c)
        return [(x[i:i + b], y[i:i + b]) for i in range(0, n_seq, b)]

    # ---------------------------------------------------------------- loop

    def loss(self, x: torch.Tensor, y: torch.Tensor, net=None) -> torch.Tensor:
        logits = (net or self.model)(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        vb = self.val_batches()
        losses = [float(self.loss(x, y)) for x, y in vb]
        row = {"step": self.step, "val_loss": sum(losses) / len(losses)}
        if self.probe is not None:
            row.update(self.probe(self.model, vb))
        self.model.train()
        return row

    def run(self, progress=None) -> list[dict]:
        """Train up to cfg.steps; returns the evaluation rows written during this call.

        progress: None or a tqdm-like object with update(n) / set_postfix(dict)."""
        cfg, rows = self.cfg, []
        self.model.train()
        if self.main and self.step == 0 and not (self.out / "metrics.jsonl").exists():
            rows.append(self._log(self.evaluate()))
        train_loss, n_loss, t0 = 0.0, 0, time.perf_counter()
        while self.step < cfg.steps:
            for group in self.opt.param_groups:
                group["lr"] = cfg.lr_at(self.step)
            x, y = self.batch(self.step)
            if self.world > 1:
                x, y = ddp.shard(x, self.world, self.rank), ddp.shard(y, self.world, self.rank)
            loss = self.loss(x, y, self.net)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
            self.opt.step()
            self.step += 1
            train_loss, n_loss = train_loss + ddp.mean_across(loss.item()), n_loss + 1
            if progress is not None:
                progress.update(1)
            last = self.step == cfg.steps
            if self.main and (self.step % cfg.eval_every == 0 or self.step in cfg.eval_at or last):
                row = self.evaluate()
                row.update(train_loss=train_loss / n_loss, lr=cfg.lr_at(self.step - 1),
                           seconds=round(time.perf_counter() - t0, 2))
                train_loss, n_loss = 0.0, 0
                rows.append(self._log(row))
                if progress is not None and hasattr(progress, "set_postfix"):
                    progress.set_postfix(loss=f"{row['train_loss']:.3f}", val=f"{row['val_loss']:.3f}")
            if (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or last:
                if self.main:
                    self.save()
                ddp.barrier()  # every rank resumes from the same checkpoint
        return rows

    # ---------------------------------------------------------------- files

    def _log(self, row: dict) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def _trim_log(self) -> None:
        """On resume, forget evaluations logged after the checkpoint (they will be redone)."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = [r for r in rows if r["step"] <= self.step] if self.step else []
        write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
        if not keep:
            path.unlink()

    def log_rows(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for p, st in self.opt.state.items():
            for key, value in st.items():
                out[f"{names[id(p)]}::{key}"] = torch.as_tensor(value).detach().contiguous().clone()
        return out

    def _load_optimizer(self, path: Path) -> None:
        tensors = load_file(path)
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            name, slot = key.split("::")
            self.opt.state[params[name]][slot] = value

    def save(self) -> Path:
        name = f"checkpoints/step-{self.step:07d}"
        state = {"step": self.step, "train_config": dataclasses.asdict(self.cfg),
                 "model_config": dataclasses.asdict(self.model.cfg), "tokenizer": self.tokenizer.to_dict(),
                 "format": "attnlab-train-1"}

        def write(tmp: Path):
            save_file(_weights(self.model), tmp / "model.safetensors")
            save_file(self._optimizer_tensors(), tmp / "optimizer.safetensors")
            (tmp / "state.json").write_text(json.dumps(state) + "\n")

        _write_dir_atomic(self.out / name, write)
        write_json(self.out / "latest.json", {"checkpoint": name, "step": self.step})
        ckpts = sorted((self.out / "checkpoints").glob("step-*"))
        for old in ckpts[:-self.cfg.keep_checkpoints] if self.cfg.keep_checkpoints > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return self.out / name
