"""The test helpers themselves: a wait that runs out fails the test and says what it saw."""

import json

import pytest

from tests.helpers import wait_for_steps


def test_wait_for_steps_fails_loudly_on_timeout(tmp_path):
    with pytest.raises(AssertionError, match="no .*steps.jsonl"):
        wait_for_steps(tmp_path, 1, timeout=0.05)
    (tmp_path / "steps.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    wait_for_steps(tmp_path, 1, timeout=0.05)
    with pytest.raises(AssertionError, match="did not log step 2.*last logged step 1"):
        wait_for_steps(tmp_path, 2, timeout=0.05)
