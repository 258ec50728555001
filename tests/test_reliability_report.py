"""The reliability figure docs/usage.md quotes, asserted here: every bad input and fault injection this suite
throws at a dir.

Adds up the corpora of test_hardening.py (a kill after every file operation of patch / revert / re-patch,
plain dirs and Hugging Face cache snapshots; disk-full and permission failures at every write) and
test_sources.py (hostile modeling sources, bad config.json values), reusing their results when they ran
in the same session. Prints (see it with `pytest -s`, or set CODEGEN_RELIABILITY_OUT=FILE):

    RELIABILITY: N bad inputs and fault injections tried, M left the dir changed or corrupted

"M" counts every case whose outcome broke a guarantee (dir changed by a refused run, a kill leaving a dir
that loads as neither state, a revert or re-patch that cannot finish, a traceback, a wrong exit code).
The hypothesis tests of test_injection.py are not counted here: they have no fixed size.
"""

from __future__ import annotations

import pytest

import os
import re
from pathlib import Path

from conftest import CORPORA
from test_hardening import SWEEPS, Tally, cached, failing_writes, fast, outcome  # noqa: F401 - fast is a fixture
from test_sources import source_corpus, warm_and_run_config_corpus

pytestmark = pytest.mark.process  # forks / starts processes: not in the fast tier


@CORPORA
def test_reliability_figure(fast, tmp_path_factory):
    total = Tally()
    parts = {}
    for name in SWEEPS:
        parts[name] = outcome(name, tmp_path_factory.mktemp("sweep"))
    for kind in ("qwen2_moe", "hub_deepseek"):
        name = f"failing-writes-{kind}"
        parts[name] = cached(name, lambda: failing_writes(tmp_path_factory.mktemp(name), kind))
    parts["bad-sources"] = cached("bad-sources", lambda: source_corpus(tmp_path_factory.mktemp("sources")))
    parts["bad-configs"] = cached("bad-configs", lambda: warm_and_run_config_corpus(tmp_path_factory.mktemp("configs")))
    for tally in parts.values():
        total.add(tally)
    detail = ", ".join(f"{name} {t.tried}" for name, t in parts.items())
    line = (f"RELIABILITY: {total.tried} bad inputs and fault injections tried, "
            f"{total.failed} left the dir changed or corrupted")
    print(f"\n{line}\n  ({detail})")
    out = os.environ.get("CODEGEN_RELIABILITY_OUT")
    if out:
        Path(out).write_text(line + "\n")
    assert not total.problems, "\n".join(total.problems)
    # the figure docs/usage.md quotes is this count, and no case broke a guarantee
    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text(encoding="utf-8")
    figure = r"the suite tries (\d+) bad inputs and fault injections.*?;\s+(\d+) left the dir changed"
    quoted = re.search(figure, usage, re.S)
    assert quoted, "docs/usage.md no longer quotes the reliability figure"
    assert (int(quoted[1]), int(quoted[2])) == (total.tried, total.failed) == (total.tried, 0), line
