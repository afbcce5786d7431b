"""Capture of side-channel messages: every message sent or received, appended to a JSON-lines file.

Drills and tests read it to see what crossed between instances; without a path it costs nothing.
"""

from __future__ import annotations

import json
import time

import msgspec

from pdserve.kv_transfer.messages import Message


class MessageCapture:
    def __init__(self, path: str | None, engine_id: str) -> None:
        self.engine_id = engine_id
        self._file = open(path, "a") if path else None  # noqa: SIM115 - open for the agent's lifetime

    def __call__(self, direction: str, message: Message) -> None:
        if self._file is not None:
            record = {"time": time.time(), "engine_id": self.engine_id, "direction": direction,
                      "message": msgspec.to_builtins(message), "type": type(message).__name__}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
