"""`python -m flexevict.bench` (the throughput benchmark) and
`python -m flexevict.bench.kernels`."""
