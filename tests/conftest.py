"""Suite-wide scheduling: `make test` runs two pytest processes (pytest-xdist, `--dist loadgroup`).

Tests that start real processes (marked `hivemind`) run one after another in one of them, so that two swarms
never share the two cores at once; the simulator and unit tests fill the other. The real-process tests whose
deadlines are tightest run last, when the simulator tests are done.
"""

import pytest

# Run last among the real-process tests (by file name): they assert per-step deadlines under BTARD timeouts.
LAST = ("test_launch_crash.py", "test_hivemind_secure_pipeline.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i + 1 for i, name in enumerate(LAST)}
    for item in items:
        if item.get_closest_marker("hivemind") is not None:
            item.add_marker(pytest.mark.xdist_group("processes"))
    items.sort(key=lambda item: rank.get(item.path.name, 0))
