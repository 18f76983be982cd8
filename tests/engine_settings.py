"""Engine settings that tests share."""

from pagedserve.config import SupervisionConfig

# For an engine none of whose actors a test kills: standby processes (supervisor.py) import
# torch or transformers as the engine comes up, CPU time the test's own actors then lack.
NO_STANDBY = SupervisionConfig(standby_processes=False)
