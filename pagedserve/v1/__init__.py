"""Stubs generated from proto/ by `make proto` (tests/unit/test_proto_contract.py fails when they are stale)."""
