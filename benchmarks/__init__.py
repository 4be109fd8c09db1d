"""pagellm benchmarks: `python -m benchmarks <kind>` or `pagellm bench <kind>`.

Each kind prints a Markdown table and writes <out>/<kind>.json, <out>/<kind>.md and, where a
picture helps, <out>/<kind>.png (default out: results/). See benchmarks/README.md.
"""
