"""What the drivers of PyTorch's own test files share (dist_suite.py,
c10d_gloo.py): expecttest's two names where Debian lacks the package, and a
unittest result that prints one line per test and keeps a record."""
import sys
import textwrap
import time
import types
import unittest


def install_expecttest():
    """The suite's harness (common_utils) derives its TestCase from
    expecttest's, a small pip package Debian does not ship.  Where it is
    missing, this module gives the two names the harness uses, with
    expecttest's meaning: ACCEPT (rewrite expected strings in place, never
    done here) and TestCase.assertExpectedInline (actual == dedented expected)."""
    try:
        import expecttest  # noqa: F401
        return
    except ImportError:
        pass
    mod = types.ModuleType("expecttest")
    mod.ACCEPT = False

    class TestCase(unittest.TestCase):
        longMessage = True

        def assertExpectedInline(self, actual, expect, skip=0):
            self.assertEqual(textwrap.dedent(expect).strip("\n"), actual.strip("\n"))

        def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):
            try:
                callable(*args, **kwargs)
            except exc_type as e:
                self.assertExpectedInline(str(e), expect)
                return
            self.fail("Did not raise when expected to")

    mod.TestCase = TestCase
    sys.modules["expecttest"] = mod



class Recorder(unittest.TextTestResult):
    """One line per test as it ends, and a record ({name: [status,
    seconds, detail]}) for --json.  A test is named by its method, or with
    QUALIFIED by its class and method."""
    QUALIFIED = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.record = {}

    def startTest(self, test):
        self._t0 = time.monotonic()
        unittest.TestResult.startTest(self, test)

    def _done(self, test, status, detail=""):
        name = test.id().split(".")[-1]
        if self.QUALIFIED:
            name = "%s.%s" % (type(test).__name__, name)
        secs = time.monotonic() - self._t0
        self.record[name] = [status, round(secs, 2), detail]
        line = "%-5s %-70s %6.1f s" % (status, name, secs)
        if status == "SKIP":
            line += "  (%s)" % detail.splitlines()[0][:80] if detail else ""
        print(line, flush=True)

    def addSuccess(self, test):
        unittest.TestResult.addSuccess(self, test)
        self._done(test, "PASS")

    def addFailure(self, test, err):
        unittest.TestResult.addFailure(self, test, err)
        self._done(test, "FAIL", self.failures[-1][1])

    def addError(self, test, err):
        unittest.TestResult.addError(self, test, err)
        self._done(test, "FAIL", self.errors[-1][1])

    def addSkip(self, test, reason):
        unittest.TestResult.addSkip(self, test, reason)
        self._done(test, "SKIP", reason)

    def addExpectedFailure(self, test, err):
        unittest.TestResult.addExpectedFailure(self, test, err)
        self._done(test, "XFAIL")

    def addUnexpectedSuccess(self, test):
        unittest.TestResult.addUnexpectedSuccess(self, test)
        self._done(test, "FAIL", "unexpected success")
