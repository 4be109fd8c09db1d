"""pagellm benchmarks: `pagellm bench <kind>` (installed), or `python -m benchmarks <kind>` in a
source checkout.

Each kind prints a Markdown table and writes <out>/<kind>.json, <out>/<kind>.md and, where a
picture helps, <out>/<kind>.png (default out: results/). See benchmarks/README.md in the source tree.
"""
