"""engine/cpu_threads.py: threads and OpenMP wait policy for a CPU engine on a shared machine."""

import os
import subprocess
import sys

import pytest

import rooflm.envs as envs
from rooflm.engine.cpu_threads import (child_environment, machine_plan, plan_cpu_threads,
                                       spawn_environment)


def test_a_quiet_machine_keeps_torchs_defaults():
    plan = plan_cpu_threads(cores=2, other_load=0.2)
    assert plan.threads is None and not plan.passive_wait
    assert child_environment(plan) == {}


@pytest.mark.parametrize("cores, load, threads", [(2, 2.1, 1), (2, 6.0, 1), (16, 4.0, 12),
                                                  (8, 0.6, 7)])
def test_other_work_leaves_its_cores_and_waits_passively(cores, load, threads):
    plan = plan_cpu_threads(cores, load)
    assert plan.threads == threads and plan.passive_wait


def test_the_switches_override_the_load():
    assert plan_cpu_threads(2, 6.0, mode="off").threads is None
    assert plan_cpu_threads(4, 0.0, mode="on").threads == 3
    pinned = plan_cpu_threads(2, 6.0, pinned=2)
    assert pinned.threads == 2 and pinned.passive_wait
    with pytest.raises(ValueError, match="auto, on or off"):
        plan_cpu_threads(2, 0.0, mode="sometimes")


def test_the_machine_plan_reads_the_switches():
    with envs.override("ROOFLM_CPU_CONTENTION", "on"), envs.override("ROOFLM_CPU_THREADS", "1"):
        assert machine_plan().threads == 1
    with envs.override("ROOFLM_CPU_CONTENTION", "off"), envs.override("ROOFLM_CPU_THREADS", None):
        assert machine_plan().threads is None


def test_a_spawned_child_gets_the_wait_policy_and_this_process_keeps_its_own(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("ROOFLM_CPU_THREADS", raising=False)
    env = child_environment(plan_cpu_threads(2, 3.0))
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "ROOFLM_CPU_THREADS": "1"}
    with spawn_environment(env):
        seen = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_WAIT_POLICY'], "
                               "os.environ['ROOFLM_CPU_THREADS'])"],
                              capture_output=True, text=True, check=True).stdout.split()
    assert seen == ["PASSIVE", "1"]
    assert "OMP_WAIT_POLICY" not in os.environ and "ROOFLM_CPU_THREADS" not in os.environ
    # A policy the user chose is theirs.
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in child_environment(plan_cpu_threads(2, 3.0))
