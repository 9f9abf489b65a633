"""Choosing a placement: `calibration` (this machine's measured rates, cached), `costmodel`
(FlexGen's cost model: predicted prefill and decode time per schedule layer) and `search` (the
placement that maximises predicted throughput within memory limits, for `auto`).

Its input is typed: a `search.PlacementRequest` (each placement field a value or None where
the search chooses), `search.Limits` (bytes per resource) and a `CostModel` (the model config,
the run's lengths, the policy spec, a calibration). Command-line flags are translated into
these by `flexevict.cli`; nothing here reads argparse namespaces.

May import `flexevict.runtime` (the memory plan, placements, the engine it calibrates with),
`flexevict.core`, `flexevict.io`, `flexevict.policies` and `flexevict.errors`.
"""
