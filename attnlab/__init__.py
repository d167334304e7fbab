"""attnlab: understand and exploit attention sparsity in Transformers."""
from attnlab.engine import LM, load

__all__ = ["LM", "load"]
__version__ = "0.1.0"
