import getpass
import multiprocessing.util
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ZEROSHARD_RANK_THREADS", "1")  # spawned worlds of one: distributed._entry says why

# Every temporary folder the session makes, in this process and in the ranks it spawns (which
# inherit TMPDIR), lies in one folder removed when the session ends: scenarios make theirs with
# tempfile and many cannot remove them (a rank does not know when the others are done with a
# shared one), so each run used to leave a few hundred behind.
# multiprocessing's own folder stays outside: it removes that at exit, after the session ends.
# So does inductor's compile cache, a cache by design, kept between sessions where it was.
multiprocessing.util.get_temp_dir()
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
SESSION_TMP = tempfile.mkdtemp(prefix="zeroshard-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMP


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_TMP, ignore_errors=True)

from distributed import WorldResults  # noqa: E402  (found through the path above)


def pytest_generate_tests(metafunc):
    """A test module names its scenario registry `RESULTS` (a distributed.WorldResults); its tests
    then take `res`, (results, world size) at each of the registry's worlds, or `res_several`, at
    its worlds above 1 (where a comparison with DDP has something to compare). Registering at
    collection lets the first spawned world run every collected registry at once: so every shared
    registry a module holds is registered, not only RESULTS (one first asked for by its own test,
    after the shared world ran, would spawn a world of its own: 8-12 s each)."""
    for value in list(vars(metafunc.module).values()):
        if isinstance(value, WorldResults):
            value.register()  # a no-op for one that is not shared
    results = getattr(metafunc.module, "RESULTS", None)
    if results is None:
        return
    results.register()
    for name, worlds in (("res", results.worlds), ("res_several", [w for w in results.worlds if w > 1])):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, worlds, indirect=True, ids=lambda w: f"world{w}")


def _results(request, tmp_path_factory):
    return request.module.RESULTS.get(request.param, tmp_path_factory), request.param


res = pytest.fixture(_results, name="res")
res_several = pytest.fixture(_results, name="res_several")


def pytest_runtest_logreport(report):
    """With ZEROSHARD_FAIL_LOG=path, append each failure's report to that file as it happens (a run
    cut short by a time limit still tells what failed and why; used on lent GPU machines)."""
    path = os.environ.get("ZEROSHARD_FAIL_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
