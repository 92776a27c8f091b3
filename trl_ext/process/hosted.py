"""Ray's flag (``HOSTED``): set where a rank runs inside a process that outlives the run and that its host ends (a Ray
Train worker)."""

# Set where a rank runs inside such a process: the run ends by returning, never by exiting the process.
HOSTED = "TRL_EXT_HOSTED_RANK"
