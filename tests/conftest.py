import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_runtest_logreport(report):
    """With ZEROSHARD_FAIL_LOG=path, append each failure's report to that file as it happens (a run
    cut short by a time limit still tells what failed and why; used on lent GPU machines)."""
    path = os.environ.get("ZEROSHARD_FAIL_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
