"""The supervisor's judgement, unit by unit: what is a hung actor, when may it restart."""

from __future__ import annotations

import time

from pagedserve.actors.supervision_messages import ActorStats
from pagedserve.actors.watchdog import HeartbeatMonitor, RestartBudget
from pagedserve.config import SupervisionConfig


def stats(name: str, stalled_s: float = 0.0, blocking: str = "") -> ActorStats:
    return ActorStats(
        name=name, pid=1, epoch=0, uptime_s=1.0, busy_s=0.1, cpu_s=0.1, rss_bytes=1,
        messages_in=0, messages_out=0, rejected=0, stalled_s=stalled_s, blocking=blocking,
    )  # fmt: skip


def test_a_silent_actor_is_hung_after_the_timeout() -> None:
    monitor = HeartbeatMonitor(SupervisionConfig(heartbeat_timeout_s=0.2))
    monitor.watch("tokenizer")
    monitor.watch("worker")
    assert monitor.hung() == []
    time.sleep(0.25)
    monitor.beat(stats("worker"))
    assert [label for label, _ in monitor.hung()] == ["tokenizer"]
    monitor.forget("tokenizer")  # being restarted: not judged
    assert monitor.hung() == []


def test_a_stalled_loop_is_hung_but_a_declared_blocking_call_has_longer() -> None:
    config = SupervisionConfig(heartbeat_timeout_s=5.0, blocking_timeout_s=60.0)
    monitor = HeartbeatMonitor(config)
    for label in ("scheduler", "worker"):
        monitor.watch(label)
    monitor.beat(stats("scheduler", stalled_s=6.0))
    monitor.beat(stats("worker", stalled_s=30.0, blocking="step"))
    [(label, why)] = monitor.hung()
    assert label == "scheduler" and "has not run for 6.0 s" in why
    monitor.beat(stats("worker", stalled_s=61.0, blocking="step"))
    assert {label for label, _ in monitor.hung()} == {"scheduler", "worker"}


def test_heartbeats_of_an_actor_not_watched_are_ignored() -> None:
    monitor = HeartbeatMonitor(SupervisionConfig())
    monitor.beat(stats("detokenizer", stalled_s=1e6))  # an old incarnation's last words
    assert monitor.hung() == [] and monitor.latest == {}


def test_the_restart_budget_is_a_rate() -> None:
    budget = RestartBudget(SupervisionConfig(restart_budget=3, restart_window_s=0.3))
    assert [budget.allow("tokenizer") for _ in range(4)] == [True, True, True, False]
    assert budget.allow("worker")  # per actor
    time.sleep(0.35)
    assert budget.allow("tokenizer")  # the window moved on
    assert budget.total == {"tokenizer": 4, "worker": 1}


def test_an_actor_that_keeps_failing_to_start_is_given_up_on() -> None:
    budget = RestartBudget(SupervisionConfig(max_failed_starts=2))
    assert budget.allow("worker")
    budget.started("worker", ok=False)
    assert budget.allow("worker")
    budget.started("worker", ok=False)
    assert not budget.allow("worker")
    budget.started("worker", ok=True)  # (a start that succeeds resets the count)
    assert budget.allow("worker")
