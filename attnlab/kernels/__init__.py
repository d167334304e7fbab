"""attnlab's CPU kernels: C++ sources built on first use, called only through `attnlab.kernels.ops`."""
