"""Test support for the harness's own unit tests (Hypothesis strategies, loading scripts)."""
