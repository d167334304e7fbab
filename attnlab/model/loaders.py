"""Checkpoint loaders: GGUF files, Hugging Face folders and the embedded default.

Both formats are read into Hugging Face tensor names and layout first, so the
network is built one way whatever the source. The ModelConfig comes from the
format's builder in `metadata.py`, the one `attnlab info` uses, before any tensor data
is read. Nothing is unpickled: folders must hold safetensors; GGUF tensors are
dequantised with the `gguf` package.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from attnlab.model import metadata, validate
from attnlab.model.files import ModelLoadError, resolve  # noqa: F401  (part of the loaders' API)
from attnlab.model.llama import ModelConfig, Transformer
from attnlab.rope import interleave_rows, parse_rope


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (its RoPE rotates adjacent pairs, HF rotates halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(tuple(w.shape))


def read_gguf(path: Path, packed_types: tuple[str, ...] | None = None, hf_layout: bool = True, lazy: bool = False):
    """-> (ModelConfig, {hf_name: float32 tensor or Packed}) from a GGUF file, every tensor checked
    (`validate.check_weights`) as it is read.

    Tensors of packed_types (default: every type `kinds.GGUF_PACKED` holds exactly; () dequantises all)
    stay quantized as `attnlab.quant.Packed`, on the file's own grid. Each tensor is read by itself from
    the file straight into its packed layout: no map of the whole file stays resident, no float copy.
    hf_layout=False leaves a llama file's q/k rows in llama.cpp's order, which is the network's (`build`'s
    qk_interleaved): two row permutations of every q/k matrix saved. lazy: a mapping that reads each
    tensor when it is taken, so `build` holds the model plus one layer, never the model twice.
    """
    head = validate.scan_gguf(path)  # before anything is built from what the header claims
    cfg = metadata.gguf_config(path, head)
    if head.order != "<":
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    tensors = GGUFTensors(path, head, cfg, packed_types, hf_layout)
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight")
    return cfg, tensors if lazy else dict(tensors)


class GGUFTensors(MutableMapping):
    """Hugging Face name -> a GGUF file's tensor, read from the file (and checked) on access."""

    def __init__(self, path: Path, head, cfg: ModelConfig, packed_types, hf_layout: bool):
        from attnlab.quant import kinds
        self.path, self.head, self.cfg, self.hf_layout = path, head, cfg, hf_layout
        self.packed_types = kinds.GGUF_PACKED if packed_types is None else packed_types
        # rope_freqs (already in cfg) and tensors the network does not use have no name here
        self.names = {hf: name for name in head.tensors if (hf := validate.hf_name(name)) is not None}

    def __getitem__(self, hf: str):
        from attnlab.model.gguf_header import ggml_type
        from attnlab.quant import formats
        name = self.names[hf]
        info = self.head.tensors[name]
        kind = ggml_type(info.ggml_type)[0]
        try:
            raw = torch.empty(info.nbytes, dtype=torch.uint8)
            with open(self.path, "rb") as f:
                f.seek(self.head.data_offset + info.offset)
                if f.readinto(raw.numpy()) != info.nbytes:
                    raise EOFError("the file ended inside the tensor")
            data = _tensor(raw, kind, info.shape, self.packed_types)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} of {self.path}: {type(e).__name__}: {e}") from None
        block = name.split(".")[2] if name.startswith("blk.") else None
        if self.hf_layout and self.cfg.arch == "llama" and block in ("attn_q", "attn_k"):
            heads = self.cfg.n_heads if block == "attn_q" else self.cfg.n_kv_heads
            data = data.map_rows(lambda a: _unpermute(a, heads)) if isinstance(data, formats.Packed) \
                else _unpermute(data, heads)
        validate.check_weights(self.path, {hf: data})
        return data

    def __setitem__(self, hf: str, value) -> None:
        raise TypeError("GGUFTensors is read-only")

    def __delitem__(self, hf: str) -> None:
        del self.names[hf]

    def __contains__(self, hf) -> bool:  # Mapping's would read the tensor
        return hf in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _tensor(raw: torch.Tensor, kind: str, shape: tuple[int, ...], packed_types):
    """One GGUF tensor's bytes -> Packed (a packed type, a matrix) or a float32 tensor of `shape`."""
    from attnlab.quant import formats
    from attnlab.quant.kinds import GGUF

    if kind in packed_types and len(shape) == 2:
        return formats.from_gguf(raw, kind, shape)
    dtype = GGUF[kind].dtype if kind in GGUF else None  # a float type's
    if dtype is not None:
        return raw.view(dtype).reshape(shape).float()
    import gguf
    data = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])  # other block types, as floats
    return torch.from_numpy(np.asarray(data, dtype=np.float32).reshape(shape))


