"""The benchmarks: one module per benchmark, run from the checkout as `python -m benchmarks.NAME`, sharing
`harness`. Not part of the installed package; what each measures and how: docs/benchmarks.md."""
