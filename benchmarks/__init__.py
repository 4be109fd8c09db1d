"""`python -m benchmarks <kind>` in a source checkout: the benchmarks are pagellm.benchmarks
(installed with pagellm, also as `pagellm bench <kind>`)."""
