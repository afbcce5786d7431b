"""The order in which pytest-xdist hands the suite's files to its workers (`make test`: `-n 4 --dist loadfile`).

A whole file is one unit of work, run on one worker, so that its module-scoped servers start once; the files of a
FILE_GROUPS entry (tests/conftest.py) make one unit together. pytest-xdist hands out units with the most tests
first, and a worker takes the next unit when it nears the end of its last, so the run ends when the worker that
drew the last long unit ends. Test counts say little about time here: `test_vllm_llava.py` has 2 tests and runs
~85 s, `test_hardening_input.py` 88 tests in ~10 s, and the LLaVA file, drawn last, kept one worker busy ~40 s
after the others had ended. Units go out longest first instead (longest processing time first: the last ones
handed out are the shortest, so the workers end close together), timed by the last whole run's durations in
`tests/.test_durations` (pytest-split's format: seconds per test id, setup and teardown included). A test the file
does not know counts as the median known test. Refresh it after adding or reshaping slow tests:

    make test PYTEST_ADDOPTS="--store-durations --durations-path tests/.test_durations --clean-durations"

Files that start vLLM go out only after the first round of units when vLLM's fork server is not ready by the time
the first units go out (the suite installs vLLM's venv as it starts, where it is missing, and the server then
imports vLLM once): a worker that drew one first would wait for both.
"""

from __future__ import annotations

import json
import statistics
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

DURATIONS = Path(__file__).with_name(".test_durations")


def unit_costs(node_ids: list[str], unit_of: Callable[[str], str], durations: dict[str, float]) -> dict[str, float]:
    """Expected seconds per unit: the sum of its tests' recorded durations, the median for a test not recorded."""
    known = [durations[node_id] for node_id in node_ids if node_id in durations]
    default = statistics.median(known) if known else 1.0
    costs: dict[str, float] = {}
    for node_id in node_ids:
        unit = unit_of(node_id)
        costs[unit] = costs.get(unit, 0.0) + durations.get(node_id, default)
    return costs


def longest_first(costs: dict[str, float], held_back: set[str], first_round: int) -> list[str]:
    """Units by expected time, longest first; those `held_back` only after the first `first_round` others."""
    ordered = sorted(costs, key=lambda unit: -costs[unit])
    others = [unit for unit in ordered if unit not in held_back]
    held = [unit for unit in ordered if unit in held_back]
    return others[:first_round] + sorted(held + others[first_round:], key=lambda unit: -costs[unit])


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: every test counts alike
        return {}


def make_scheduler(config: Any, log: Any, group_of: dict[str, str], needs_vllm: Callable[[str], bool],
                   vllm_ready: Callable[[], bool]) -> LoadScopeScheduling:
    """pytest-xdist's file scheduler with FILE_GROUPS' units and the order above. `needs_vllm(path)` says whether a
    test file starts vLLM, `vllm_ready()` whether vLLM's fork server is ready (asked once, as the first units go
    out)."""

    class FileScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of.get(Path(path).name, path)

        def _assign_work_unit(self, node: Any) -> None:
            # The base class builds its queue and hands out the first units in one method: the queue is put in
            # order here, as the first unit is taken from it.
            if not self._ordered:
                self._ordered = True
                self.workqueue = self._in_order(self.workqueue)
            super()._assign_work_unit(node)

        def _in_order(self, queue: OrderedDict[str, dict[str, bool]]) -> OrderedDict[str, dict[str, bool]]:
            node_ids = [node_id for unit in queue.values() for node_id in unit]
            costs = unit_costs(node_ids, self._split_scope, load_durations())
            held_back: set[str] = set()
            if not vllm_ready():
                paths = {node_id.split("::", 1)[0] for node_id in node_ids}
                held_back = {self._split_scope(path) for path in paths if needs_vllm(path)}
            order = longest_first(costs, held_back, first_round=2 * len(self.nodes))
            log("units in order:", ", ".join(f"{unit} ({costs[unit]:.0f} s)" for unit in order))
            return OrderedDict((unit, queue[unit]) for unit in order)

    return FileScheduling(config, log)
