"""The test helpers themselves: a wait that runs out fails the test and says what it saw; a warm start is a cold one."""

import json
import os
import subprocess

import pytest

from tests.helpers import run_train, same_weights, wait_for_steps, warm_server


def test_wait_for_steps_fails_loudly_on_timeout(tmp_path):
    with pytest.raises(AssertionError, match="no .*steps.jsonl"):
        wait_for_steps(tmp_path, 1, timeout=0.05)
    (tmp_path / "steps.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    wait_for_steps(tmp_path, 1, timeout=0.05)
    with pytest.raises(AssertionError, match="did not log step 2.*last logged step 1"):
        wait_for_steps(tmp_path, 2, timeout=0.05)


@pytest.mark.slow  # the fast tier stays under 240 s on two cores (issue 50 item 7)
def test_a_warm_run_ends_as_a_cold_one_and_keeps_exit_codes_and_timeouts(tmp_path, shapes):
    """tests/warm_train.py: a run forked from the server ends bit for bit where `python train.py` does, with its own
    output and exit code; the control, another seed, ends elsewhere."""
    run = [*shapes, "max_steps=3"]
    warm = run_train(tmp_path / "warm", *run)
    run_train(tmp_path / "cold", *run, env={"WARM_TRAIN": "0"})  # python train.py, a new interpreter
    run_train(tmp_path / "other", *run, "seed=1")
    last = "checkpoints/last.pth"
    assert same_weights(tmp_path / "warm" / last, tmp_path / "cold" / last)
    assert not same_weights(tmp_path / "warm" / last, tmp_path / "other" / last)
    assert f"run folder {tmp_path / 'warm'}" in warm.stdout + warm.stderr  # its own output, not the server's

    refused = run_train(tmp_path / "refused", *run, "epochs=0", expect=2)
    assert refused.stderr.startswith("error: ") and "epochs" in refused.stderr
    server = warm_server()
    assert not server.fits({**server.env, "OMP_NUM_THREADS": "64"})  # read by OpenMP as torch loads: a cold start
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(["train.py", *shapes, f"hydra.run.dir={tmp_path / 'slow'}"], dict(os.environ), timeout=0.5)
    assert server.fits(server.env)  # the server goes on after a child it killed (its own environment: another test
    # in this pytest process may have set a variable since, which sends only runs with it cold)
