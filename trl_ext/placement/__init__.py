"""Where this process is, asked and answered without starting anything: who started it and its job (``orchestrators``,
the one reader of the orchestrators' variables: which machines, which one am I, where do we meet, which run is this,
was I restarted), which output directory is the run's and what the run records there across its attempts
(``ownership``), how many attempts failed in a row (``failure_limit``), and how each rank ended (``outcome``).
Nothing here imports torch or transformers: a batch script and a launcher read it before anything loads."""
