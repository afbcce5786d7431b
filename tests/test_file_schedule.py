"""The order in which `make test` hands out the suite's files (tests/file_schedule.py)."""

from __future__ import annotations

import json

from file_schedule import DURATIONS, load_durations, longest_first, unit_costs


def unit_of(node_id: str) -> str:
    return node_id.split("::", 1)[0]


def test_a_file_costs_its_tests_recorded_durations_and_an_unrecorded_test_the_median():
    recorded = {"a.py::x": 10.0, "a.py::y": 2.0, "b.py::x": 4.0}
    costs = unit_costs(["a.py::x", "a.py::y", "b.py::x", "b.py::new", "c.py::new"], unit_of, recorded)
    assert costs == {"a.py": 12.0, "b.py": 8.0, "c.py": 4.0}


def test_longest_first_and_held_back_files_only_after_the_first_round():
    costs = {"short.py": 1.0, "vllm_long.py": 90.0, "mid.py": 20.0, "long.py": 60.0, "tiny.py": 0.5}
    assert longest_first(costs, set(), first_round=2) == ["vllm_long.py", "long.py", "mid.py", "short.py", "tiny.py"]
    assert longest_first(costs, {"vllm_long.py"}, first_round=2) == [
        "long.py", "mid.py", "vllm_long.py", "short.py", "tiny.py"]


def test_the_recorded_durations_are_of_this_suite():
    """The file the order comes from is readable and names this suite's files: a stale one only costs balance,
    but one whose files are mostly gone would order nothing (refresh it as tests/file_schedule.py says)."""
    durations = load_durations()
    assert durations, f"{DURATIONS} is missing or unreadable"
    assert json.loads(DURATIONS.read_text()) == durations
    root = DURATIONS.parent.parent
    present = sum(seconds for node_id, seconds in durations.items() if (root / unit_of(node_id)).exists())
    assert present >= 0.8 * sum(durations.values())
