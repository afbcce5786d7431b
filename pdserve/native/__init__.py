"""C++ kernels built with torch's extension tooling, each with a plain-torch fallback (see build.py)."""
