"""pdserve's KV transfer inside other engines: each subpackage is imported only by that engine."""
