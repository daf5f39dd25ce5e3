"""Benchmarks and reports: the tools layer, above the library and below the CLI.

They use the library (train, step, metrics, collectives) as a user would, and the thin
`trainspec.cli` commands call them: `trainspec bench step` (step_bench), `trainspec bench
collectives` (collectives_bench, collectives_report) and `trainspec report` (metrics_report).
Nothing in the library imports from here.
"""
