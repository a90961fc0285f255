"""Benchmarks: python -m roformer.bench <rope|step|hf|scaling|input|gpu> --json OUT."""
