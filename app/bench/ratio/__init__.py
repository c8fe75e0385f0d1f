"""The service's throughput at saturation as a share of the in-process limit (``python -m
app.bench.ratio``, run by ``scripts/bench_ratio.sh``): ``cli`` (its subcommands), ``profile``
(py-spy and per-thread CPU), ``report`` (the ratio and its markdown) and ``compare`` (variants
side by side)."""
