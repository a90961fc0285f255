"""Benchmarks: python -m roformer.bench <rope|step|hf|scaling|input> --json OUT."""
