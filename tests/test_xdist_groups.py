"""The suite's parallel runs rely on pytest-xdist's `--dist loadgroup` sending every test of one `xdist_group` to one
worker (a regression entry's rewrite, the reliability corpora: computed once per worker). pytest 9.2 broke that
silently (pytest-dev/pytest-xdist#1386): the tests still pass, each group's work is just done on both workers. This
runs the pinned pytest and pytest-xdist on a throwaway suite and checks the grouping holds."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # starts a pytest process: not in the fast tier

SUITE = '''
import os
import pytest

GROUP = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("k", range(6))
@GROUP
def test_grouped(k, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / f"grouped-{k}").write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.parametrize("k", range(6))
def test_free(k):
    pass
'''


def test_loadgroup_sends_a_group_to_one_worker(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "out").mkdir()  # each worker's base temp dir is out/t/gw<k>: the tests write into out/t
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--basetemp", str(tmp_path / "out" / "t"), "test_suite.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    written = list(tmp_path.glob("out/t/grouped-*"))
    workers = {p.read_text() for p in written}
    assert len(written) == 6 and len(workers) == 1, workers
