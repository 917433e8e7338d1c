#!/usr/bin/env python3
"""Run vLLM's own kv_offload manager tests (0.33.0 or 0.34.0) against vLLM's or kvbm's managers.

    python3 crates/kvbm-vllm/tests/upstream/run.py [--vllm 0.34.0] --impl vllm [--report F] [-k EXPR]
    python3 crates/kvbm-vllm/tests/upstream/run.py [--vllm 0.34.0] --impl kvbm [--report F] [-k EXPR]

Why: kvbm_vllm (crates/kvbm-vllm) is meant to be a drop-in for vLLM's scheduler-side
offloading managers. The strongest statement of "drop-in" is vLLM's own test suite
for those managers, run unchanged. `--impl vllm` runs it against vLLM's classes and
proves the harness (everything must pass); `--impl kvbm` runs the same tests with
kvbm's classes substituted (see substitution.py), minus the expected failures listed
in expected_failures.toml.

Steps: install pinned pytest/numpy/... into target/peer/vllm-sdist/pydeps if missing;
fetch the vLLM sdist pinned by sha256 (fetch.py; cached, offline on reruns); extract
only the kv_offload modules and tests; install the torch / heavy-vLLM stubs
(stubs.py); substitute classes (kvbm mode); run pytest in this process on the files
in TEST_FILES with the accounting plugin (plugin.py); print a per-file summary and
write a JSON report.

Exit status: 0 when every collected count matches TEST_FILES and there is no
unexpected failure, error or collection error; 1 otherwise; 2 when the harness itself
could not run (network, sha mismatch, missing kvbm_vllm, bad arguments).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, HERE)

import fetch  # noqa: E402
import stubs  # noqa: E402
import substitution  # noqa: E402

# The upstream test files run, per supported vLLM version, with the number of tests each
# collects there (a different number means a different archive or a broken extraction).
TEST_FILES = {
    "0.33.0": {
        "tests/v1/kv_offload/cpu/test_manager.py": 68,
        "tests/v1/kv_offload/cpu/policies/test_factory.py": 8,
        "tests/v1/kv_offload/tiering/test_tiering_offloading.py": 72,
        "tests/v1/kv_offload/tiering/test_backpressure.py": 60,
        "tests/v1/kv_offload/tiering/test_tier_poll_thread.py": 15,
        "tests/v1/kv_offload/test_factory.py": 61,
        "tests/v1/kv_offload/tiering/test_factory.py": 13,
        "tests/v1/kv_offload/tiering/test_obj_tier.py": 39,
    },
    "0.34.0": {
        "tests/v1/kv_offload/cpu/test_manager.py": 72,
        "tests/v1/kv_offload/cpu/policies/test_factory.py": 8,
        "tests/v1/kv_offload/tiering/test_tiering_offloading.py": 77,
        "tests/v1/kv_offload/tiering/test_backpressure.py": 60,
        "tests/v1/kv_offload/tiering/test_tier_poll_thread.py": 23,
        "tests/v1/kv_offload/test_factory.py": 66,
        "tests/v1/kv_offload/tiering/test_factory.py": 13,
        "tests/v1/kv_offload/tiering/test_obj_tier.py": 42,
    },
}

EXPECTED_FAILURES = os.path.join(HERE, "expected_failures.toml")


def load_expected_failures(path, impl, version, files):
    """Return {node id: reason} for impl from the TOML file (["VERSION".kvbm] / .vllm tables)."""
    import tomllib
    if not os.path.exists(path):
        raise SystemExit(f"error: expected-failures file {path} does not exist")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"error: {path} is not valid TOML: {e}")
    unknown = [k for k in data if k not in TEST_FILES]
    if unknown:
        raise SystemExit(f"error: {path} has tables for unsupported versions {unknown}; "
                         f"supported: {', '.join(TEST_FILES)}")
    table = data.get(version, {}).get(impl, {})
    where = f'["{version}".{impl}]'
    if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise SystemExit(f"error: {where} in {path} must map test node ids to reason strings")
    bad = [k for k in table if k.split("::", 1)[0] not in files]
    if bad:
        raise SystemExit(f"error: {path} {where} names tests outside the run files: {bad[:3]}")
    return table


def print_summary(summary, impl, counts_ok, version):
    cols = ("collected", "passed", "failed", "error", "xfailed", "xpassed", "skipped",
            "not_run")
    print(f"\nvLLM {version} kv_offload tests, --impl {impl}")
    print(f"{'file':58s} " + " ".join(f"{c:>9s}" for c in cols))
    for f, row in summary["files"].items():
        exp = row.get("expected_collected")
        mark = "" if exp is None or row["collected"] == exp else f"  (expected {exp} collected)"
        print(f"{f:58s} " + " ".join(f"{row.get(c, 0):9d}" for c in cols) + mark)
    for n in summary["unexpected_failures"]:
        print(f"UNEXPECTED {summary['tests'][n]['outcome'].upper()}: {n}")
    for n in summary["xpassed"]:
        print(f"XPASS (listed in expected_failures.toml, passed): {n}")
    for n in summary["stale_expected_failures"]:
        print(f"STALE expected failure (not collected): {n}")
    for n, err in summary["collect_errors"].items():
        print(f"COLLECTION ERROR {n}:\n{err[-3000:]}")
    if not counts_ok:
        print("COLLECTED COUNTS DIFFER from the pinned numbers (see table)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", dest="version", choices=tuple(TEST_FILES),
                    default=fetch.DEFAULT_VERSION,
                    help=f"the vLLM release whose tests run (default {fetch.DEFAULT_VERSION})")
    ap.add_argument("--impl", choices=("vllm", "kvbm"), default="vllm",
                    help="whose manager classes the tests run against (default vllm)")
    ap.add_argument("--report", help="write a JSON report to this file")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression (subset of tests)")
    ap.add_argument("-v", "--verbose", action="store_true", help="pytest -v")
    ap.add_argument("--offline", action="store_true",
                    help="never touch the network; fail if the sdist is not cached")
    ap.add_argument("--index-url", default=os.environ.get("KVBM_PYPI_SIMPLE", fetch.DEFAULT_INDEX),
                    help="PEP 691 simple index to fetch the sdist from (default pypi.org)")
    ap.add_argument("--cache-dir", default=os.path.join(REPO, "target", "peer", "vllm-sdist"))
    ap.add_argument("--expected-failures", default=EXPECTED_FAILURES)
    ap.add_argument("--strict-xpass", action="store_true",
                    help="an expected failure that passes fails the run")
    ap.add_argument("--classes", default=",".join(substitution.SUBSTITUTED_CLASSES),
                    help="--impl kvbm: the classes to substitute, comma-separated (default: all "
                         "of substitution.SUBSTITUTED_CLASSES); the others stay vLLM's, and the "
                         "report says so")
    ap.add_argument("--files", default=None,
                    help="the upstream test files to run, comma-separated (default: all of the "
                         "version's); "
                         "a short form like cpu/test_manager.py is accepted")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()
    version = args.version
    files = TEST_FILES[version]
    run_files = {}
    for f in filter(None, (x.strip() for x in (args.files or ",".join(files)).split(","))):
        full = f if f in files else "tests/v1/kv_offload/" + f
        if full not in files:
            print(f"error: --files: {f} is not one of {', '.join(files)}", file=sys.stderr)
            return 2
        run_files[full] = files[full]
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    report_path = os.path.abspath(args.report) if args.report else None
    t0 = time.time()

    try:
        installed = fetch.ensure_pydeps(os.path.join(args.cache_dir, "pydeps"),
                                        offline=args.offline)
        sdist = fetch.fetch_sdist(args.cache_dir, args.index_url, offline=args.offline,
                                  version=version)
        src = os.path.join(args.cache_dir, version)
        info = fetch.extract(sdist, src, version=version)
    except fetch.FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    xfails = {k: v for k, v in load_expected_failures(
                  args.expected_failures, args.impl, version, files).items()
              if k.split("::", 1)[0] in run_files}

    stubs.install(src)
    try:
        subst = substitution.apply(args.impl, classes)
    except substitution.SubstitutionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import pytest
    from plugin import UpstreamPlugin

    plugin = UpstreamPlugin(run_files, xfails)
    pytest_argv = [os.path.join(src, f) for f in run_files]
    pytest_argv += ["-c", os.path.join(src, "pytest.ini"), "--rootdir", src,
                    "-p", "no:cacheprovider", "-v" if args.verbose else "-q", "-rfE"]
    if args.keyword:
        pytest_argv += ["-k", args.keyword]
    pytest_argv += args.pytest_args
    os.chdir(src)
    ret = pytest.main(pytest_argv, plugins=[plugin])

    summary = plugin.summary()
    counts_ok = all(row["collected"] == row["expected_collected"]
                    for row in summary["files"].values() if "expected_collected" in row)
    problems = []
    if not counts_ok:
        problems.append("collected counts differ")
    if summary["unexpected_failures"]:
        problems.append(f"{len(summary['unexpected_failures'])} unexpected failures/errors")
    if summary["collect_errors"]:
        problems.append("collection errors")
    if args.strict_xpass and summary["xpassed"]:
        problems.append("xpassed with --strict-xpass")
    if summary["stale_expected_failures"] and not args.keyword:
        problems.append("stale entries in expected_failures.toml")
    if int(ret) not in (0, 1):  # interrupted, internal error, usage error, no tests
        problems.append(f"pytest exit status {int(ret)}")
    print_summary(summary, args.impl, counts_ok, version)
    if args.impl == "kvbm":
        kept = [c for c in substitution.SUBSTITUTED_CLASSES if c not in classes]
        print("substituted with kvbm's: " + (", ".join(classes) or "nothing")
              + ("; still vLLM's: " + ", ".join(kept) if kept else ""))
    print("RESULT: " + ("ok" if not problems else "FAIL (" + "; ".join(problems) + ")"))

    if report_path:
        out = {
            "vllm_version": version, "sdist": fetch.sdist_name(version),
            "sdist_sha256": fetch.pin(version)[0], "extracted": info, "src": src,
            "impl": args.impl, "substitution": subst, "keyword": args.keyword,
            "python": sys.version.split()[0], "pydeps_installed": installed,
            "stubbed_modules": sorted(stubs.STUBS_USED),
            "pytest_exit": int(ret), "ok": not problems, "problems": problems,
            "seconds": round(time.time() - t0, 2), **summary,
        }
        with open(report_path, "w") as f:
            json.dump(out, f, indent=1, sort_keys=False)
        print(f"report: {report_path}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
