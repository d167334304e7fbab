"""attnlab: understand and exploit attention sparsity in Transformers."""
from attnlab.engine import LM, load
from attnlab.errors import AttnlabError
from attnlab.options import Options, PolicySpec

__all__ = ["LM", "load", "Options", "PolicySpec", "AttnlabError"]
__version__ = "0.1.0"
