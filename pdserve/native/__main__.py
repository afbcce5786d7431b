"""`python -m pdserve.native`: compile the kernels into the build cache (`make install` runs it)."""

import sys

from pdserve.native.build import compile_into_cache

if __name__ == "__main__":
    print(f"pdserve native kernels: {compile_into_cache()}")
    sys.exit(0)
