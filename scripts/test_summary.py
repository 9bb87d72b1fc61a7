#!/usr/bin/env python3
"""Counts one flavour's test results for scripts/test.sh.

Usage: test_summary.py <flavour> <ctest JUnit file> <GoogleTest XML folder>

Sharded executables (GATTN_TESTS_PER_EXECUTABLE) write one GoogleTest XML report per shard into
the folder: their cases are counted from those. Every other ctest test (one GoogleTest case each
with gtest_discover_tests, or a script such as the CMake package check) counts as one. A ctest
test that wrote no report of its own (a shard that crashed) counts as failed. Exits with status
1 when no case ran (a GoogleTest filter that selects nothing passes in ctest).
"""
import pathlib
import sys
import xml.etree.ElementTree as ET


def main(flavour, junit_path, results_dir):
    ctest = ET.parse(junit_path).getroot()
    reports = {p.stem: ET.parse(p).getroot() for p in pathlib.Path(results_dir).glob("*.xml")}
    run = passed = failed = skipped = 0
    for test in ctest.iter("testcase"):
        name, status = test.get("name"), test.get("status")
        report = reports.get(name)
        if report is None:
            # One case of its own, a script, or a shard that crashed before writing its report.
            if status in ("notrun", "disabled"):
                skipped += 1
            else:
                run += 1
                passed += status == "run"
                failed += status != "run"
            continue
        shard_passed = shard_failed = 0
        for case in report.iter("testcase"):
            if case.get("status") != "run":
                continue  # DISABLED_ cases
            if case.get("result") == "skipped" or case.find("skipped") is not None:
                skipped += 1
            elif case.find("failure") is not None:
                shard_failed += 1
            else:
                shard_passed += 1
        run += shard_passed + shard_failed
        if status != "run" and shard_failed == 0:
            # Every case passed, then the process failed (a sanitizer's report at exit, say):
            # counted as one failed case more.
            run += 1
            shard_failed = 1
        passed += shard_passed
        failed += shard_failed
    tests = sum(1 for _ in ctest.iter("testcase"))
    print(f"== {flavour}: {run} test cases run, {passed} passed, {failed} failed, {skipped} skipped "
          f"({tests} ctest tests)")
    if run == 0:
        print(f"{flavour}: no test case ran (does a filter select nothing?)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
