"""Under CI a skip fails (tests/conftest.py): a test that skips because a service is missing would
otherwise let CI pass without testing what the service is there for."""

from __future__ import annotations

import pytest

from tests.conftest import in_ci, pytest_runtest_makereport


def _report(outcome: str, **extra: object) -> pytest.TestReport:
    longrepr = ("tests/unit/x.py", 3, "Skipped: prometheus is not installed") if outcome == "skipped" else None
    report = pytest.TestReport("tests/unit/x.py::t", ("x.py", 3, "t"), {}, outcome,  # type: ignore[arg-type]
                               longrepr, "call")
    for name, value in extra.items():
        setattr(report, name, value)
    return report


def _through_hook(report: pytest.TestReport) -> pytest.TestReport:
    hook = pytest_runtest_makereport(None, None)  # type: ignore[arg-type]  # neither is read
    next(hook)
    with pytest.raises(StopIteration) as done:
        hook.send(report)
    result: pytest.TestReport = done.value.value
    return result


@pytest.mark.parametrize(("value", "ci"), [
    ("1", True), ("true", True), ("yes", True), ("", False), ("0", False), ("false", False), ("False", False),
])
def test_ci_is_any_value_but_empty_0_or_false(monkeypatch: pytest.MonkeyPatch, value: str, ci: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


def test_a_skip_fails_under_ci_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    report = _through_hook(_report("skipped"))
    assert report.failed
    assert "prometheus is not installed" in str(report.longrepr)


def test_a_skip_stays_a_skip_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert _through_hook(_report("skipped")).skipped


def test_an_expected_failure_stays_one_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    assert _through_hook(_report("skipped", wasxfail="known")).skipped
    assert _through_hook(_report("passed")).passed
