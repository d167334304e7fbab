"""Quantized weights that make decoding faster, not only smaller: formats, fused kernels, the model swap."""
from attnlab.quant.formats import Packed
from attnlab.quant.linear import QuantLinear, QuantSpec, model_bytes, quantize_model

__all__ = ["Packed", "QuantLinear", "QuantSpec", "model_bytes", "quantize_model"]
