"""Thread-count defaults and caps, and threadpoolctl (SPEC.md 1, 2.6).

Precedence at import: EXACTBLOCKS_NUM_THREADS, else OMP_NUM_THREADS (first entry), else the
usable CPUs (the affinity mask); every source is capped to the usable CPUs with a
RuntimeWarning, and set_num_threads is capped the same way.
"""

from __future__ import annotations

import os
import warnings

import pytest
from robust_helpers import run_python

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
CPUS_TEXT = f"{CPUS} CPU{'' if CPUS == 1 else 's'}"  # "1 CPU", "2 CPUs"

_SHOW = "import exactblocks as eb; print(eb.get_num_threads())"


def _threads(env):
    res = run_python(_SHOW, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip()), res.stderr


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, CPUS),
        ({"OMP_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "1,4"}, 1),  # OpenMP's nested list: the first level
        ({"OMP_NUM_THREADS": str(CPUS), "EXACTBLOCKS_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "1", "EXACTBLOCKS_NUM_THREADS": str(CPUS)}, CPUS),
    ],
)
def test_default_threads_precedence(env, expect):
    got, err = _threads(env)
    assert got == expect, (env, err)
    assert "Warning" not in err, err


def test_bad_omp_num_threads_is_ignored_with_a_warning():
    got, err = _threads({"OMP_NUM_THREADS": "many"})
    assert got == CPUS
    assert "OMP_NUM_THREADS='many'" in err and "ignored" in err, err


@pytest.mark.parametrize("name", ["EXACTBLOCKS_NUM_THREADS", "OMP_NUM_THREADS"])
def test_env_above_the_cpus_is_capped_with_a_warning(name):
    got, err = _threads({name: "999"})
    assert got == CPUS
    assert "RuntimeWarning" in err and f"{name}=999" in err and CPUS_TEXT in err, err


@pytest.mark.parametrize(("name", "value"), [("OMP_NUM_THREADS", "999"), ("OMP_NUM_THREADS", "x")])
def test_env_warnings_point_at_the_users_import_line(name, value):
    # they pointed at exactblocks/__init__.py:20
    res = run_python("x = 1\nimport exactblocks\n", timeout=60, env={name: value})
    assert res.returncode == 0, res.stderr
    assert res.stderr.startswith("<string>:2: RuntimeWarning: exactblocks: "), res.stderr
    assert "__init__.py" not in res.stderr and "runtime.py" not in res.stderr, res.stderr


def test_set_num_threads_caps_at_the_usable_cpus(core):
    import exactblocks as eb

    saved = eb.get_num_threads()
    try:
        with pytest.warns(
            RuntimeWarning,
            match=rf"n=999 exceeds the {CPUS_TEXT} usable .*; using {CPUS} threads?$",
        ):
            eb.set_num_threads(999)
        assert eb.get_num_threads() == CPUS == core.get_num_threads()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            eb.set_num_threads(CPUS)  # the CPU count itself: no warning
    finally:
        eb.set_num_threads(saved)


def test_threadpoolctl_sees_and_limits_exactblocks(core):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import exactblocks as eb

    infos = [i for i in threadpoolctl.threadpool_info() if i["internal_api"] == "exactblocks"]
    assert len(infos) == 1, threadpoolctl.threadpool_info()
    assert infos[0]["num_threads"] == eb.get_num_threads()
    assert infos[0]["version"] == eb.__version__
    assert os.path.basename(infos[0]["filepath"]).startswith("_core")
    saved = eb.get_num_threads()
    try:
        eb.set_num_threads(CPUS)
        with threadpoolctl.threadpool_limits(1):
            assert eb.get_num_threads() == 1 == core.get_num_threads()
        assert eb.get_num_threads() == CPUS
        with threadpoolctl.threadpool_limits(limits=1, user_api="exactblocks"):
            assert eb.get_num_threads() == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a limit above the CPUs is capped silently
            with threadpoolctl.threadpool_limits(10_000, user_api="exactblocks"):
                assert eb.get_num_threads() == CPUS
    finally:
        eb.set_num_threads(saved)


def test_works_without_threadpoolctl():
    # threadpoolctl stays optional: a missing one changes nothing.
    code = """
        import sys
        sys.modules["threadpoolctl"] = None  # import threadpoolctl -> ImportError
        import numpy as np, exactblocks as eb
        sys.path.insert(0, {tests!r})
        from robust_helpers import small_transformer
        print(small_transformer().forward(np.zeros((1, 2, 32), np.float32)).shape)
    """
    from robust_helpers import TESTS

    res = run_python(code.format(tests=os.path.join(TESTS, "robust")), timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(1, 2, 32)"
