"""Test stand-in package (kvmaster harness; not SGLang code)."""
