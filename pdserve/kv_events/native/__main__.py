"""`python -m pdserve.kv_events.native`: compile the prefix index's C core into the build cache (`make install`)."""

from pdserve.kv_events.native import build

if __name__ == "__main__":
    print(f"pdserve KV index core: {build()}")
