"""The iteration subflows run without a heartbeat thread of their own, on the run's settings.

    .venv/bin/python -m pytest -q tests/flows/test_subflow_settings.py
"""

from __future__ import annotations


def test_subflow_settings_turn_the_heartbeat_off_and_keep_everything_else():
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from flows.training import SubflowSettings

    subflow = SubflowSettings()
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        with subflow() as ctx:
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
            assert PREFECT_API_URL.value() == "http://127.0.0.1:9/api"
            built = ctx.settings
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == 30  # the parent run keeps its heartbeat
        with subflow() as ctx:
            assert ctx.settings is built  # built once per run, not per iteration