def read_hf_folder(path: Path):
    """-> (ModelConfig, {hf_name: tensor}) from config.json + *.safetensors (sharded or not)."""
    from safetensors.torch import load_file

    cfg = metadata.hf_config(path, metadata.read_json(path))  # types, ranges and tensor shapes before any data is read
    tensors = {}
    for f in metadata.hf_files(path):
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    return cfg, tensors


# ---------------------------------------------------------------- assembly

def build(cfg: ModelConfig, tensors: dict, dtype: torch.dtype | None = torch.float32, quant=None,
          qk_interleaved: bool = False) -> Transformer:
    """Create the network and move Hugging Face-named tensors into its fused layout (consuming `tensors`:
    each entry leaves the dict as it is placed, so no matrix is held twice).

    Matrices that arrive quantized (`Packed`, from GGUF blocks) are permuted and concatenated as codes,
    never expanded to float. dtype None (with no quant) keeps them in their own formats (the file's: a
    fused q/k/v or gate/up whose blocks differ is a QuantLinear of parts, each in its own format); a dtype
    expands them to it; quant (a QuantSpec or its text) makes every linear layer that format.
    qk_interleaved: q/k rows already pair adjacent dimensions as the network rotates them (a llama GGUF).
    """
    from attnlab.quant import Packed, quantize_model
    from attnlab.quant.formats import cat_rows

    native = dtype is None and quant is None
    dtype = dtype or torch.float32

    def rows(fn, t):
        if qk_interleaved:
            return t
        return t.map_rows(fn) if isinstance(t, Packed) else fn(t)

    def cat(parts):
        if all(isinstance(t, Packed) for t in parts):  # formats that differ stay apart natively (no promotion)
            return parts if native and len({p.format for p in parts}) > 1 else cat_rows(parts)
        return torch.cat([t.dequantize() if isinstance(t, Packed) else t for t in parts])

    def take(name):
        return tensors.pop(name)

    def qkv(p, kind):  # the network rotates adjacent pairs; no part outlives the concatenation
        return cat([rows(lambda w: interleave_rows(w, cfg.n_heads), take(p + f"self_attn.q_proj.{kind}")),
                    rows(lambda w: interleave_rows(w, cfg.n_kv_heads), take(p + f"self_attn.k_proj.{kind}")),
                    take(p + f"self_attn.v_proj.{kind}")])

    with torch.device("meta"), _skip_init():
        model = Transformer(cfg)
    state, layers = {}, {}  # layers: name -> QuantLinear, built as each matrix is assembled (native only)

    def place(name, t, bias=None):
        """Put a matrix where the network takes it: native packed ones become their QuantLinear at once, so
        the row layout (and its repacking transient) is dropped per matrix, never held for the whole model;
        under a dtype each matrix is expanded as it comes."""
        if native and isinstance(t, (Packed, list)):  # a list: row blocks of different formats
            layers[name] = _quant_linear(t, bias)
        elif quant is None and not native:  # --dtype: expanded now, so the model is never held twice
            state[name + ".weight"] = (t.dequantize() if isinstance(t, Packed) else t).to(dtype)
            if bias is not None:
                state[name + ".bias"] = bias.to(dtype)
        else:
            state[name + ".weight"] = t
            if bias is not None:
                state[name + ".bias"] = bias

    state["embed.weight"], state["norm.weight"] = take("model.embed_tokens.weight"), take("model.norm.weight")
    if cfg.tie_embeddings and (quant is not None or (native and isinstance(state["embed.weight"], Packed))):
        place("lm_head", state.pop("embed.weight"))  # the head is the embedding, read back by lookups
    if isinstance(state.get("embed.weight"), Packed):  # an untied embedding is looked up, not multiplied
        state["embed.weight"] = state["embed.weight"].dequantize()
    if not cfg.tie_embeddings:
        place("lm_head", take("lm_head.weight"))
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        try:
            bias = qkv(p, "bias") if cfg.qkv_bias else None
            place(a + "attn.wqkv", qkv(p, "weight"), bias)
            place(a + "attn.wo", take(p + "self_attn.o_proj.weight"))
            place(a + "mlp.w13", cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            place(a + "mlp.w2", take(p + "mlp.down_proj.weight"))
            state[a + "attn_norm.weight"] = take(p + "input_layernorm.weight")
            state[a + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        except KeyError as e:
            raise ModelLoadError(f"checkpoint is missing tensor {e.args[0]}") from None
    packed = {k.removesuffix(".weight"): state.pop(k) for k in list(state) if isinstance(state[k], Packed)}
    if quant is None:  # a float checkpoint, or --dtype: every packed matrix expanded
        state.update({k + ".weight": v.dequantize() for k, v in packed.items()})
        packed = {}
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings and "lm_head.weight" not in state and "lm_head" not in packed and "lm_head" not in layers:
        model.lm_head.weight = model.embed.weight
    if quant is not None:
        quantize_model(model, quant, packed)
    elif layers:
        _keep_packed(model, layers)
    _release_freed()  # once: per layer it cut the 1B peak by ~70 MiB but cost 1.5-2 s of page faults
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"checkpoint does not fill {missing[0]}")
    return model.eval().requires_grad_(False)


@contextmanager
def _skip_init():
    """No random initialisation of weights about to be replaced: on the meta device it costs nothing but
    imports torch's compiler on first use (seconds of every load)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *args, **kwargs: t)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def _quant_linear(p, bias):
    from attnlab.quant.linear import QuantLinear
    return QuantLinear(p, None if bias is None else bias.float())


def _release_freed() -> None:
    """Hand freed heap memory back to the OS. Why: glibc raises its mmap threshold to the size of the
    largest block freed (up to 32 MiB), so a load's transient tensors of a few MiB come from the heap and
    stay in RSS after they are freed; without this, a 1B model's RSS stays 0.7 GiB above what it holds."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _keep_packed(model: Transformer, layers: dict) -> None:
    """The file's formats as they are: each packed matrix is a QuantLinear (float ones stay nn.Linear);
    a tied embedding reads its rows from the packed head. model.quant names the format ('int4:32' for a
    Q4_0/Q4_1 file, whose head is int8:32 as under --quant int4:32; 'gguf: int4:32, int8:16' when mixed)."""
    from attnlab.quant.linear import QuantEmbedding, linear_names

    formats = []
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
        if name != "lm_head":
            formats += [_format(part) for part in layer.parts or [layer]]
    if model.cfg.tie_embeddings and "lm_head" in layers:
        model.embed = QuantEmbedding(model.lm_head)
    kinds = sorted(set(formats))
    uniform = len(kinds) == 1 and len(formats) == len(linear_names(model)) - 1 and "+" not in kinds[0]
    model.quant = kinds[0] if uniform else "gguf: " + ", ".join(kinds)


def _format(layer) -> str:
    """`Packed.format` of a QuantLinear's weight, without rebuilding its row layout."""
    return f"{layer.kind}:{layer.group}" + ("+min" if layer.has_min else "")


def load_model(spec: str | Path, dtype: torch.dtype | None = None, quant=None, rope: str | None = None):
    """-> (Transformer, ModelConfig, source path) for any supported checkpoint (quantized if quant).

    dtype None: the file's own format (a quantized GGUF stays packed, with float32 activations; float
    checkpoints load as float32); a dtype asks for every weight in it.

    rope: a context-extension override such as "yarn:4" (see `attnlab.rope.parse_rope`),
    replacing the checkpoint's own scaling; "none" removes it.
    """
    from attnlab.quant import QuantSpec
    from attnlab.model.quantized import is_quantized_folder, load_quantized

    path = resolve(spec)
    quant = QuantSpec.parse(quant) if quant is not None else None
    if path.is_dir() and is_quantized_folder(path):
        model = load_quantized(path, dtype or torch.float32)
        if quant is not None and str(quant) != model.quant:
            raise ModelLoadError(f"{path} holds {model.quant} weights; load it without --quant or with --quant {model.quant}")
        return model, model.cfg, path
    if path.is_dir():
        cfg, tensors = read_hf_folder(path)
        dtype = dtype or torch.float32
        validate.check_weights(path, tensors)
    else:  # each tensor read and checked when build takes it
        cfg, tensors = read_gguf(path, hf_layout=False, lazy=True)
    if rope is not None:
        cfg.rope_scaling = parse_rope(rope, _trained_length(cfg))
    model = build(cfg, tensors, dtype, quant, qk_interleaved=not path.is_dir() and cfg.arch == "llama")
    validate.check_model(path, model)
    return model, cfg, path


def _trained_length(cfg: ModelConfig) -> int:
    """The context the weights were trained at: an extended checkpoint's original length, else its own."""
    return int((cfg.rope_scaling or {}).get("original_max_position_embeddings") or cfg.context_length)
