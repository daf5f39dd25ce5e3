"""The job environment is read once, in the trunk (trainspec.core.job_env), by every backend:
a Kubernetes Indexed Job's JOB_COMPLETION_INDEX is the process id wherever
TRAINSPEC_PROCESS_ID is not set."""
import pytest

from trainspec.core.errors import UserInputError
from trainspec.core.job_env import Job, described_job, process_id_from_env

JOB = {"TRAINSPEC_COORDINATOR": "10.0.0.1:4321", "TRAINSPEC_NUM_PROCESSES": "4"}


@pytest.fixture
def env(monkeypatch):
    for name in (*JOB, "TRAINSPEC_PROCESS_ID", "JOB_COMPLETION_INDEX", "RANK"):
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


def test_no_coordinator_is_no_job(env):
    env(JOB_COMPLETION_INDEX="2")
    assert described_job() is None and process_id_from_env("RANK") == 0


def test_the_indexed_jobs_index_is_the_process_id(env):
    env(**JOB, JOB_COMPLETION_INDEX="2")
    assert described_job() == Job("10.0.0.1:4321", 4, 2)
    assert process_id_from_env("RANK") == 2


def test_an_explicit_process_id_wins(env):
    env(**JOB, JOB_COMPLETION_INDEX="2", TRAINSPEC_PROCESS_ID="1")
    assert described_job().process_id == 1 == process_id_from_env("RANK")


def test_torchruns_rank_without_a_coordinator(env):
    env(RANK="3", JOB_COMPLETION_INDEX="2")  # the index means nothing without the job it names
    assert process_id_from_env("RANK") == 3


@pytest.mark.parametrize("values, message", [
    ({"JOB_COMPLETION_INDEX": "4"}, r"TRAINSPEC_PROCESS_ID=4 is outside \[0, "),
    ({"JOB_COMPLETION_INDEX": "two"}, "environment variable TRAINSPEC_PROCESS_ID: expected an "
                                      "integer, got 'two'"),
    ({}, "TRAINSPEC_PROCESS_ID: expected an integer, got ''"),
])
def test_a_bad_description_is_one_line_naming_the_variable(env, values, message):
    env(**JOB, **values)
    with pytest.raises(UserInputError, match=message):
        described_job()


def test_the_torch_rank_a_launched_process_speaks_for_is_the_index(env):
    """The torch CLI names its writer by this rank (trainspec.torch.support, no torch loaded)."""
    from trainspec.torch.support import rank_from_env

    env(**JOB, JOB_COMPLETION_INDEX="3")
    assert rank_from_env() == 3
