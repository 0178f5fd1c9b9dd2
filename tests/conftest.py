"""Suite-wide scheduling: `make test` runs two pytest processes (pytest-xdist, `-n 2`).

Tests that start real processes (marked `hivemind`) run one after another in one of them, so that two swarms
never share the two cores at once; the simulator and unit tests fill the other. The real-process tests whose
deadlines are tightest run last among them.

The grouping is a scheduler of our own (`pytest_xdist_make_scheduler`): xdist's `--dist loadgroup` marks a group
by renaming the test's node id, which pytest 9 no longer lets a plugin do, so it silently groups nothing.
"""

from pathlib import Path

import pytest

HERE = Path(__file__).parent
# Run last among the real-process tests (by file name): they assert per-step deadlines under BTARD timeouts.
LAST = ("test_launch_crash.py", "test_hivemind_secure_pipeline.py")


def _process_files() -> set[str]:
    """The test files with real-process tests: those that use the `hivemind` marker."""
    return {f"tests/{path.name}" for path in HERE.glob("test_*.py") if "mark.hivemind" in path.read_text()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i + 1 for i, name in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.path.name, 0))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    processes = _process_files()

    class ProcessesTogether(LoadScopeScheduling):
        """Each test its own unit of work, except the real-process files' tests: one unit, run in order."""

        def _split_scope(self, nodeid: str) -> str:
            return "processes" if nodeid.split("::", 1)[0] in processes else nodeid

    return ProcessesTogether(config, log)
