"""The shard tasks with the run's retries are made once, not at every stage call, and follow a replaced function."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.tasks.common import with_retries


def test_a_shard_task_with_retries_is_made_once_and_follows_its_function():
    @task(cache_policy=NO_CACHE)
    def shard(x):
        return x

    first = with_retries(shard, 2)
    assert first is with_retries(shard, 2) and first.retries == 2
    assert with_retries(shard, 3).retries == 3 and with_retries(shard, 3) is not first

    def timed(x):  # a benchmark's timer or a test's patch replaces the task's function
        return -x

    shard.fn = timed
    assert with_retries(shard, 2).fn is timed
