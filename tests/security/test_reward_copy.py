"""A reward file from storage: fetched into a private directory, re-hashed on every use.

The copy's directory is made by tempfile.mkdtemp (0700, a name nobody predicts); a copy changed
after the fetch is refused by name; the sandbox's workers (which get no storage credentials)
run the parent's copy, checked the same way.
"""

from __future__ import annotations

import os
import stat

import pytest

from gpu_jobs.reward import RewardConfig, score_batch
from gpu_jobs.reward import custom
from gpu_jobs.reward.custom import ChangedCopyError, load_custom_reward_function, local_source

REWARD = b"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.75\n"
SWAPPED = b"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


@pytest.fixture
def remote_reward(s3_bucket_url, s3_endpoint, monkeypatch):
    """The reward file on S3, reachable with the standard AWS variables (as a run has them)."""
    from storage import url_to_fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint["secret"])
    monkeypatch.setattr(custom, "_FETCHED", {})  # this test's fetches only
    url = f"{s3_bucket_url}/code/my_reward.py"
    fs, path = url_to_fs(url)
    fs.pipe_file(path, REWARD)
    return url


def test_the_copy_lives_in_a_private_directory(remote_reward):
    local, digest = local_source(remote_reward)
    folder = os.path.dirname(local)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and stat.S_IMODE(os.stat(local).st_mode) == 0o600
    assert os.path.basename(folder).startswith("rlmill-reward-") and digest not in folder  # not derived from content
    assert load_custom_reward_function(remote_reward)("s", "r", "g") == 0.75
    assert local_source(remote_reward) == (local, digest)  # fetched once per process


def test_a_copy_changed_after_the_fetch_is_refused(remote_reward):
    assert load_custom_reward_function(remote_reward)("s", "r", "g") == 0.75
    local, _ = local_source(remote_reward)
    with open(local, "wb") as f:
        f.write(SWAPPED)
    with pytest.raises(ChangedCopyError, match="no longer matches the sha256 recorded"):
        load_custom_reward_function(remote_reward)
    cfg = RewardConfig(custom_reward_function={"path": remote_reward}, num_workers=1)
    with pytest.raises(ChangedCopyError, match=local):
        score_batch([{"data_source": "s", "solution_str": "r", "ground_truth": "g"}], cfg)


def test_workers_run_the_parents_copy_without_credentials(remote_reward):
    cfg = RewardConfig(custom_reward_function={"path": remote_reward}, num_workers=2)
    rows = [{"data_source": "s", "solution_str": str(i), "ground_truth": "g"} for i in range(4)]
    scores, extras, _ = score_batch(rows, cfg)
    assert scores == [0.75] * 4, extras
