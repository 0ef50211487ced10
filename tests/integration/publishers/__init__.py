"""Every publisher's tests: base.py writes the shared behaviours once, a file per broker
subclasses it and adds what only that broker does."""

import pytest

# base.py holds the assertions of the shared tests: rewritten, a failure shows its values.
pytest.register_assert_rewrite("tests.integration.publishers.base")
