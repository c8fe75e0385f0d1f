"""``ai-backend limit``, what this machine could do for one model with no serving layer: ``cli``
(its arguments, what it measures and the JSON report), ``photos`` (the images), ``cost`` (CPU time
per call), ``measure`` (decode, forward, pipelined), ``every_core`` (one process per core),
``model`` (the model and the runtime) and ``report`` (the limit and its markdown)."""
