"""Scale-out: independent cells on a local loop or a Ray cluster, resumable (docs/scale.md).

Ray is optional (`pip install 'attnlab[scale]'`) and imported only by `RayBackend`."""
from attnlab.scale.backends import LocalBackend, RayBackend, make_backend
from attnlab.scale.cells import Cell, CellStore, Report, cell_key, run_cells

__all__ = ["Cell", "CellStore", "LocalBackend", "RayBackend", "Report", "cell_key", "make_backend", "run_cells"]
