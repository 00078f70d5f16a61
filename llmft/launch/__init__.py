"""The job scripts' logic, for every scheduler: knobs (knobs), and the PBS job (pbs)."""
