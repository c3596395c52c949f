"""`make test` runs the suite on 2 workers with --dist loadgroup: the tests that share a server, a compiled graph or
a module's sweep carry an `xdist_group` mark and must run on one worker (beside nothing else of theirs, and set up
once). With pytest 9.2, pytest-xdist 3.8 silently stopped grouping (its group suffix on the node id no longer took:
pytest-dev/pytest-xdist#1386), and every grouped module ran on both workers; pyproject pins pytest below 9.2."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("servers")


def test_a_grouped_test_is_in_its_group_under_loadgroup(request):
    if not getattr(request.config.option, "loadgroup", False):  # what pytest-xdist sets on its workers
        pytest.skip("not a worker of pytest -n N --dist loadgroup")
    assert request.node.nodeid.endswith("@servers"), request.node.nodeid
