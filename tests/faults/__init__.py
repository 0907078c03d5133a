"""The fault-injection harness: ``python -m tests.faults`` (docs/faults.md); its CI subset is test_faults.py."""
