"""A small, general trainer for causal LMs from scratch on a text corpus.

`Trainer(TrainConfig, out)` trains the engine's own `Transformer` (any size, context
length, RoPE base/scaling, learning-rate schedule), writes safetensors checkpoints
atomically and resumes exactly; `load_checkpoint` gives back the model and tokenizer.
"""
from attnlab.train.tokenizers import make_tokenizer, tokenizer_from_dict  # noqa: F401
from attnlab.train.trainer import TrainConfig, Trainer, load_checkpoint  # noqa: F401
