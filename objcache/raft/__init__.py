"""The Raft-replicated state (pysyncobj): the state machine every member applies and the
trio-facing member that commits commands to it."""
