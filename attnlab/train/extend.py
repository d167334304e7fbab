"""Context extension by fine-tuning (Position Interpolation, Chen et al. 2023): give a
pretrained RoPE model a scaled rotation (PI, NTK or YaRN, or none as the control), then
train it briefly on sequences of the new length with the ordinary `Trainer`.

The run folder is itself a checkpoint `attnlab.load` reads:
    OUT/config.json, OUT/model.safetensors, tokenizer files   the extended model
    OUT/train/                                               trainer checkpoints (resume)
config.json carries the scaling (rope_scaling with original_max_position_embeddings) and
max_position_embeddings = factor x the original context.
"""
from __future__ import annotations

from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.rope import Rope, parse_rope

METHODS = {"pi": "linear", "ntk": "ntk", "yarn": "yarn", "none": "none"}


def extension_scaling(method: str, factor: float, original: int) -> dict | None:
    """The rope_scaling a method applies for `factor` over a model trained at `original` positions."""
    if method not in METHODS:
        raise AttnlabError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if not factor >= 1:
        raise AttnlabError(f"factor must be >= 1, got {factor}")
    return parse_rope("none" if method == "none" else f"{METHODS[method]}:{factor}", original)


def apply_scaling(model, scaling: dict | None, context: int) -> None:
    """Switch a loaded network to `scaling` (its rotary tables rebuilt) and a new nominal context."""
    model.cfg.rope_scaling, model.cfg.context_length = scaling, int(context)
    model.rope = Rope(model.cfg.head_dim, model.cfg.rope_base, scaling)


def extend(model_spec: str, out: str | Path, factor: float, method: str = "pi", steps: int = 50,
           context: int = 2048, text: str = "shakespeare:train", batch: int = 1, lr: float = 2e-5,
           warmup: int = 5, seed: int = 0, resume: bool = False, progress=None, eval_batches: int = 2,
           lora: int = 0):
    """Fine-tune model_spec with `method` scaling by `factor` on `context`-token sequences of `text`
    (lora > 0: rank-`lora` adapters only, merged into the weights at the end);
    returns (LM of the extended model, trainer evaluation rows)."""
    from attnlab.engine import LM
    from attnlab.model.export import save_hf_folder
    from attnlab.model.loaders import _trained_length
    from attnlab.train.tokenizers import PretrainedTokenizer
    from attnlab.train.trainer import TrainConfig, Trainer

    out = Path(out)
    lm = LM.load(model_spec, dtype="float32")  # fine-tuning needs float weights, not the file's packed ones
    if lm.tokenizer is None:
        raise AttnlabError(f"{model_spec} has no tokenizer to read the training text with")
    original = _trained_length(lm.cfg)
    scaling = extension_scaling(method, factor, original)
    apply_scaling(lm.model, scaling, round(original * factor))
    cfg = TrainConfig(corpus=text, tokenizer="pretrained", context=context, batch=batch, steps=steps, lr=lr,
                      warmup=warmup, schedule="constant", weight_decay=0.0, clip=1.0, rope_scaling=scaling,
                      seed=seed, eval_every=25, eval_batches=eval_batches, ckpt_every=10,
                      keep_checkpoints=1, lora_rank=lora)
    tok = PretrainedTokenizer(str(model_spec), tok=lm.tokenizer)
    trainer = Trainer(cfg, out / "train", resume=resume, tokenizer=tok, model=lm.model)
    rows = trainer.run(progress=progress if trainer.main else None)
    model = trainer.model.eval().requires_grad_(False)
    if not trainer.main:  # under torchrun: rank 0 writes the extended model
        return LM(model, lm.tokenizer, out), rows
    if lora:
        from attnlab.train.lora import merge_lora
        merge_lora(model)
    save_hf_folder(model, out, tokenizer=lm.tokenizer)
    return LM(model, lm.tokenizer, out), rows
